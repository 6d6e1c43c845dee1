"""Whether this process's metrics are one of several API processes' (`--api-servers N`):
each writes its Prometheus samples to files in one directory, and any process's
/metrics renders their sum. The API edge and the orchestrator's worker metrics
both ask; prometheus_client reads the variable when it is first imported."""
from __future__ import annotations

import os

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def is_multiprocess() -> bool:
    """Whether this process is one of several API processes sharing metric files."""
    return bool(os.environ.get(MULTIPROC_DIR_ENV))
