"""The generic serving path names no model family: the scheduler, block manager,
image ledger, runner, CUDA graphs, proposers, hand-over, wire and routers ask the
model (engine/models/causal_lm.py) and the family registry instead. A family's
name in one of them means a family's rule leaked into generic code."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FAMILY_NAMES = re.compile(r"qwen|gemma|internvl|intern_vl|glm|siglip", re.IGNORECASE)
GENERIC = [
    "engine/scheduler.py", "engine/scheduler_output.py", "engine/block_manager.py", "engine/image_ledger.py",
    "engine/model_runner.py", "engine/cuda_graphs.py", "engine/engine_core.py", "engine/early_prefill.py",
    "engine/kv_cache_sizer.py", "engine/spec/ngram.py", "engine/spec/eagle3_proposer.py", "engine/spec/decode.py",
    "engine/spec/verify.py", "engine/worker/kv_handover.py", "engine/worker/loop.py", "engine/worker/image_arrivals.py",
    "engine/attention/metadata.py", "engine/attention/torch_attention.py",
    "epd/serve/router.py", "epd/serve/encoder_router.py", "epd/serve/placement.py", "epd/serve/orchestrator.py",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "transport" / "wire").glob("*.py")),
]


def test_the_generic_path_names_no_family():
    offenders = []
    for name in GENERIC:
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if FAMILY_NAMES.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert offenders == [], "a family's rule in generic code (ask the model or the registry):\n" + "\n".join(offenders)


def test_every_listed_file_exists():
    assert [name for name in GENERIC if not (ROOT / name).is_file()] == []
