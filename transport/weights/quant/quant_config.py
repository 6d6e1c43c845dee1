"""A checkpoint's `quantization_config`, read once into the format and scheme EPD serves.

The release formats (their config keys and tensor names, as the releases write them):

  method              scheme       weights                                   tensors per linear
  fp8                 fp8-block    float8_e4m3fn, a scale per [b0, b1] block  weight, weight_scale_inv
  fp8                 fp8-tensor   float8_e4m3fn, one scale (or per row)      weight, weight_scale
  compressed-tensors  fp8-dynamic  float-quantized fp8, channel/tensor scale  weight, weight_scale
  compressed-tensors  w8a8         int-quantized int8, channel/tensor scale   weight, weight_scale
  compressed-tensors  w8a16        int-quantized int8 (no activation quant)   weight, weight_scale
  compressed-tensors  w4a16        pack-quantized int4 in int32, per group    weight_packed, weight_scale,
                                   (zero points packed along rows if asym)   weight_shape[, weight_zero_point]
  awq                 awq          GEMM layout: int4 in int32 [in, out / 8]  qweight, qzeros, scales
  gptq                gptq         int4 in int32 [in / 8, out], desc_act off  qweight, qzeros, scales, g_idx

Anything else, or a scheme of these EPD does not serve (activation ordering, 2:4
sparsity, a static activation scale on INT8, 3-bit GPTQ, ...), is a CheckpointError
naming the method and the scheme at start-up, never weights read wrong.
`modules_to_not_convert` (fp8, awq) and `ignore` (compressed-tensors: names or `re:`
patterns) name the modules left in float: the vision tower in most releases.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from epd.transport.weights.checkpoint_error import CheckpointError

METHODS = ("fp8", "compressed-tensors", "awq", "gptq")


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's quantized linears are stored. `scheme`: one of the module
    docstring's; `weight_bits`, `group_size` (0: per channel or per block), `block_size`
    (fp8-block's [rows, cols]), `symmetric` (no zero points), `activation_bits` (8: the
    activations are quantized per token at run time, 0: weight-only)."""

    method: str
    scheme: str
    weight_bits: int
    group_size: int = 0
    block_size: tuple[int, int] | None = None
    symmetric: bool = True
    activation_bits: int = 0
    ignore: tuple[str, ...] = ()

    def is_ignored(self, module: str) -> bool:
        """Whether the linear `module` (its checkpoint name without `.weight`) stays in float."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif f".{entry}." in f".{module}.":  # the module, or one inside it, by its dotted name
                return True
        return False


def _refuse(method: str, scheme: str) -> CheckpointError:
    return CheckpointError(f"quantization_config: {method} {scheme} is not served by EPD "
                           f"(served: fp8 block/tensor/channel, compressed-tensors fp8-dynamic, w8a8, w8a16, "
                           f"w4a16, awq gemm 4-bit, gptq 4-bit with desc_act false)")


def read_quant_config(config: dict) -> QuantConfig | None:
    """config.json's quantization_config (or compressed-tensors' older `compression_config`)
    -> QuantConfig; None for a float checkpoint; CheckpointError naming what is not served."""
    raw = config.get("quantization_config") or config.get("compression_config")
    if raw is None:
        text = config.get("text_config")
        raw = text.get("quantization_config") if isinstance(text, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"quantization_config is {type(raw).__name__}, not an object")
    method = str(raw.get("quant_method", "?"))
    if method == "fp8":
        return _fp8(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "awq":
        return _awq(raw)
    if method == "gptq":
        return _gptq(raw)
    raise CheckpointError(f"quantization_config: quant_method {method!r} is not served by EPD "
                          f"(served: {', '.join(METHODS)})")


def _fp8(raw: dict) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", f"fmt {fmt}")
    if raw.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _refuse("fp8", f"activation_scheme {raw.get('activation_scheme')}")
    block = raw.get("weight_block_size")
    ignore = tuple(raw.get("modules_to_not_convert") or ())
    if block is None:
        return QuantConfig("fp8", "fp8-tensor", 8, ignore=ignore)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("fp8", f"weight_block_size {block}")
    return QuantConfig("fp8", "fp8-block", 8, block_size=(block[0], block[1]), ignore=ignore)


def _compressed_tensors(raw: dict) -> QuantConfig:
    method = "compressed-tensors"
    fmt = raw.get("format")
    groups = raw.get("config_groups") or {}
    if raw.get("sparsity_config"):
        raise _refuse(method, f"sparsity {raw['sparsity_config'].get('format', '?')}")
    if raw.get("kv_cache_scheme"):
        raise _refuse(method, "kv_cache_scheme (a quantized KV cache)")
    if not groups:
        raise _refuse(method, "without config_groups")
    schemes = {_ct_scheme(name, group, fmt) for name, group in groups.items()}
    if len(schemes) != 1:
        raise _refuse(method, f"mixed schemes {sorted(s.scheme for s in schemes)}")
    scheme = schemes.pop()
    return QuantConfig(method, scheme.scheme, scheme.weight_bits, scheme.group_size, None, scheme.symmetric,
                       scheme.activation_bits, tuple(raw.get("ignore") or ()))


def _ct_scheme(name: str, group: dict, fmt: str | None) -> QuantConfig:
    method = "compressed-tensors"
    fmt = group.get("format") or fmt
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(method, f"{name} targets {targets} (served: [\"Linear\"])")
    w = group.get("weights") or {}
    a = group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(method, f"{name} output_activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    desc = f"{fmt} {kind}{bits} weights ({strategy}"
    desc += f", group {w.get('group_size')})" if strategy == "group" else ")"
    if w.get("actorder") or w.get("dynamic"):
        raise _refuse(method, desc + " with actorder" if w.get("actorder") else desc + " dynamic")
    act_bits = 0
    if a:
        act = f"{a.get('type')}{a.get('num_bits')} activations ({a.get('strategy')}, " \
              f"{'dynamic' if a.get('dynamic') else 'static'})"
        if not (a.get("dynamic") is True and a.get("strategy") in ("token", "tensor") and a.get("symmetric", True)
                and a.get("num_bits") == 8 and a.get("type") == kind):
            raise _refuse(method, f"{desc}, {act}")
        act_bits = 8
    if fmt == "float-quantized" and kind == "float" and bits == 8 and strategy in ("channel", "tensor") \
            and w.get("symmetric", True):
        return QuantConfig(method, "fp8-dynamic", 8, activation_bits=act_bits)
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8 and strategy in ("channel", "tensor") \
            and w.get("symmetric", True):
        return QuantConfig(method, "w8a8" if act_bits else "w8a16", 8, activation_bits=act_bits)
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy in ("group", "channel") and not act_bits:
        group_size = int(w.get("group_size") or 0) if strategy == "group" else 0
        return QuantConfig(method, "w4a16", 4, group_size, None, bool(w.get("symmetric", True)))
    raise _refuse(method, desc + (f", {a.get('type')}{a.get('num_bits')} activations" if a else ""))


def _awq(raw: dict) -> QuantConfig:
    bits, group, version = raw.get("bits", raw.get("w_bit")), raw.get("group_size", raw.get("q_group_size")), \
        str(raw.get("version", "gemm")).lower()
    if version != "gemm" or bits != 4 or not isinstance(group, int) or group <= 0:
        raise _refuse("awq", f"version {version}, {bits}-bit, group {group}")
    return QuantConfig("awq", "awq", 4, group, None, not raw.get("zero_point", True),
                       ignore=tuple(raw.get("modules_to_not_convert") or ()))


def _gptq(raw: dict) -> QuantConfig:
    bits, group = raw.get("bits"), raw.get("group_size")
    fmt = raw.get("checkpoint_format", "gptq")
    if raw.get("desc_act"):
        raise _refuse("gptq", "desc_act true (activation ordering)")
    if bits != 4 or not isinstance(group, int) or group <= 0 or fmt != "gptq":
        raise _refuse("gptq", f"{bits}-bit, group {group}, checkpoint_format {fmt}")
    return QuantConfig("gptq", "gptq", 4, group, None, bool(raw.get("sym", True)),
                       ignore=tuple(raw.get("modules_to_not_convert") or ()))
