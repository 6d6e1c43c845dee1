"""Reading a Hugging Face safetensors checkpoint into our own modules.

Shared by the encoder (vision tower) and the engine (language model), which
each give a rule mapping checkpoint names to their parameters, optionally
into a shard of a fused parameter (q/k/v -> qkv_proj). Every parameter must
be filled exactly once with the right shape, or loading fails with a message
naming the tensor. A quantized checkpoint's linears are read as float weights
(transport/weights/quant/).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from epd.transport.weights.checkpoint_error import CheckpointError
from epd.transport.weights.quant.dequantize import dequantized, float_name
from epd.transport.weights.quant.quant_config import QuantConfig, read_quant_config

# A rule maps a checkpoint name to (parameter name, shard index) or None to skip.
# Shard index: None for a whole parameter, k for the k-th of the fused pieces.
NameRule = Callable[[str], "tuple[str, int | None] | None"]


# the separate projections a checkpoint holds, in the order our fused parameter stacks them
FUSED_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PIECE = re.compile(r"(layers\.\d+\.(?:self_attn|mlp|mlp\.shared_experts))\.(q_proj|k_proj|v_proj|gate_proj|up_proj)"
                    r"\.(weight|bias)$")


def fused_name(name: str) -> tuple[str, int] | None:
    """A separate projection's name -> (the fused parameter's name, its piece):
    "layers.3.self_attn.k_proj.weight" -> ("layers.3.self_attn.qkv_proj.weight", 1),
    "layers.3.mlp.up_proj.weight" -> ("layers.3.mlp.gate_up_proj.weight", 1); None for any other name."""
    m = _PIECE.match(name)
    if m is None:
        return None
    fused = next(f for f, pieces in FUSED_PIECES.items() if m[2] in pieces)
    return f"{m[1]}.{fused}.{m[3]}", FUSED_PIECES[fused].index(m[2])


def piece_name(name: str, shard: int) -> str:
    """A fused parameter's name and piece -> the separate projection's (`fused_name` backwards)."""
    fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
    return name.replace(fused, FUSED_PIECES[fused][shard])


def unfilled_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding whose table a checkpoint fills: no random init. Built under
    `torch.device("meta")`, `nn.Embedding`'s own init (normal_) goes through
    torch's reference ops, whose first use imports torch._dynamo: 2-4 s of
    every worker's start-up."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def materialize(module: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """`module`, built on "meta", with uninitialized storage on `device` (floating-point
    tensors in `dtype`) for a checkpoint to fill: what `to_empty(device).to(dtype)` gives
    without its second copy of the model, and without `empty_like` on meta tensors, which
    runs torch's reference ops (their first use imports torch._dynamo: seconds of start-up)."""
    def placed(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                sub._parameters[name] = nn.Parameter(placed(p), requires_grad=p.requires_grad)
        for name, b in sub._buffers.items():
            if b is not None:
                sub._buffers[name] = placed(b)
    return module


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{model_dir}: missing shard files {missing}")
    return files


def quant_config_of(model_dir: str | Path) -> QuantConfig | None:
    """The checkpoint's quantization (config.json's quantization_config); None: float."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    return read_quant_config(config) if isinstance(config, dict) else None


def iter_tensors(model_dir: str | Path, accept: Callable[[str], bool] = lambda _: True
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every accepted tensor; a quantized checkpoint's linears come as
    the float checkpoint's `<module>.weight` (transport/weights/quant/dequantize.py), and
    `accept` sees those names."""
    quant = quant_config_of(model_dir)
    if quant is None:
        yield from _read_tensors(model_dir, accept)
        return
    yield from dequantized(_read_tensors(model_dir, lambda n: accept(float_name(n, quant))), quant)


def _read_tensors(model_dir: str | Path, accept: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if accept(name):
                    yield name, f.get_tensor(name)


def load_weights(module: nn.Module, model_dir: str | Path, rule: NameRule,
                 fused: dict[str, list[int]] | None = None,
                 fallbacks: dict[str, str] | None = None,
                 describe: Callable[[str, int | None], str] | None = None) -> None:
    """Fills every parameter of `module` from the checkpoint.

    `fused[param]` lists the row sizes of the pieces stacked along dim 0 (e.g.
    q, k, v sizes for qkv_proj.weight). `fallbacks[param] = other_param` fills a
    parameter that the checkpoint does not hold from another one (a tied head).
    `describe(param, shard)` gives the checkpoint name expected for a piece, for
    error messages.
    """
    fused = fused or {}
    params = dict(module.named_parameters())
    filled: dict[str, set[int | None]] = {name: set() for name in params}
    for ckpt_name, tensor in iter_tensors(model_dir, accept=lambda n: rule(n) is not None):
        param_name, shard = rule(ckpt_name)
        if param_name not in params:
            raise CheckpointError(f"tensor {ckpt_name!r} maps to unknown parameter {param_name!r}")
        param = params[param_name]
        if shard is None:
            target = param.data
        else:
            sizes = fused[param_name]
            start = sum(sizes[:shard])
            target = param.data.narrow(0, start, sizes[shard])
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        target.copy_(tensor.to(target.dtype))
        filled[param_name].add(shard)
    for name, got in filled.items():
        want = {None} if name not in fused else set(range(len(fused[name])))
        if got == want:
            continue
        src = (fallbacks or {}).get(name)
        if not got and src is not None and filled.get(src):
            params[name].data.copy_(params[src].data)
            continue
        missing = sorted(want - got, key=lambda s: -1 if s is None else s)
        names = [describe(name, s) if describe else name for s in missing]
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor {names[0]!r}"
                              + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
