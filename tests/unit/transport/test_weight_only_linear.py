"""Weight-only quantized linears on the CPU (weight_only_cpu.c): the tiles dequantize to the
formats' float weights bit for bit, and the products equal F.linear over those weights up to
float32's order of sums."""
from __future__ import annotations

import pytest
import torch

from epd.transport.weights.quant.weight_only_linear import WeightOnlyLinear, dequantize_codes, kernel_group, load

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler: the loader keeps the float path")

# float32 accumulation in another order than oneDNN's: relative to the output's scale
TOLERANCE = 1e-5


def _codes(fmt: str, out: int, cols: int, groups: int):
    torch.manual_seed(0)
    scale = torch.rand(out, groups) * 0.02 + 1e-3
    if fmt == "int4":
        return torch.randint(0, 16, (out, cols), dtype=torch.uint8), scale, torch.randint(0, 16, (out, groups)).float()
    if fmt == "int8":
        return torch.randint(-128, 128, (out, cols), dtype=torch.int8), scale, None
    # every e4m3 byte but the two NaNs: zero, subnormals, normals, both signs
    codes = torch.tensor([b for b in range(256) if b & 0x7f != 0x7f], dtype=torch.uint8)
    return codes[torch.randint(0, len(codes), (out, cols))].view(torch.float8_e4m3fn), scale, None


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_the_kernel_is_the_dequantized_float_linear(fmt):
    out, cols, group = 96, 256, 64
    q, scale, zero = _codes(fmt, out, cols, cols // 128)  # the format's groups of 128, the kernel's of 64
    layer = WeightOnlyLinear(fmt, cols, out, group, torch.randn(out))
    layer.fill(0, q[:40], scale[:40], None if zero is None else zero[:40])  # two pieces, as q/k/v fill a fused one
    layer.fill(40, q[40:], scale[40:], None if zero is None else zero[40:])
    want = dequantize_codes(fmt, q.view(torch.uint8) if fmt == "fp8" else q, scale, zero)
    assert torch.equal(layer.weight, want)
    eye = torch.eye(cols)  # one product per output: the kernel's own dequantized values, exactly
    assert torch.equal(layer(eye), want.t() + layer.bias)
    for rows in (1, 5, 8, 33, 70):  # partial register blocks, and past one block of accumulated rows (64)
        x = torch.randn(rows, cols)
        ref = torch.nn.functional.linear(x, want, layer.bias)
        assert (layer(x) - ref).abs().max() <= TOLERANCE * ref.abs().max(), (fmt, rows)
    assert layer(torch.randn(2, 3, cols)).shape == (2, 3, out)  # leading dims kept


def test_a_fp8_byte_is_torchs_float8():
    codes = torch.tensor([b for b in range(256) if b & 0x7f != 0x7f], dtype=torch.uint8)
    q = torch.cat([codes, codes[:2]]).view(2, -1)[:, :128].repeat(16, 1)  # [32, 128]
    layer = WeightOnlyLinear("fp8", 128, 32, 128, None)
    layer.fill(0, q.view(torch.float8_e4m3fn), torch.ones(32, 1), None)
    assert torch.equal(layer(torch.eye(128)).t(), q.view(torch.float8_e4m3fn).float())


def test_the_kernels_group_divides_the_formats():
    assert kernel_group(2048, 128) == 128
    assert kernel_group(768, 0) == 256  # one scale a row: any divisor of the row fits
    assert kernel_group(2304, 0) == 256 and kernel_group(1000, 0) == 250
    assert kernel_group(64, 0) == 64
    assert kernel_group(96, 32) == 32
    assert kernel_group(100, 0) == 100 and kernel_group(130, 0) == 130
    assert kernel_group(256, 8) is None  # too small a group to gain from
    assert kernel_group(100, 64) is None  # the format's group does not divide the row


def test_the_kernel_built_without_avx_is_the_same(monkeypatch, tmp_path):
    """Built for plain x86-64 (no AVX-512: 4 rows a register block; no F16C: fp8 bytes widened
    by building the float's bits), as on a CPU older than this one: the same weights and sums."""
    import copy
    import threading

    from epd.transport.weights import c_library
    from epd.transport.weights.quant import weight_only_linear

    monkeypatch.setenv("EPD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(c_library, "COMPILE_FLAGS",
                        ["-march=x86-64" if f == "-march=native" else f for f in c_library.COMPILE_FLAGS])
    kernel = copy.copy(weight_only_linear._KERNEL)
    kernel._lock, kernel._loaded = threading.Lock(), []
    monkeypatch.setattr(weight_only_linear, "_KERNEL", kernel)
    if load() is None:
        pytest.skip("the compiler cannot build for plain x86-64")
    assert list(tmp_path.glob("weight_only_cpu-*.so"))  # this build, not the cached native one
    out, cols = 64, 256
    for fmt in ("int4", "int8", "fp8"):
        q, scale, zero = _codes(fmt, out, cols, 2)
        layer = WeightOnlyLinear(fmt, cols, out, 128, None)
        layer.fill(0, q, scale, zero)
        want = dequantize_codes(fmt, q.view(torch.uint8) if fmt == "fp8" else q, scale, zero)
        assert torch.equal(layer(torch.eye(cols)), want.t()), fmt
        for rows in (1, 5, 9):
            x = torch.randn(rows, cols)
            ref = x @ want.t()
            assert (layer(x) - ref).abs().max() <= TOLERANCE * ref.abs().max(), (fmt, rows)
