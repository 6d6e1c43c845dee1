"""`epd serve` of Qwen3.5 (hybrid Gated DeltaNet: per-request state in the engine's state cache):
a text and a two-image chat give transformers' greedy text, streamed and not, aggregated (the
images encoded in-process) and in e-p-d (embeddings from an encoder worker into a prefill
worker, which hands each request's KV and Gated DeltaNet state to the decode worker; prompts
over several chunks of 16 tokens, none prefilled on the decode worker). In e-p-d the top-5
logprobs of each step are transformers' too, and `epd:kv_transfer_bytes` counts each
request's state beside its KV blocks. A response_format json_schema answer holds its schema
in both modes (in e-p-d the grammar's state crosses the hand-over with the request's). /metrics
shows each engine worker's state cache usage, and the repeated chats' prefix hits resumed from
state snapshots (the e-p-d top-5 are a hit's).
(e-pd, the encoder worker into one prefill+decode engine, runs no path e-p-d does not.)"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from testkit.hf_reference import _load, hf_generate_text, hf_inputs
from testkit.media import CHATS
from testkit.server import chat_text, served_top5, start_server

MAX_TOKENS = 10
CHAT_NAMES = ["text_only", "two_images"]
BLOCK_SIZE = 16  # the server's default --block-size
E_P_D = ("--max-num-batched-tokens", "16", "--max-local-prefill-tokens", "0")  # chunked; every prompt handed over


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen3.5-tiny", "qwen3.5-tiny", seed=0))


@torch.no_grad()
def reference_top5(model_dir: str, messages: list[dict], images: list[bytes]) -> list[list[tuple[int, float]]]:
    """transformers' greedy steps, EOS ignored: each step's top-5 (token id, logprob)."""
    model = _load(model_dir)[0]
    out = model.generate(**hf_inputs(model_dir, messages, images), max_new_tokens=MAX_TOKENS,
                         min_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    top = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).topk(5)  # [MAX_TOKENS, 5]
    return [list(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist())]


def handover_bytes(model_dir: str, num_prompt_tokens: int) -> int:
    """One request's KV blocks (its full-attention layers' only, float32) and its Gated DeltaNet
    layers' state: conv [conv_dim, kernel - 1] and recurrent [value heads, k_dim, v_dim], float32."""
    c = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]
    num_blocks = -(-num_prompt_tokens // BLOCK_SIZE)
    kv = 2 * c["layer_types"].count("full_attention") * num_blocks * BLOCK_SIZE * c["num_key_value_heads"] \
        * c["head_dim"] * 4
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] \
        + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    per_layer = conv_dim * (c["linear_conv_kernel_dim"] - 1) \
        + c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    return kv + 4 * per_layer * c["layer_types"].count("linear_attention")


def structured_chat(srv) -> str:
    """A greedy chat answered under response_format json_schema (vLLM's structured outputs)."""
    model = httpx.get(srv.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    body = {"model": model, "messages": CHATS["text_only"][0], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}}}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aggregated", "e-p-d"])
def test_served_text_equals_transformers(qwen3_5_checkpoint, mode, tmp_path):
    expected = {n: hf_generate_text(qwen3_5_checkpoint, CHATS[n][0], CHATS[n][1], max_new_tokens=MAX_TOKENS)
                for n in CHAT_NAMES}
    srv = start_server(qwen3_5_checkpoint, tmp_path, mode, *(E_P_D if mode == "e-p-d" else ()))
    try:
        for name in CHAT_NAMES:
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS) == expected[name], name
            assert chat_text(srv, CHATS[name][0], MAX_TOKENS, stream=True) == expected[name], name
        assert json.loads(structured_chat(srv))["n"] in range(10)  # the grammar holds across the hand-over
        usage = [line for line in httpx.get(srv.base_url + "/metrics", timeout=30).text.splitlines()
                 if line.startswith("epd:state_cache_usage_perc{")]
        num_engines = 2 if mode == "e-p-d" else 1  # a prefill and a decode worker: each its slots
        assert len(usage) == num_engines and all(0.0 <= float(u.split()[-1]) <= 1.0 for u in usage), usage
        if mode == "e-p-d":
            for name in CHAT_NAMES:
                before = srv.settled_sum("epd:kv_transfer_bytes_total")
                got, num_prompt_tokens = served_top5(srv, CHATS[name][0], MAX_TOKENS)
                assert num_prompt_tokens > 16  # over several chunks
                for step, (g, want) in enumerate(zip(got, reference_top5(qwen3_5_checkpoint, *CHATS[name]))):
                    assert [t for t, _ in g] == [t for t, _ in want], (name, step)
                    torch.testing.assert_close(torch.tensor([p for _, p in g]), torch.tensor([p for _, p in want]),
                                               rtol=0, atol=1e-4)
                assert srv.settled_sum("epd:kv_transfer_bytes_total") - before == \
                    handover_bytes(qwen3_5_checkpoint, num_prompt_tokens), name
        # each chat's repeats were prefix hits (on the prefill worker in e-p-d), resumed from state snapshots
        assert srv.settled_sum("epd:state_snapshot_hits_total") > 0
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"
