"""A quantized checkpoint's linears gathered into one record each, and read back as float weights.

`quantized_weights(stream, quant)` takes a checkpoint's (name, tensor) stream and
gives each quantized linear's tensors (quant_config.py's table), gathered under
their module's name, as one `QuantizedWeight` under `<module>.weight`, the moment
the last of them has been read; every other tensor passes through. A loader
whose parameter holds the format (`Int8Linear`: W8A8's int8 rows and per-row
scales) takes the stored values as they are; any other reads
`QuantizedWeight.dequantize()`, the float32 weight a float checkpoint of the same
model would hold. So every family's loader reads a quantized release as it reads
a float one. The math is the formats' own (compressed-tensors' `dequantize`, the
DeepSeek-V3 block rule, AWQ's and GPTQ's unpacking): weight = (q - zero) * scale,
the scale per block, row or group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from epd.transport.weights.checkpoint_error import CheckpointError
from epd.transport.weights.quant.int_packing import AWQ_ORDER, unpack_int4
from epd.transport.weights.quant.quant_config import QuantConfig

# scheme -> (the tensors of one quantized linear, by suffix; the extra tensors read and dropped:
# older compressed-tensors releases store the symmetric schemes' zero points, all zero)
PARTS = {
    "fp8-block": (("weight", "weight_scale_inv"), ("input_scale",)),
    "fp8-tensor": (("weight", "weight_scale"), ("input_scale",)),
    "fp8-dynamic": (("weight", "weight_scale"), ("weight_zero_point",)),
    "w8a8": (("weight", "weight_scale"), ("weight_zero_point",)),
    "w8a16": (("weight", "weight_scale"), ("weight_zero_point",)),
    "w4a16": (("weight_packed", "weight_scale", "weight_shape"), ()),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
}
_STORED = {"fp8-block": torch.float8_e4m3fn, "fp8-tensor": torch.float8_e4m3fn, "fp8-dynamic": torch.float8_e4m3fn,
           "w8a8": torch.int8, "w8a16": torch.int8}  # schemes whose quantized tensor is named `weight`


def parts_of(quant: QuantConfig) -> tuple[str, ...]:
    """The tensors one quantized linear has in this checkpoint, by suffix."""
    need = PARTS[quant.scheme][0]
    return need + ("weight_zero_point",) if quant.scheme == "w4a16" and not quant.symmetric else need


def split_name(name: str, quant: QuantConfig) -> tuple[str, str] | None:
    """"m.q_proj.weight_scale" -> ("m.q_proj", "weight_scale") for a quantized linear's
    tensor (or one read and dropped); None for a tensor of no linear's."""
    module, _, suffix = name.rpartition(".")
    if suffix in parts_of(quant) or suffix in PARTS[quant.scheme][1]:
        return module, suffix
    return None


def float_name(name: str, quant: QuantConfig) -> str:
    """The float checkpoint's name a tensor stands for: its linear's `.weight` for a part."""
    split = split_name(name, quant)
    return name if split is None else split[0] + ".weight"


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear's weight as the checkpoint stores it: its tensors by suffix
    (`parts_of`) and the config that says how to read them."""

    module: str  # the linear's checkpoint name, without `.weight`
    parts: dict[str, torch.Tensor]
    quant: QuantConfig

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        try:
            return dequantize(self.parts, self.quant)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{self.module}: its {self.quant.method} {self.quant.scheme} tensors do not "
                                  f"fit together ({exc})") from None

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W8A8's stored values: (int8 [out, in], float32 scale [out]), a per-tensor scale
        given to every row; weight = q * scale[:, None] exactly as `dequantize` computes it."""
        assert self.quant.scheme == "w8a8", self.quant.scheme
        q, scale = self.parts["weight"], self.parts["weight_scale"].float()
        if q.ndim != 2 or scale.numel() not in (1, q.shape[0]):
            raise CheckpointError(f"{self.module}: weight {tuple(q.shape)} and weight_scale {tuple(scale.shape)} "
                                  f"are not an int8 matrix with one scale per row or one in all")
        return q, scale.reshape(-1).expand(q.shape[0]).contiguous()

    def codes(self) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A weight-only scheme's stored values as (format, q [out, in], scale [out, groups],
        zero [out, groups] or None) with weight = (q - zero) * scale over equal groups of
        columns, exactly `dequantize`'s: "int4" q 0..15 (uint8), "int8" q int8, "fp8" q
        float8_e4m3fn. The kernel's layer (weight_only_linear.py) is filled from these."""
        p, scheme = self.parts, self.quant.scheme
        try:
            if scheme == "w4a16":
                out, cols = (int(v) for v in p["weight_shape"].tolist())
                q = unpack_int4(p["weight_packed"], dim=1)[:, :cols]
                scale = p["weight_scale"].float().reshape(out, -1)
                zero = torch.full_like(scale, 8.0) if "weight_zero_point" not in p else \
                    unpack_int4(p["weight_zero_point"], dim=0)[:out].float()  # q - 8 - (zp - 8)
                return "int4", q, scale, zero
            if scheme in ("awq", "gptq"):
                awq = scheme == "awq"
                q = unpack_int4(p["qweight"], dim=1 if awq else 0, order=AWQ_ORDER if awq else None).t()
                zero = unpack_int4(p["qzeros"], dim=1, order=AWQ_ORDER if awq else None).float()
                return "int4", q, p["scales"].float().t(), (zero if awq else zero + 1).t()
            w, fmt = p["weight"], "int8" if scheme == "w8a16" else "fp8"
            if scheme == "fp8-block":  # groups of gcd(in, b1) columns: a partial last block is whole groups
                (b0, b1), (out, cols) = self.quant.block_size, w.shape
                scale_inv, group = p["weight_scale_inv"].float(), math.gcd(cols, b1)
                if tuple(scale_inv.shape) != (-(-out // b0), -(-cols // b1)):
                    raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected "
                                     f"{(-(-out // b0), -(-cols // b1))}")
                scale = scale_inv.repeat_interleave(b0, 0)[:out].repeat_interleave(b1 // group, 1)[:, :cols // group]
                return fmt, w, scale, None
            scale = p["weight_scale"].float().reshape(-1, 1)
            return fmt, w, scale.expand(w.shape[0], 1) if scale.numel() == 1 else scale, None
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{self.module}: its {self.quant.method} {self.quant.scheme} tensors do not "
                                  f"fit together ({exc})") from None


def quantized_weights(stream: Iterator[tuple[str, torch.Tensor]], quant: QuantConfig
                      ) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
    need = parts_of(quant)
    dropped = PARTS[quant.scheme][1]
    stored = _STORED.get(quant.scheme)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        split = split_name(name, quant)
        if split is None or (split[1] == "weight" and tensor.dtype != stored):
            yield name, tensor  # not quantized: a norm, an embedding, a linear left in float
            continue
        module, suffix = split
        if suffix == "weight_zero_point" and suffix in dropped and bool(tensor.any()):
            raise CheckpointError(f"tensor {name!r}: nonzero zero points in a symmetric {quant.scheme} checkpoint")
        if suffix in dropped:
            continue  # static activation scales (computed per token instead), GPTQ's trivial g_idx, zero zero points
        if quant.is_ignored(module):
            raise CheckpointError(f"tensor {name!r} is quantized, but quantization_config leaves {module!r} "
                                  f"in float (modules_to_not_convert / ignore)")
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if all(s in parts for s in need):
            del pending[module]
            yield module + ".weight", QuantizedWeight(module, parts, quant)
    for module, parts in pending.items():
        missing = next(s for s in need if s not in parts)
        raise CheckpointError(f"checkpoint is missing tensor {module + '.' + missing!r} "
                              f"({quant.method} {quant.scheme})")


def dequantize(parts: dict[str, torch.Tensor], quant: QuantConfig) -> torch.Tensor:
    """One linear's quantized tensors -> its float32 weight [out, in]."""
    scheme = quant.scheme
    if scheme == "fp8-block":
        return dequantize_blocks(parts["weight"], parts["weight_scale_inv"], quant.block_size)
    if scheme in ("fp8-tensor", "fp8-dynamic", "w8a8", "w8a16"):
        w, scale = parts["weight"].float(), parts["weight_scale"].float()
        return w * (scale.reshape(-1, 1) if scale.numel() == w.shape[0] else scale.reshape(()))
    if scheme == "w4a16":
        return dequantize_packed(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                 parts.get("weight_zero_point"))
    if scheme == "awq":
        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"], quant.group_size)
    return dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"], quant.group_size)


def _per_column(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, groups] -> [rows, columns]: each group's value over its columns."""
    group = columns // scale.shape[1]
    if group * scale.shape[1] != columns:
        raise ValueError(f"{columns} columns do not split into {scale.shape[1]} equal groups")
    return scale.repeat_interleave(group, dim=1)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [out, in] and one scale per [block] tile ([ceil(out / b0), ceil(in / b1)]; the last
    tiles may be partial) -> float32 [out, in] = w * its tile's scale."""
    out, cols = w.shape
    want = (-(-out // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * scale


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                      zero_packed: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors pack-quantized: int4 values (offset by 8) eight to an int32 along
    each row; zero points (asymmetric) packed along the rows' dim -> float32 [out, in]."""
    out, cols = (int(v) for v in shape.tolist())
    q = unpack_int4(packed, dim=1)[:, :cols].to(torch.int32) - 8  # [out, in], -8..7
    scale = scale.float().reshape(out, -1)  # [out, groups]
    zero = torch.zeros_like(scale) if zero_packed is None else \
        unpack_int4(zero_packed, dim=0)[:out].to(torch.float32) - 8  # [out, groups]
    return (q.float() - _per_column(zero, cols)) * _per_column(scale, cols)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AWQ GEMM: qweight [in, out / 8], qzeros [in / group, out / 8] (AWQ_ORDER), scales
    [in / group, out] -> float32 [out, in] = ((q - zero) * scale) transposed."""
    q = unpack_int4(qweight, dim=1, order=AWQ_ORDER).float()  # [in, out]
    zero = unpack_int4(qzeros, dim=1, order=AWQ_ORDER).float().repeat_interleave(group, 0)
    return ((q - zero) * scales.float().repeat_interleave(group, 0)).t().contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """GPTQ (checkpoint_format "gptq", desc_act false): qweight [in / 8, out] packed along
    the input dim, qzeros [in / group, out / 8] stored less one -> float32 [out, in]."""
    q = unpack_int4(qweight, dim=0).float()  # [in, out]
    zero = unpack_int4(qzeros, dim=1).float().add_(1).repeat_interleave(group, 0)  # [in, out]
    return ((q - zero) * scales.float().repeat_interleave(group, 0)).t().contiguous()
