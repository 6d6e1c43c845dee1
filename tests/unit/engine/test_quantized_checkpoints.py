"""Quantized checkpoints in the release layouts (`epd make-model --quantize`): the engine's
weights are each format's dequantization, done here again in plain Python over the stored
tensors; FP8 blocks as transformers dequantizes them, compressed-tensors' as its package
does; greedy tokens as on the dequantized
float checkpoint; what is not served, or a checkpoint missing a tensor, refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from testkit.compressed_tensors_reference import decompressed_weights, reference_available

from epd.tools.make_model import QUANTIZE_SCHEMES
from epd.tools.quantize_model import SCHEMES, quantize_model
from epd.transport.weights.checkpoint_error import CheckpointError

PREFIX = "model.language_model.layers.0."


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """scheme -> a copy of the tiny checkpoint with its linears in that release format."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for scheme in QUANTIZE_SCHEMES:
        shutil.copytree(tiny_model, root / scheme)
        quantize_model(root / scheme, scheme)
        out[scheme] = root / scheme
    return out


def test_the_cli_offers_every_scheme_the_writer_writes():
    assert QUANTIZE_SCHEMES == SCHEMES


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _fields(word: int) -> list[int]:
    """An int32's eight 4-bit fields, field 0 first."""
    return [(word >> (4 * i)) & 15 for i in range(8)]


def _unpack_rows(packed: torch.Tensor, order=range(8)) -> list[list[int]]:
    """[rows, n / 8] int32 -> rows of n values; field i of each word holds value order[i]."""
    rows = []
    for row in packed.tolist():
        values = []
        for word in row:
            fields = _fields(word)
            values += [fields[list(order).index(j)] for j in range(8)]
        rows.append(values)
    return rows


def _reference(t: dict[str, torch.Tensor], module: str, scheme: str) -> torch.Tensor:
    """The float32 weight [out, in] of `module`, dequantized as each format's documentation says."""
    if scheme == "fp8-block":
        w, s = t[module + ".weight"].float(), t[module + ".weight_scale_inv"]
        return torch.tensor([[w[r, c].item() * s[r // 128, c // 128].item() for c in range(w.shape[1])]
                             for r in range(w.shape[0])])
    if scheme in ("fp8-dynamic", "w8a8"):
        return t[module + ".weight"].float() * t[module + ".weight_scale"].float()
    if scheme == "w4a16":
        q = torch.tensor(_unpack_rows(t[module + ".weight_packed"])).float() - 8
        scale = t[module + ".weight_scale"].float()
        return q * scale.repeat_interleave(q.shape[1] // scale.shape[1], 1)
    if scheme == "awq":
        awq = (0, 2, 4, 6, 1, 3, 5, 7)
        q = torch.tensor(_unpack_rows(t[module + ".qweight"], awq)).float()  # [in, out]
        zeros = torch.tensor(_unpack_rows(t[module + ".qzeros"], awq)).float()
        scales = t[module + ".scales"].float()
        group = q.shape[0] // scales.shape[0]
        return ((q - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)).t()
    q = torch.tensor(_unpack_rows(t[module + ".qweight"].t().contiguous())).float().t()  # gptq: packed along in
    zeros = torch.tensor(_unpack_rows(t[module + ".qzeros"])).float() + 1
    scales = t[module + ".scales"].float()
    group = q.shape[0] // scales.shape[0]
    return ((q - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)).t()


@pytest.mark.parametrize("scheme", QUANTIZE_SCHEMES)
def test_the_engine_weights_are_the_formats_dequantization(scheme, quantized, tiny_model):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    model_dir = quantized[scheme]
    model = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    stored, original = _tensors(model_dir), _tensors(tiny_model)
    layer = model.model.layers[0]
    q = _reference(stored, PREFIX + "self_attn.q_proj", scheme)
    down = _reference(stored, PREFIX + "mlp.down_proj", scheme)
    assert torch.equal(layer.self_attn.qkv_proj.weight[:q.shape[0]], q)
    assert torch.equal(layer.mlp.down_proj.weight, down)
    # ... and the format's rounding of the float weights: within a step of its grid
    w = original[PREFIX + "mlp.down_proj.weight"].float()
    step = {"fp8-block": 2 ** -3, "fp8-dynamic": 2 ** -3, "w8a8": 1 / 127, "w4a16": 1 / 7, "awq": 1 / 7,
            "gptq": 1 / 7}[scheme]
    assert (down - w).abs().max() <= step * w.abs().max() + 1e-6
    assert 0 < (down - w).abs().max()  # quantized, not copied
    # the rest is the checkpoint's float: the vision tower is not in the release's quantized set
    assert not any(name.startswith("model.visual.") and t.dtype in (torch.int8, torch.int32, torch.float8_e4m3fn)
                   for name, t in stored.items())


def test_fp8_blocks_are_what_transformers_dequantizes(quantized):
    from transformers import AutoModelForImageTextToText, FineGrainedFP8Config
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    model_dir = quantized["fp8-block"]
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                     quantization_config=FineGrainedFP8Config(dequantize=True))
    ours = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    for i, layer in enumerate(hf.model.language_model.layers):
        assert torch.equal(ours.model.layers[i].mlp.down_proj.weight, layer.mlp.down_proj.weight.float())
        attn = layer.self_attn
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
        assert torch.equal(ours.model.layers[i].self_attn.qkv_proj.weight, qkv)


def _dequantized_copy(model_dir, scheme, out):
    """The quantized checkpoint written back in float32 by `_reference`, without quantization_config."""
    shutil.copytree(model_dir, out)
    stored = _tensors(model_dir)
    parts = {name.rsplit(".", 1)[0] for name in stored if name.endswith((".weight_scale_inv", ".weight_scale",
                                                                          ".scales"))}
    plain = {name: t for name, t in stored.items() if name.rsplit(".", 1)[0] not in parts}
    plain.update({module + ".weight": _reference(stored, module, scheme).contiguous() for module in parts})
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_greedy_tokens_equal_the_dequantized_float_checkpoints(quantized, tmp_path):
    from epd import LLM, SamplingParams

    scheme = "w4a16"  # one LLM pair (the weights of every scheme are checked above)
    reference = _dequantized_copy(quantized[scheme], scheme, tmp_path / "float")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    prompts = ["The quick brown fox", "Describe this image in detail."]
    runs = []
    for model_dir in (quantized[scheme], reference):
        llm = LLM(str(model_dir))
        runs.append([o.outputs[0] for o in llm.generate(prompts, params)])
        del llm
    for got, want in zip(*runs):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def test_w8a8_linears_hold_the_checkpoints_int8_rows_and_scales(quantized):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model
    from epd.transport.weights.quant.int8_linear import Int8Linear

    model_dir = quantized["w8a8"]
    model = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    stored = _tensors(model_dir)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.language_model.layers.{i}."
        for fused, pieces in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.self_attn.o_proj, ("self_attn.o_proj",)),
                              (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.mlp.down_proj, ("mlp.down_proj",))):
            assert type(fused) is Int8Linear  # no float copy of the weight: int8 and a scale per row
            want_q = torch.cat([stored[prefix + p + ".weight"] for p in pieces])
            want_scale = torch.cat([stored[prefix + p + ".weight_scale"].float().reshape(-1) for p in pieces])
            assert torch.equal(fused.weight_q, want_q) and torch.equal(fused.weight_scale.view(-1), want_scale)
    assert type(model.lm_head) is not Int8Linear  # left in float by the release
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and p.shape[0] > 1
                   for name, p in model.model.layers.named_parameters())


# W8A8 quantizes each token's activations to int8 at run time: not the dequantized float
# checkpoint's math. Stated tolerance on the tiny preset (logits of std 8): the first token's
# top-1 equal and its top-5 logprobs within 0.5 of the float model's on held prompts.
W8A8_LOGPROB_TOLERANCE = 0.5


def test_w8a8_runs_int8_within_its_tolerance(quantized, tmp_path):
    from epd import LLM, SamplingParams
    from epd.transport.weights.quant.int8_linear import Int8Linear

    reference = _dequantized_copy(quantized["w8a8"], "w8a8", tmp_path / "float")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompts = ["The quick brown fox", "Describe this image in detail.", "Numbers: 0 1 2 3", "def main(): return"]
    runs = []
    for model_dir in (quantized["w8a8"], reference):
        llm = LLM(str(model_dir))
        kinds = {type(m) for m in llm.engine.runner.model.model.layers[0].modules()}
        assert (Int8Linear in kinds) == (model_dir == quantized["w8a8"])  # the float copy stays float
        runs.append([o.outputs[0].logprobs[0] for o in llm.generate(prompts, params)])
        del llm
    for got, want in zip(*runs):
        assert got.top[0][0] == want.top[0][0]
        want_top = dict(want.top)
        close = [abs(lp - want_top[t]) for t, lp in got.top if t in want_top]
        assert len(close) >= 4 and max(close) < W8A8_LOGPROB_TOLERANCE, (got.top, want.top)


def test_w8a8_under_lora_runs_its_dequantized_weights(quantized, tmp_path):
    from epd import LLM, SamplingParams
    from epd.transport.weights.quant.int8_linear import Int8Linear

    reference = _dequantized_copy(quantized["w8a8"], "w8a8", tmp_path / "float")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokens = []
    for model_dir in (quantized["w8a8"], reference):
        llm = LLM(str(model_dir), enable_lora=True)
        assert not any(type(m) is Int8Linear for m in llm.engine.runner.model.modules())  # the adapters wrap floats
        tokens.append(llm.generate(["The quick brown fox"], params)[0].outputs[0].token_ids)
        del llm
    assert tokens[0] == tokens[1]


def test_a_format_not_served_stops_start_up_naming_it(quantized, tmp_path):
    from epd import LLM

    bad = tmp_path / "awq-gemv"
    shutil.copytree(quantized["awq"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="awq version gemv"):
        LLM(str(bad))


def test_a_missing_scale_is_named(quantized, tmp_path):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    bad = tmp_path / "no-scale"
    shutil.copytree(quantized["w8a8"], bad)
    stored = _tensors(bad)
    del stored[PREFIX + "mlp.up_proj.weight_scale"]
    save_file(stored, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor '.*layers\.0\.mlp\.up_proj\.weight_scale'"):
        load_language_model(bad, AutoConfig.from_pretrained(bad), torch.float32)


def test_a_quantized_module_the_config_leaves_in_float_is_refused(quantized, tmp_path):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    bad = tmp_path / "ignored"
    shutil.copytree(quantized["fp8-block"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("layers.1.mlp.down_proj")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="leaves .*layers.1.mlp.down_proj.* in float"):
        load_language_model(bad, AutoConfig.from_pretrained(bad), torch.float32)


@pytest.mark.parametrize("scheme", ["fp8-block", "w8a8", "w4a16"])
def test_moe_experts_are_read_apart_as_the_releases_store_them(scheme, tmp_path):
    from testkit.family_checkpoints import family_checkpoint
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    model_dir = tmp_path / scheme
    shutil.copytree(family_checkpoint("qwen3_vl_moe"), model_dir)
    quantize_model(model_dir, scheme)
    stored = _tensors(model_dir)
    assert PREFIX + "mlp.experts.5.up_proj.weight_scale" + ("_inv" if scheme == "fp8-block" else "") in stored
    model = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    moe = model.model.layers[0].mlp
    inter = moe.w2.shape[2]
    for e in (0, 5):
        expert = f"{PREFIX}mlp.experts.{e}."
        assert torch.equal(moe.w13[e, :inter], _reference(stored, expert + "gate_proj", scheme))
        assert torch.equal(moe.w13[e, inter:], _reference(stored, expert + "up_proj", scheme))
        assert torch.equal(moe.w2[e], _reference(stored, expert + "down_proj", scheme))
    stored = {k: v for k, v in stored.items() if not k.startswith(PREFIX + "mlp.experts.3.down_proj")}
    save_file(stored, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor '.*layers\.0\.mlp\.experts\.3\.down_proj\.weight'"):
        load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)


def test_zero_points_of_a_symmetric_scheme_are_read_only_when_zero(quantized, tmp_path):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    model_dir = tmp_path / "zero-points"
    shutil.copytree(quantized["w8a8"], model_dir)
    stored = _tensors(model_dir)
    module = PREFIX + "mlp.up_proj"
    stored[module + ".weight_zero_point"] = torch.zeros(stored[module + ".weight_scale"].shape, dtype=torch.int8)
    save_file(stored, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    model = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    inter = model.model.layers[0].mlp.intermediate_size
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[inter:], _reference(stored, module, "w8a8"))
    stored[module + ".weight_zero_point"][0] = 3
    save_file(stored, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="nonzero zero points"):
        load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)


@pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the reference")
def test_compressed_tensors_weights_are_what_the_package_decompresses(quantized, tmp_path):
    from transformers import AutoConfig

    from epd.engine.loader import load_language_model

    names = [PREFIX + "self_attn.q_proj", PREFIX + "self_attn.v_proj", PREFIX + "mlp.down_proj"]
    schemes = ("fp8-dynamic", "w8a8", "w4a16")
    refs = decompressed_weights([quantized[s] for s in schemes], names, tmp_path)
    for scheme, ref in zip(schemes, refs):
        model_dir = quantized[scheme]
        layer = load_language_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32).model.layers[0]
        q, v = ref[names[0]], ref[names[1]]
        assert torch.equal(layer.self_attn.qkv_proj.weight[:q.shape[0]], q), scheme
        assert torch.equal(layer.self_attn.qkv_proj.weight[-v.shape[0]:], v), scheme
        assert torch.equal(layer.mlp.down_proj.weight, ref[names[2]]), scheme



@pytest.mark.parametrize("scheme", ["awq", "gptq"])
def test_weight_only_linears_run_their_bits_with_the_dequantized_tokens(scheme, quantized, tiny_model, tmp_path,
                                                                       monkeypatch):
    """The kernel's linears (no float copy) against the same checkpoint read the old way, its
    weights dequantized into float linears (EPD_WEIGHT_ONLY_KERNEL=0): greedy tokens equal, the
    logprobs within float32's order of sums. GPTQ runs under a LoRA adapter: its delta is added
    after the quantized base linear."""
    from testkit.lora_adapters import make_adapter

    from epd import LLM, SamplingParams
    from epd.transport.weights.quant.weight_only_linear import WeightOnlyLinear, load
    from epd.transport.wire.lora_request import LoRARequest

    if load() is None:
        pytest.skip("no C compiler: the loader keeps the float path")
    lora = scheme == "gptq"
    options = dict(enable_lora=True, max_loras=1, max_lora_rank=8) if lora else {}
    adapter = LoRARequest("a", 1, make_adapter(tiny_model, tmp_path / "adapter", r=4, seed=5)) if lora else None
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    runs = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("EPD_WEIGHT_ONLY_KERNEL", kernel)
        llm = LLM(str(quantized[scheme]), **options)
        layers = llm.engine.runner.model.model.layers
        quantized_linears = [m for m in layers.modules() if type(m) is WeightOnlyLinear]
        assert len(quantized_linears) == (4 * len(layers) if kernel == "1" else 0)  # qkv, o, gate_up, down
        if kernel == "1":  # 4 bits a weight and a scale and zero point a group, against float32's 32 bits
            held = sum(t.numel() * t.element_size() for m in quantized_linears for t in m.buffers())
            assert held < 0.2 * sum(4 * m.in_features * m.out_features for m in quantized_linears)
        prompts = ["The quick brown fox", "The quick brown fox" if lora else "Numbers: 0 1 2 3"]
        outs = llm.generate(prompts, params, lora_request=[adapter, None] if lora else None)
        runs.append([o.outputs[0] for o in outs])
        del llm
    if lora:
        assert runs[0][0].token_ids != runs[0][1].token_ids  # the adapter's delta took part
    for got, want in zip(*runs):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
