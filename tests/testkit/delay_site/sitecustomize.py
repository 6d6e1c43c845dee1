"""Python imports this module at the start of every process whose PYTHONPATH names
its folder: testkit.server puts it there for a server whose environment asks for an
encoder delay (testkit/encoder_delays.py), and every process of that server inherits
it (the launcher, its forkserver and spawned workers, `epd worker`, Ray's workers).

Here, once `epd.encoders.encoder_worker` is imported, its `EncoderWorker` becomes
testkit's `DelayedEncoderWorker`, the class the worker entry then builds. The product
names none of this (docs/decisions/test-delays.md).
"""
from __future__ import annotations

import importlib.abc
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `testkit`
TARGET = "epd.encoders.encoder_worker"


class _DelayTheEncoderWorker(importlib.abc.MetaPathFinder):
    """Finds TARGET as the other finders do, and rebinds its class once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = next(s for f in sys.meta_path if hasattr(f, "find_spec") and (s := f.find_spec(name, path, target)))
        run_module = spec.loader.exec_module

        def run_then_rebind(module) -> None:
            run_module(module)
            from testkit.delayed_encoder import DelayedEncoderWorker

            module.EncoderWorker = DelayedEncoderWorker

        spec.loader.exec_module = run_then_rebind
        return spec


if TESTS not in sys.path:
    sys.path.append(TESTS)
sys.meta_path.insert(0, _DelayTheEncoderWorker())
