"""Weight-only quantized linears on the CPU: 4- or 8-bit weights kept in their bits, float32
activations (weight_only_cpu.c, built by transport/weights/c_library.py).

A weight-only release (compressed-tensors W4A16 / W8A16, AWQ, GPTQ, FP8 block / tensor /
dynamic, whose activations stay float on CPU) means w = (q - zero) * scale per group of
input columns. `WeightOnlyLinear` holds q in its bits (int4 two to a byte, int8, an fp8
byte) with a float32 scale (and, for int4, a zero point) per group and output column, in
the kernel's tiles of 32 output columns; the kernel dequantizes a tile of one group into L1
and multiplies every row of x by it, never writing a float copy of the weight. A decode
step so streams a quarter (int4: an eighth, plus the groups' scales) of float32's bytes.

`QuantizedWeight.codes()` (dequantize.py) gives any scheme's stored tensors as the one
(format, q [out, in], scale, zero [out, groups]) form; the loader fills a layer row by row
(fused q/k/v and gate/up are pieces of its rows) and the layer repacks into tiles once its
last row is in. `reference` is the math in torch (the stored values dequantized, then
F.linear), what the tests compare the kernel against; `weight` is that float weight (a copy:
the LoRA wrapper reads its dtype and device, then adds its delta after this layer's output). Without a C compiler, or with
`EPD_WEIGHT_ONLY_KERNEL=0`, no layer is built and the loader keeps the old path: the weight
dequantized into a float `nn.Linear`.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from epd.transport.weights import c_library

FORMATS = {"int4": 0, "int8": 1, "fp8": 2}  # the kernel's `format` argument
WEIGHT_ONLY_FORMATS = {"w4a16": "int4", "awq": "int4", "gptq": "int4", "w8a16": "int8",
                       "fp8-block": "fp8", "fp8-tensor": "fp8", "fp8-dynamic": "fp8"}  # scheme -> format on CPU
TILE = 32  # output columns per tile
MAX_GROUP, MIN_GROUP = 256, 16  # input columns per dequantized tile: the kernel's buffer; below, too slow to gain
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = c_library.Kernel(
    Path(__file__).with_name("weight_only_cpu.c"), "epd_weight_only_linear",
    [_P] * 6 + [_I64] * 4 + [ctypes.c_int, ctypes.c_int], ctypes.c_int,
    switch="EPD_WEIGHT_ONLY_KERNEL", what="CPU weight-only quantized linear kernel",
    fallback="weight-only quantized linears are dequantized into float32 at load")


def load():
    """The kernel's ctypes function, or None where it cannot be built (logged once)."""
    return _KERNEL.load()


def kernel_group(in_features: int, group: int) -> int | None:
    """The kernel's group for a format's `group` (input columns per scale; 0: one for the
    whole row): the largest divisor of it up to MAX_GROUP, or None when it would be under
    MIN_GROUP or `group` does not divide the row."""
    group = group or in_features
    if in_features % group:
        return None
    g = next(d for d in range(min(group, MAX_GROUP), 0, -1) if group % d == 0)
    return g if g >= MIN_GROUP else None


def dequantize_codes(fmt: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """(format, q [out, in], scale / zero [out, groups]) -> the float32 weight [out, in]:
    the formats' w = (q - zero) * scale, as dequantize.py computes it."""
    group = q.shape[1] // scale.shape[1]
    if fmt == "fp8":
        w = q.view(torch.float8_e4m3fn).float()
    else:
        w = q.float()
    if zero is not None:
        w = w - zero.repeat_interleave(group, dim=1)
    return w * scale.repeat_interleave(group, dim=1)


class WeightOnlyLinear(nn.Module):
    """`nn.Linear`'s forward on a weight stored in 4 or 8 bits, float32 activations.
    Built empty (`out_features` rows to be filled), filled by `fill`, packed by the last fill."""

    def __init__(self, fmt: str, in_features: int, out_features: int, group: int, bias: torch.Tensor | None):
        super().__init__()
        assert fmt in FORMATS and out_features % TILE == 0 and in_features % group == 0, (fmt, out_features, group)
        self.fmt, self.in_features, self.out_features, self.group = fmt, in_features, out_features, group
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        tiles, groups = out_features // TILE, in_features // group
        width = TILE // 2 if fmt == "int4" else TILE
        self.register_buffer("q", torch.empty(tiles, in_features, width, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(tiles, groups, TILE))
        self.register_buffer("zero", torch.empty(tiles, groups, TILE) if fmt == "int4" else None)
        self._filled = 0  # rows filled so far; the last fill packs them

    def fill(self, start: int, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        """Rows start .. start + len(q) of the weight: q [rows, in] (int4: 0..15 uint8, int8: int8,
        fp8: float8_e4m3fn), scale and zero [rows, groups of the format] float (zero: int4 only)."""
        rows = q.shape[0]
        if not hasattr(self, "_staged"):
            groups = self.in_features // self.group
            self._staged = (torch.empty(self.out_features, self.in_features, dtype=torch.uint8),
                            torch.empty(self.out_features, groups), torch.zeros(self.out_features, groups))
        staged_q, staged_scale, staged_zero = self._staged
        staged_q[start:start + rows] = q.view(torch.uint8) if q.dtype != torch.uint8 else q
        repeat = self.in_features // self.group // scale.shape[1]  # the format's group split into the kernel's
        staged_scale[start:start + rows] = scale.float().repeat_interleave(repeat, dim=1)
        if zero is not None:
            staged_zero[start:start + rows] = zero.float().repeat_interleave(repeat, dim=1)
        self._filled += rows
        if self._filled == self.out_features:
            self._pack(*self._staged)
            del self._staged

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """[out, in] codes and [out, groups] scales -> the kernel's tiles (weight_only_cpu.c)."""
        tiles = self.out_features // TILE
        q = q.view(tiles, TILE, self.in_features).transpose(1, 2)  # [tiles, in, 32]
        if self.fmt == "int4":
            q = q[..., :TILE // 2] | (q[..., TILE // 2:] << 4)  # column j low nibble, j + 16 high
        self.q.copy_(q)
        self.scale.copy_(scale.view(tiles, TILE, -1).transpose(1, 2))
        if self.zero is not None:
            self.zero.copy_(zero.view(tiles, TILE, -1).transpose(1, 2))

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored values back as (q [out, in] uint8, scale, zero [out, groups])."""
        q = self.q
        if self.fmt == "int4":
            q = torch.cat([q & 15, q >> 4], dim=2)
        q = q.transpose(1, 2).reshape(self.out_features, self.in_features)
        if self.fmt == "int8":
            q = q.view(torch.int8)
        scale = self.scale.transpose(1, 2).reshape(self.out_features, -1)  # [tiles, groups, 32] -> [out, groups]
        zero = None if self.zero is None else self.zero.transpose(1, 2).reshape(self.out_features, -1)
        return q, scale, zero

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight [out, in] it stands for (a copy)."""
        return dequantize_codes(self.fmt, *self.codes())

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's math in torch: the dequantized weight, then F.linear."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32."""
        fn = load()
        assert fn is not None, "a WeightOnlyLinear is built only where its kernel loads"
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        rc = fn(rows.data_ptr(), self.q.data_ptr(), self.scale.data_ptr(),
                None if self.zero is None else self.zero.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
                out.data_ptr(), rows.shape[0], self.in_features, self.out_features, self.group, FORMATS[self.fmt],
                torch.get_num_threads())
        assert rc == 0, rc
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.group}, bias={self.bias is not None}")
