"""`epd make-model --quantize`: a made checkpoint's language-model linears rewritten in a
release format, with the tensor names and config keys the releases use.

  fp8-block    Qwen's FP8 releases: quant_method fp8, weight_block_size [128, 128],
               float8_e4m3fn `weight` + float32 `weight_scale_inv` per block
  fp8-dynamic  RedHat's FP8-dynamic: compressed-tensors float-quantized, fp8 per channel
  w8a8         RedHat's quantized.w8a8: compressed-tensors int-quantized, int8 per channel,
               activations int8 per token, dynamic
  w4a16        RedHat's quantized.w4a16: compressed-tensors pack-quantized, int4 per group, symmetric
  awq          AutoAWQ's GEMM layout: 4-bit, zero points, float16 scales per group
  gptq         AutoGPTQ's layout: 4-bit, symmetric, desc_act false

Quantized: every 2-D `*_proj.weight` of the language model's layers, MoE experts written
apart first as the releases store them; the vision tower,
embeddings, norms, `lm_head` and MoE routers stay as they were (and are listed as left
out, as the releases list them). The group size of the 4-bit formats is 128 where every
quantized linear's input size divides by it, else the largest of 64, 32, 16, 8 that does
(a tiny preset's 64-wide layers). The exact values are whatever rounding gives: the
loader's dequantization is the reference a test compares with.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from epd.transport.weights.quant.int_packing import AWQ_ORDER, pack_int4

SCHEMES = ("fp8-block", "fp8-dynamic", "w8a8", "w4a16", "awq", "gptq")  # make_model.QUANTIZE_SCHEMES, torch-free
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_LINEAR = re.compile(r"layers\.\d+\..*_proj\.weight$")
_VISION = ("model.visual.", "visual.")


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and _LINEAR.search(name) is not None and not name.startswith(_VISION)


def quantize_model(model_dir: str | Path, scheme: str) -> None:
    """Rewrites `model_dir`'s safetensors and config.json in `scheme`'s release layout."""
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"unknown --quantize {scheme!r}; choose one of {', '.join(SCHEMES)}")
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    shards = {path: load_file(str(path)) for path in files}
    shards = {path: _experts_apart(tensors) for path, tensors in shards.items()}
    in_sizes = {t.shape[1] for shard in shards.values() for n, t in shard.items() if is_quantized_linear(n, t)}
    group = next((g for g in (128, 64, 32, 16, 8) if all(size % g == 0 for size in in_sizes)), None)
    if group is None and scheme in ("w4a16", "awq", "gptq"):
        raise ValueError(f"--quantize {scheme}: the linears' input sizes {sorted(in_sizes)} share no group size "
                         f"of 8 or more")
    weight_map = {}
    for path, tensors in shards.items():
        out = {}
        for name, tensor in tensors.items():
            if not is_quantized_linear(name, tensor):
                out[name] = tensor
                continue
            module = name[:-len(".weight")]
            for suffix, part in _quantize(tensor.float(), scheme, group).items():
                out[f"{module}.{suffix}"] = part
        save_file(out, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in out})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        index.write_text(json.dumps({**meta, "weight_map": weight_map}, indent=2) + "\n")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(scheme, group)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _experts_apart(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused MoE experts (`mlp.experts.gate_up_proj` [E, 2 * inter, hidden], `down_proj`
    [E, hidden, inter]: transformers' in-memory orientation, what make-model writes) as the
    quantized releases store them: `mlp.experts.<e>.{gate,up,down}_proj.weight`, [out, in] each."""
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(".mlp.experts.gate_up_proj") and not name.endswith(".mlp.experts.down_proj"):
            out[name] = tensor
            continue
        prefix = name.rsplit(".", 1)[0]
        for e, expert in enumerate(tensor):
            if name.endswith("gate_up_proj"):
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = expert
    return out


def quantization_config(scheme: str, group: int) -> dict:
    """config.json's quantization_config for `scheme`, with the releases' keys."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate"]}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["visual", "mlp.gate"]}
    if scheme == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01, "lm_head": False}
    fmt, weights, acts = {
        "fp8-dynamic": ("float-quantized", _args("float", 8, "channel"), _args("float", 8, "token", dynamic=True)),
        "w8a8": ("int-quantized", _args("int", 8, "channel"), _args("int", 8, "token", dynamic=True)),
        "w4a16": ("pack-quantized", _args("int", 4, "group", group_size=group), None),
    }[scheme]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "ignore": ["lm_head", "re:.*visual.*", "re:.*mlp.gate$"], "kv_cache_scheme": None,
            "sparsity_config": {}, "global_compression_ratio": None}


def _args(kind: str, bits: int, strategy: str, group_size: int | None = None, dynamic: bool = False) -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, "group_size": group_size,
            "dynamic": dynamic, "actorder": None, "block_structure": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}}


def _quantize(w: torch.Tensor, scheme: str, group: int) -> dict[str, torch.Tensor]:
    """float32 [out, in] -> the format's tensors for one linear, by suffix."""
    if scheme == "fp8-block":
        return _fp8_block(w, 128)
    if scheme == "fp8-dynamic":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [out, 1]
        return {"weight": (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}
    if scheme == "w8a8":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127  # [out, 1]
        return {"weight": (w / scale).round().clamp(-127, 127).to(torch.int8), "weight_scale": scale}
    if scheme == "w4a16":
        out, cols = w.shape
        scale = w.view(out, cols // group, group).abs().amax(-1).clamp(min=1e-12) / 7  # [out, groups]
        q = (w / scale.repeat_interleave(group, 1)).round().clamp(-8, 7)
        return {"weight_packed": pack_int4(q + 8, dim=1), "weight_scale": scale,
                "weight_shape": torch.tensor([out, cols])}
    return _awq(w, group) if scheme == "awq" else _gptq(w, group)


def _fp8_block(w: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    out, cols = w.shape
    rows_b, cols_b = -(-out // block), -(-cols // block)
    padded = torch.zeros(rows_b * block, cols_b * block)
    padded[:out, :cols] = w
    tiles = padded.view(rows_b, block, cols_b, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [rows_b, cols_b]
    full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :cols]
    return {"weight": (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def _awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    wt = w.t()  # [in, out]
    cols, out = wt.shape
    g = wt.reshape(cols // group, group, out)
    lo, hi = g.amin(1), g.amax(1)  # [groups, out]
    scale = ((hi - lo).clamp(min=1e-8) / 15).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (wt / scale.float().repeat_interleave(group, 0)).round() + zero.repeat_interleave(group, 0)
    return {"qweight": pack_int4(q.clamp(0, 15), dim=1, order=AWQ_ORDER),
            "qzeros": pack_int4(zero, dim=1, order=AWQ_ORDER), "scales": scale}


def _gptq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    wt = w.t()  # [in, out]
    cols, out = wt.shape
    scale = (wt.reshape(cols // group, group, out).abs().amax(1).clamp(min=1e-8) / 7).half()  # [groups, out]
    q = (wt / scale.float().repeat_interleave(group, 0)).round().clamp(-8, 7) + 8
    zeros = torch.full((cols // group, out), 7)  # 8, stored less one as AutoGPTQ does
    return {"qweight": pack_int4(q, dim=0), "qzeros": pack_int4(zeros, dim=1), "scales": scale,
            "g_idx": torch.arange(cols, dtype=torch.int32) // group}
