"""`--kv-cache-dtype fp8` end to end on tiny float32 checkpoints: greedy tokens and top-5 logprobs
against the float KV (Qwen3-VL and Qwen2.5-VL), a model whose K is far past e4m3's range (where a
per-layer scale of 1.0, vLLM's default, corrupts and a row's own scale does not), and the
prefill -> decode hand-over of fp8 blocks."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd import LLM
from epd.engine.attention import fp8_kv
from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.transport.wire.sampling import SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(100 + 37 * i, 140 + 67 * i))} for i in range(3)]  # 40, 70, 100 tokens
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
# The largest |logprob| difference of a top-5 token, fp8 KV against float32 KV, while the tokens agree
# (measured on these prompts: e4m3 0.56 Qwen3-VL / 0.36 Qwen2.5-VL, e5m2 1.40 / 0.96; random tiny
# models have flat, touchy distributions); the tokens may part only where float's top two are closer
# than twice the bound.
BOUNDS = {"fp8": 0.75, "fp8_e5m2": 2.0}


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("ckpt") / "qwen2.5-vl-tiny", preset="qwen2.5-vl-tiny", seed=0))


def _generate(model: str, kv_cache_dtype: str):
    llm = LLM(model, num_kv_blocks=64, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype)
    return [out.outputs[0] for out in llm.generate(PROMPTS, PARAMS)]


def _distance(reference, outputs, bound: float) -> float:
    """The largest top-5 logprob difference while the tokens agree; asserts a parting is a near tie."""
    worst = 0.0
    for ref, out in zip(reference, outputs):
        for step, (a, b) in enumerate(zip(ref.logprobs, out.logprobs)):
            top = dict(b.top)
            worst = max(worst, *(abs(lp - top[t]) for t, lp in a.top if t in top))
            if ref.token_ids[step] != out.token_ids[step]:
                assert a.top[0][1] - a.top[1][1] < 2 * bound, f"step {step}: not a near tie"
                break
    return worst


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_fp8_kv_stays_within_its_bound_of_the_float_kv(family, request):
    model = request.getfixturevalue("tiny_model" if family == "qwen3_vl" else "qwen2_5_vl")
    reference = _generate(model, "auto")
    for kv_cache_dtype, bound in BOUNDS.items():
        outputs = _generate(model, kv_cache_dtype)
        assert 0 < _distance(reference, outputs, bound) <= bound, kv_cache_dtype
        assert [o.token_ids[:2] for o in outputs] == [r.token_ids[:2] for r in reference]


def _per_layer_one(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """vLLM's default: k_scale = v_scale = 1.0, x cast as it is (e4m3 saturates at 448, e5m2 overflows)."""
    packed = torch.empty(*x.shape[:-1], x.shape[-1] + fp8_kv.SCALE_BYTES, dtype=torch.uint8)
    packed[..., :-fp8_kv.SCALE_BYTES] = x.float().to(dtype).view(torch.uint8)
    packed[..., -fp8_kv.SCALE_BYTES:] = torch.ones(*x.shape[:-1], 1).view(torch.uint8)
    return packed.view(dtype)


def test_large_k_corrupts_a_per_layer_scale_of_one_not_a_rows_own(qwen2_5_vl, tmp_path, monkeypatch):
    """K x 1e5 (to ~80,000) and q x 20 / 1e5: sharp attention over keys far past e4m3's 448."""
    model = tmp_path / "large-k"
    shutil.copytree(qwen2_5_vl, model)
    weights = load_file(model / "model.safetensors")
    for name in weights:
        if ".self_attn.k_proj." in name or ".self_attn.q_proj." in name:
            weights[name] = weights[name] * (1e5 if ".k_proj." in name else 20 / 1e5)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    reference = _generate(str(model), "auto")
    own = _distance(reference, _generate(str(model), "fp8"), BOUNDS["fp8"])
    assert own <= BOUNDS["fp8"]
    monkeypatch.setattr(fp8_kv, "quantize", _per_layer_one)
    clipped = _generate(str(model), "fp8")
    assert [o.token_ids for o in clipped] != [r.token_ids for r in reference]
    first_step = max(abs(a - b) for r, o in zip(reference, clipped)
                     for (_, a), (_, b) in zip(r.logprobs[0].top, o.logprobs[0].top))
    assert first_step > 2 * own  # the first token's distribution already


def _core(model: str, role: str, kv_cache_dtype: str) -> EngineCore:
    config = EngineConfig.from_flat(num_kv_blocks=32, block_size=16, dtype="float32", device="cpu",
                                    kv_cache_dtype=kv_cache_dtype)
    return EngineCore(model, config, role=role)


def _run(core: EngineCore) -> list[int]:
    tokens = []
    while core.has_unfinished():
        tokens += [t for u in core.step().updates for t in u.new_token_ids]
    return tokens


def test_fp8_blocks_handed_over_decode_as_the_aggregated_fp8_engine(tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = PROMPTS[2]["prompt_token_ids"]
    aggregated = _core(tiny_model, "pd", "fp8")
    aggregated.add_request(Request("a", list(prompt), params))
    expected = _run(aggregated)
    prefill, decode = _core(tiny_model, "prefill", "fp8"), _core(tiny_model, "decode", "fp8")
    prefill.add_request(Request("r", list(prompt), params))
    first = _run(prefill)
    k, v = prefill.export_kv("r")
    info = prefill.info
    assert k.dtype == torch.float8_e4m3fn and k.shape[-1] == info.head_dim + fp8_kv.SCALE_BYTES
    float_bytes = 2 * k[..., :info.head_dim].numel() * 4  # the same blocks of float32 K and V
    assert 2 * k.nbytes / float_bytes == (info.head_dim + fp8_kv.SCALE_BYTES) / (4 * info.head_dim)
    request = Request("r", list(prompt), params, eos_token_ids=info.eos_token_ids)
    request.output_token_ids.append(first[0])
    assert decode.add_prefilled(request, k, v)
    assert first + _run(decode) == expected
    float_decode = _core(tiny_model, "decode", "auto")  # another --kv-cache-dtype: refused by name
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        float_decode.add_prefilled(Request("x", list(prompt), params), k, v)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        _core(tiny_model, "decode", "fp8_e5m2").add_prefilled(Request("y", list(prompt), params), k, v)
