"""Decodes EPD's KV event batches with vLLM's own event classes, in vLLM's venv.

`decode_with_vllm(payloads)` runs this file under vLLM's Python
(`EPD_VLLM_PYTHON`, default /work/vllm-venv/bin/python; `vllm_python()` is
None when it is absent). The child takes the class definitions of
`EventBatch`, `KVCacheEvent`, `BlockStored`, `BlockRemoved`,
`AllBlocksCleared` and `KVEventBatch` from vLLM's installed
`vllm/distributed/kv_events.py` as they are written there (its source, not a
copy: importing the module would load torch, ~20 s), decodes each payload
with `msgspec.msgpack.Decoder(KVEventBatch)` as a vLLM consumer does, and
answers per batch: each event's class name and fields, and whether
msgspec encodes the decoded batch back to the very same bytes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

VLLM_CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")


def vllm_python() -> str | None:
    path = os.environ.get("EPD_VLLM_PYTHON", "/work/vllm-venv/bin/python")
    return path if os.path.exists(path) else None


def decode_with_vllm(payloads: list[bytes]) -> list[dict]:
    job = json.dumps([p.hex() for p in payloads])
    proc = subprocess.run([vllm_python(), "-P", __file__], input=job, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _vllm_event_classes() -> dict:
    """vLLM's event classes, defined from its own source with what they need."""
    import ast
    import importlib.util
    from typing import Any

    import msgspec

    root = importlib.util.find_spec("vllm").submodule_search_locations[0]  # finds, does not import
    source = open(os.path.join(root, "distributed", "kv_events.py")).read()
    tree = ast.parse(source)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in VLLM_CLASSES]
    assert [c.name for c in classes] == list(VLLM_CLASSES), [c.name for c in classes]
    module = types.ModuleType("vllm_kv_events")  # msgspec resolves the annotations in the classes' module
    module.__dict__.update(msgspec=msgspec, Any=Any, ExternalBlockHash=bytes | int)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=classes, type_ignores=[]), "kv_events.py", "exec"), module.__dict__)
    return module.__dict__


def _main() -> None:
    import msgspec

    classes = _vllm_event_classes()
    decoder = msgspec.msgpack.Decoder(classes["KVEventBatch"])
    answers = []
    for payload in map(bytes.fromhex, json.load(sys.stdin)):
        batch = decoder.decode(payload)
        answers.append({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                        "events": [{"class": type(e).__name__, **msgspec.to_builtins(e)} for e in batch.events],
                        "same_bytes": msgspec.msgpack.encode(batch) == payload})
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    _main()
