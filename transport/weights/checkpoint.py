"""Reading a Hugging Face safetensors checkpoint into our own modules.

Shared by the encoder (vision tower) and the engine (language model), which
each give a rule mapping checkpoint names to their parameters, optionally
into a shard of a fused parameter (q/k/v -> qkv_proj). Every parameter must
be filled exactly once with the right shape, or loading fails with a message
naming the tensor. A quantized checkpoint's linears run their stored values on the
CPU (W8A8: `Int8Linear`; weight-only schemes: `WeightOnlyLinear`), else are read as
float weights (transport/weights/quant/).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from epd.transport.weights.checkpoint_error import CheckpointError
from epd.transport.weights.quant.dequantize import QuantizedWeight, float_name, quantized_weights
from epd.transport.weights.quant.int8_linear import Int8Linear
from epd.transport.weights.quant.weight_only_linear import (TILE, WEIGHT_ONLY_FORMATS, WeightOnlyLinear, kernel_group,
                                                            load as weight_only_kernel)
from epd.transport.weights.quant.quant_config import QuantConfig, read_quant_config

# A rule maps a checkpoint name to (parameter name, shard index) or None to skip.
# Shard index: None for a whole parameter, k for the k-th of the fused pieces.
NameRule = Callable[[str], "tuple[str, int | None] | None"]
# A narrowing (tensor parallelism) maps (parameter name, piece) to the part of the checkpoint tensor
# this process reads, (dim, start, length), or None for the whole tensor.
Narrowing = Callable[[str, "int | None"], "tuple[int, int, int] | None"]


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


def iter_tensors(model_dir: str | Path, accept: Callable[[str], bool] = lambda _: True,
                 quantized: bool = False, part: Callable[[str], "tuple[int, int, int] | None"] | None = None,
                 ) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
    """(name, tensor) for every accepted tensor; a quantized checkpoint's linears come under
    the float checkpoint's `<module>.weight`, and `accept` sees those names: as their float32
    weight, or with `quantized` as the stored record (transport/weights/quant/dequantize.py).
    `part(name)`: (dim, start, length) of a float checkpoint's tensor to read, None: all of it."""
    quant = quant_config_of(model_dir)
    if quant is None:
        yield from _read_tensors(model_dir, accept, part)
        return
    if part is not None:
        raise CheckpointError(f"{model_dir}: a quantized checkpoint is not read in parts")
    for name, tensor in quantized_weights(_read_tensors(model_dir, lambda n: accept(float_name(n, quant))), quant):
        yield name, (tensor.dequantize() if type(tensor) is QuantizedWeight and not quantized else tensor)


def _read_tensors(model_dir: str | Path, accept: Callable[[str], bool],
                  part: Callable[[str], "tuple[int, int, int] | None"] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not accept(name):
                    continue
                where = part(name) if part is not None else None
                if where is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = where  # only these rows (dim 0) or columns (dim 1) are read
                piece = f.get_slice(name)
                if len(piece.get_shape()) <= dim or piece.get_shape()[dim] < start + length:
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(piece.get_shape())}: no "
                                          f"[{start}, {start + length}) along dim {dim} to read")
                yield name, piece[start:start + length] if dim == 0 else piece[:, start:start + length]


def load_weights(module: nn.Module, model_dir: str | Path, rule: NameRule,
                 fused: dict[str, list[int]] | None = None,
                 fallbacks: dict[str, str] | None = None,
                 describe: Callable[[str, int | None], str] | None = None,
                 narrowing: Narrowing | None = None) -> None:
    """Fills every parameter of `module` from the checkpoint.

    `fused[param]` lists the row sizes of the pieces stacked along dim 0 (e.g.
    q, k, v sizes for qkv_proj.weight). `fallbacks[param] = other_param` fills a
    parameter that the checkpoint does not hold from another one (a tied head).
    `describe(param, shard)` gives the checkpoint name expected for a piece, for
    error messages. `narrowing` (a tensor-parallel rank's): each tensor read only in the part
    it names, which fills the parameter (or piece) as a whole tensor would.
    """
    fused = fused or {}
    stored = _quantized_linears(module, model_dir, rule, fused)  # parameter names -> the layers of stored values
    params = dict(module.named_parameters())
    filled: dict[str, set[int | None]] = {name: set() for name in [*params, *stored]}
    part = None if narrowing is None else (lambda n: narrowing(*rule(n)))
    for ckpt_name, tensor in iter_tensors(model_dir, accept=lambda n: rule(n) is not None, quantized=True, part=part):
        param_name, shard = rule(ckpt_name)
        if param_name in stored:
            _fill_quantized(stored[param_name], ckpt_name, tensor, _rows(fused, param_name, shard))
            filled[param_name].add(shard)
            continue
        if param_name not in params:
            raise CheckpointError(f"tensor {ckpt_name!r} maps to unknown parameter {param_name!r}")
        if type(tensor) is QuantizedWeight:
            tensor = tensor.dequantize()
        rows = _rows(fused, param_name, shard)
        target = params[param_name].data if rows is None else params[param_name].data.narrow(0, *rows)
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


def _rows(fused: dict[str, list[int]], param_name: str, shard: int | None) -> tuple[int, int] | None:
    """A fused piece's rows of its parameter, (start, count); None: the whole parameter."""
    if shard is None:
        return None
    sizes = fused[param_name]
    return sum(sizes[:shard]), sizes[shard]


_MAIN_PART = {"w4a16": "weight_packed", "awq": "qweight", "gptq": "qweight"}  # else `weight`, int8 or fp8
_STORED_DTYPES = ("I8", "F8_E4M3")


def _quantized_linears(module: nn.Module, model_dir: str | Path, rule: NameRule,
                       fused: dict[str, list[int]]) -> dict[str, "Int8Linear | WeightOnlyLinear"]:
    """A quantized checkpoint's linears, on the CPU in float32: each `nn.Linear` of `module` whose
    every piece the checkpoint stores quantized replaced by an empty layer that runs the stored
    values (W8A8: `Int8Linear`; a weight-only scheme: `WeightOnlyLinear`, where its kernel builds
    and the sizes fit its tiles); its float weight, built but never written, is dropped; by its
    weight's parameter name. Read from the files' headers, before any tensor."""
    quant = quant_config_of(model_dir)
    if quant is None or (quant.scheme != "w8a8" and not _weight_only_kernel(quant)):
        return {}
    from safetensors import safe_open

    main = _MAIN_PART.get(quant.scheme, "weight")
    pieces: dict[str, set[int | None]] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not name.endswith("." + main) or (main == "weight" and f.get_slice(name).get_dtype()
                                                     not in _STORED_DTYPES):
                    continue
                target = rule(float_name(name, quant))
                if target is not None:
                    pieces.setdefault(target[0], set()).add(target[1])
    found = {}
    for param_name, shards in pieces.items():
        owner_name, _, leaf = param_name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            continue  # no such parameter: named when its tensor is read
        want = set(range(len(fused[param_name]))) if param_name in fused else {None}
        if leaf != "weight" or shards != want or type(owner) is not nn.Linear \
                or owner.weight.device.type != "cpu" or owner.weight.dtype != torch.float32:
            continue  # a float linear, or one only partly quantized: read dequantized
        layer = _quantized_layer(owner, quant)
        if layer is None:
            continue  # sizes the kernel's tiles do not take: read dequantized
        parent_name, _, attr = owner_name.rpartition(".")
        setattr(module.get_submodule(parent_name), attr, layer)
        found[param_name] = layer
    return found


def _weight_only_kernel(quant: QuantConfig) -> bool:
    """Whether a weight-only scheme's linears run in their bits (weight_only_linear.py): the
    kernel builds and `EPD_WEIGHT_ONLY_KERNEL` is not 0 (read at each load: 0 keeps the
    dequantized float linears, the reference path)."""
    return (quant.scheme in WEIGHT_ONLY_FORMATS and os.environ.get("EPD_WEIGHT_ONLY_KERNEL", "1") != "0"
            and weight_only_kernel() is not None)


def _quantized_layer(owner: nn.Linear, quant: QuantConfig) -> "Int8Linear | WeightOnlyLinear | None":
    out, cols = owner.out_features, owner.in_features
    if quant.scheme == "w8a8":
        return Int8Linear(torch.empty(out, cols, dtype=torch.int8), torch.empty(out), owner.bias)
    group = math.gcd(cols, quant.block_size[1]) if quant.scheme == "fp8-block" else quant.group_size
    kernel_g = kernel_group(cols, group if group > 0 else 0)
    if kernel_g is None or out % TILE:
        return None
    return WeightOnlyLinear(WEIGHT_ONLY_FORMATS[quant.scheme], cols, out, kernel_g, owner.bias)


def _fill_quantized(layer: "Int8Linear | WeightOnlyLinear", name: str, tensor, rows: tuple[int, int] | None) -> None:
    """A record's stored values into `layer`'s rows (all of them, or a fused piece's)."""
    if type(tensor) is not QuantizedWeight:
        raise CheckpointError(f"tensor {name!r} is not quantized in a checkpoint whose other pieces of it are")
    start, count = rows or (0, layer.out_features)
    if type(layer) is Int8Linear:
        q, scale = tensor.int8_rows()
        _check_rows(name, q, count, layer.in_features)
        layer.weight_q[start:start + count].copy_(q)
        layer.weight_scale[0, start:start + count].copy_(scale)
        return
    _, q, scale, zero = tensor.codes()  # the format is the layer's: both follow the checkpoint's scheme
    _check_rows(name, q, count, layer.in_features)
    if scale.shape[0] != count or (layer.in_features // layer.group) % scale.shape[1] \
            or (zero is not None and zero.shape != scale.shape):
        raise CheckpointError(f"tensor {name!r}: its scales {tuple(scale.shape)} are not one per row and equal "
                              f"group of its {layer.in_features} columns")
    layer.fill(start, q, scale, zero)


def _check_rows(name: str, q: torch.Tensor, count: int, in_features: int) -> None:
    if tuple(q.shape) != (count, in_features):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(q.shape)}, expected {(count, in_features)}")
