"""The FP8 KV cache (engine/attention/fp8_kv.py): the packed rows, the torch backend's gather
path and the CPU kernel reading them, against dense attention over the dequantized K/V."""
from __future__ import annotations

import pytest
import torch
from unit.engine.test_attention import CASES, SCALE, make_batch, naive_attention

from epd.engine.attention import AttentionMetadata, cpu_kernel, fp8_kv, torch_attention

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_batch(case: str, dtype: torch.dtype, heads=(8, 2), block_size=16, head_dim=32, k_offset=0.0):
    """test_attention's batch with its caches quantized (unused slots stay NaN) and its dense K/V
    replaced by what the cache now holds; `k_offset` shifts every key (a model with large K)."""
    q_lens, prefix_lens = CASES[case]
    batch = make_batch(q_lens, prefix_lens, *heads, head_dim=head_dim, block_size=block_size,
                       seed=list(CASES).index(case))
    batch.k_cache = fp8_kv.quantize(batch.k_cache + k_offset, dtype)
    batch.v_cache = fp8_kv.quantize(batch.v_cache, dtype)
    batch.keys = [fp8_kv.dequantize(fp8_kv.quantize(k + k_offset, dtype), torch.float32) for k in batch.keys]
    batch.values = [fp8_kv.dequantize(fp8_kv.quantize(v, dtype), torch.float32) for v in batch.values]
    return batch


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_quantize_keeps_every_range_within_the_formats_step(dtype):
    """Rows of any magnitude (vLLM's per-layer 1.0 saturates e4m3 past 448) come back within the
    format's relative step of their largest value: 2^-4 (e4m3, 3 mantissa bits), 2^-3 (e5m2)."""
    x = torch.randn(64, 4, 32) * torch.tensor([1e-3, 1.0, 600.0, 1e5])[None, :, None]
    packed = fp8_kv.quantize(x, dtype)
    assert packed.dtype == dtype and packed.shape == (64, 4, 32 + fp8_kv.SCALE_BYTES)
    error = (fp8_kv.dequantize(packed, torch.float32) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert float(error.max()) <= (2 ** -4 if dtype == torch.float8_e4m3fn else 2 ** -3)
    assert bool(torch.isfinite(x.to(dtype).float()).all()) == (dtype == torch.float8_e4m3fn)  # e5m2: 1e5 -> inf
    assert float((x.to(dtype).float() - x).abs().max()) > 1e4  # scale 1.0: clipped at 448 / inf


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["prefill_prefix", "decode", "mixed", "verify"])
@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_fp8_cache_attention_matches_dense_over_what_it_holds(path, case, dtype, monkeypatch):
    if path == "kernel" and cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    monkeypatch.setattr(torch_attention, "use_cpu_kernel", path == "kernel")
    batch = _fp8_batch(case, dtype, k_offset=500.0)  # past e4m3's 448: only a row's own scale holds it
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE / 100)
    torch.testing.assert_close(out.double(), naive_attention(batch, SCALE / 100), atol=2e-5, rtol=2e-5)
    assert any(p.kernel_seqs is not None for p in batch.meta.plans.values()) == (path == "kernel")


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_cpu_kernel_and_gather_path_agree_on_fp8(head_dim, monkeypatch):
    if cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    outs = []
    for use_kernel in (True, False):
        monkeypatch.setattr(torch_attention, "use_cpu_kernel", use_kernel)
        batch = _fp8_batch("long_decode", torch.float8_e4m3fn, head_dim=head_dim)
        outs.append(torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_store_kv_quantizes_into_the_slots_and_skips_padding(dtype):
    cache = torch.zeros(2, 4, 2, 2, 8 + fp8_kv.SCALE_BYTES, dtype=dtype)  # [k/v, blocks, block_size, Hkv, D + 4]
    key, value = torch.randn(3, 2, 8) * 300, torch.randn(3, 2, 8)
    torch_attention.store_kv(key, value, cache[0], cache[1], torch.tensor([5, -1, 0]))
    got = fp8_kv.dequantize(cache.view(2, 8, 2, -1), torch.float32)  # [k/v, slots, Hkv, D]
    step = 2 ** -4 if dtype == torch.float8_e4m3fn else 2 ** -3
    for slot, token in ((5, 0), (0, 2)):
        for kv, x in enumerate((key, value)):
            assert float((got[kv, slot] - x[token]).abs().max()) <= step * float(x[token].abs().max())
    assert not bool(got[:, 1:5].any()) and not bool(got[:, 6:].any())  # only the two slots written


def test_kv_cache_dtype_names_and_the_backends_that_refuse_it():
    from epd.engine.config import EngineConfig
    from epd.engine.attention.fp8_kv import kv_cache_dtype

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
    assert kv_cache_dtype(EngineConfig(), torch.bfloat16, "cpu") == torch.bfloat16
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8"), torch.float32, "cpu") == torch.float8_e4m3fn
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8_e5m2"), torch.float32, "cpu") == torch.float8_e5m2
    with pytest.raises(ValueError, match="served by the torch attention backend only .* not by triton"):
        kv_cache_dtype(EngineConfig(kv_cache_dtype="fp8", attention_backend="triton"), torch.bfloat16, "cpu")
    assert fp8_kv.row_width(128, torch.float8_e4m3fn) == 132 and fp8_kv.row_width(128, torch.bfloat16) == 128


@pytest.mark.parametrize("case", ["window_mixed", "softcap_window", "bidir_window"])
@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_fp8_cache_under_windows_softcaps_and_bidirectional_ranges(path, case, monkeypatch):
    from unit.engine.test_attention_masks import _batch, dense_reference

    if path == "kernel" and cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    monkeypatch.setattr(torch_attention, "use_cpu_kernel", path == "kernel")
    batch, (window, softcap, ranges) = _batch(case, (8, 2), 8)
    batch.k_cache = fp8_kv.quantize(batch.k_cache, torch.float8_e4m3fn)
    batch.v_cache = fp8_kv.quantize(batch.v_cache, torch.float8_e4m3fn)
    batch.keys = [fp8_kv.dequantize(fp8_kv.quantize(k, torch.float8_e4m3fn), torch.float32) for k in batch.keys]
    batch.values = [fp8_kv.dequantize(fp8_kv.quantize(v, torch.float8_e4m3fn), torch.float32) for v in batch.values]
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                                    window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), dense_reference(batch, window, softcap, ranges), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
def test_cpu_kernel_reads_every_finite_fp8_byte_as_torch_does(dtype):
    """A one-token context: the output is its V row, so each byte's value comes back (subnormals too)."""
    if cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()  # [256] every byte
    values = torch.where(torch.isfinite(values), values, torch.zeros(()))
    v = values.view(2, 1, 128)  # two one-token sequences, one kv head of 128
    cache = fp8_kv.quantize(torch.ones(2, 1, 1, 128), dtype)  # [blocks, block_size 1, Hkv, D + 4]
    v_cache = cache.clone()
    raw = v_cache.view(torch.uint8)
    raw[:, 0, 0, :128] = v.to(dtype).view(torch.uint8)[:, 0]
    raw[:, 0, 0, 128:] = torch.ones(2, 1).view(torch.uint8)  # scale 1.0: the bytes' own values
    meta = AttentionMetadata.build([1, 1], [1, 1], [[0], [1]], 1)
    out = torch.empty(2, 1, 128)
    cpu_kernel.decode_attention(cpu_kernel.load(), torch.randn(2, 1, 128), cache, v_cache, meta.block_tables,
                                meta.seq_lens, meta.cu_seqlens_q, torch.tensor([0, 1]), 0.1, out)
    assert torch.equal(out.view(256), values)
