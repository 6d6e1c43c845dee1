"""One real `epd serve` per mode, shared by every module that serves the tiny
checkpoint in that mode with ordinary flags (tests/e2e/serve/test_serve.py,
test_structured_serve.py, test_early_prefill_serve.py, the aggregated one by
test_openai_conformance.py and the e-pd one by test_responses_api.py): a server
start costs seconds of both cores, so the same three servers serve them all. Session-scoped and parametrized,
so pytest runs every test of one mode before it starts the next mode's server.

The flags are the union of what those modules need, each for its reason:
* few KV blocks (56 of 16 tokens), so concurrent structured requests preempt;
* a stream interval per mode: aggregated sends every token, the others hold tokens;
* e-p-d: two encoders, a cache dir, text-only prompts up to 64 tokens prefilled
  on the decode worker, and one image size (SLOW_W x SLOW_H) held back
  HOLD_S in the encoder (early prefill; no other test sends that size);
* e-pd: a ~100 KiB cache (a few embeddings, then eviction), cores split."""
from __future__ import annotations

import os

from testkit.server import ServerProcess, free_port

# The modules that use them: one group for the test processes (tests/conftest.py, share_group).
SHARING_MODULES = frozenset(f"tests/e2e/{name}.py" for name in (
    "api/test_openai_conformance", "api/test_prompt_logprobs_serve", "api/test_readme_examples",
    "api/test_responses_api", "api/test_structured_serve", "api/test_vllm_conformance",
    "api/test_vllm_conformance_chat", "api/test_vllm_fields", "serve/test_early_prefill_serve",
    "serve/test_multi_turn_bench", "serve/test_serve", "serve/test_video_serve"))
SERVED_MODEL = "epd-test"
MODES = ["aggregated", "e-pd", "e-p-d"]
STREAM_INTERVALS = {"aggregated": 1, "e-pd": 3, "e-p-d": 4}
NUM_KV_BLOCKS = 56
MAX_LOCAL_PREFILL_TOKENS = 64
SLOW_W, SLOW_H, HOLD_S = 72, 56, 4.0  # the image size held back, and for how long


def start_mode_server(model: str, mode: str, tmp) -> ServerProcess:
    """`epd serve` of `model` in `mode` with the flags above, ready."""
    from testkit.encoder_delays import ENV_SLOW_IMAGE

    port = free_port()
    args = ["serve", model, "--mode", mode, "--port", str(port), "--served-model-name", SERVED_MODEL,
            "--num-kv-blocks", str(NUM_KV_BLOCKS), "--dtype", "float32", "--device", "cpu",
            "--threads-per-worker", "1", "--stream-interval", str(STREAM_INTERVALS[mode])]
    env = dict(os.environ)
    if mode == "e-p-d":  # shared cores (the default); e-pd splits them: the same outputs either way
        args += ["--encoders", "2", "--mm-cache-dir", str(tmp / "cache"), "--early-prefill",
                 "--max-local-prefill-tokens", str(MAX_LOCAL_PREFILL_TOKENS)]
        env[ENV_SLOW_IMAGE] = f"{SLOW_W}x{SLOW_H}:{HOLD_S}"
    if mode == "e-pd":
        args += ["--mm-cache-gb", "0.0001", "--cpu-sharing", "split"]
    srv = ServerProcess(args, port, str(tmp / f"server-{mode}-{port}.log"), env=env).wait_ready()
    srv.mode = mode
    srv.stream_interval = STREAM_INTERVALS[mode]
    return srv
