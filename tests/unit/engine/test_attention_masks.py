"""A layer's attention options in every backend against a dense masked reference: sliding
windows (across block boundaries), attention logit soft-caps, and bidirectional ranges (an
image's tokens seeing each other both ways) in prefill chunks, beside decodes, with GQA.

The Triton kernels run under TRITON_INTERPRET=1 in a subprocess (`test_triton_interpreted`,
as in test_attention.py) and natively on a CUDA machine.
"""
from __future__ import annotations

import math

import pytest
import torch
from testkit.triton_interpreter import INTERPRETING, run_interpreted

from epd.engine.attention import AttentionMetadata, get_backend
from epd.engine.attention import cpu_kernel, torch_attention
from unit.engine.test_attention import SCALE, PagedBatch, make_batch

HAS_CUDA = torch.cuda.is_available()


def with_ranges(batch: PagedBatch, ranges) -> PagedBatch:
    """The batch's metadata rebuilt with bidirectional `ranges` (one tuple of ranges a sequence)."""
    meta, block_size = batch.meta, batch.k_cache.shape[1]
    seq_lens = meta.seq_lens.tolist()
    tables = [row[:-(-n // block_size)] for row, n in zip(meta.block_tables.tolist(), seq_lens)]
    batch.meta = AttentionMetadata.build(batch.q_lens, seq_lens, tables, block_size, device=meta.seq_lens.device,
                                         bidirectional_ranges=ranges)
    return batch


def dense_reference(batch: PagedBatch, window=None, softcap=None, ranges=None, scale=SCALE) -> torch.Tensor:
    """float64, one sequence at a time: query i sees key j when (j <= i or i and j lie in one range)
    and (no window or j > i - window); soft-capped scores before the mask (transformers' order)."""
    num_q_heads = batch.query.shape[1]
    outs, start = [], 0
    for b, (q_len, k, v) in enumerate(zip(batch.q_lens, batch.keys, batch.values)):
        seq_len, num_kv_heads, _ = k.shape
        q = batch.query[start:start + q_len].cpu().double()
        start += q_len
        k = k.double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        v = v.double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(seq_len - q_len, seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        visible = j <= i
        for lo, hi in (ranges[b] if ranges else ()):
            visible |= (i >= lo) & (i < hi) & (j >= lo) & (j < hi)
        if window is not None:
            visible &= j > i - window
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v))
    return torch.cat(outs)


# name: (q_lens, prefix_lens, window, softcap, ranges per sequence or None)
CASES = {
    # windows of 5 and 11 keys over blocks of 8: prefills with and without a cached prefix, decodes
    # inside and past the window, a draft's verification
    "window_mixed": ([9, 1, 1, 33, 4, 1], [0, 3, 40, 20, 30, 70], 5, None, None),
    "window_long_prefill": ([300, 1, 17], [0, 90, 60], 11, None, None),
    "window_decodes": ([1] * 6, [0, 4, 7, 8, 30, 200], 8, None, None),
    "softcap_mixed": ([9, 1, 4, 1], [0, 40, 30, 3], None, 0.7, None),
    "softcap_window": ([20, 1, 3], [10, 50, 8], 6, 0.5, None),
    # ranges inside a prefill chunk; one chunk starting inside a range (its start cached); a range
    # wholly in the cached prefix; beside decodes and a range-free prefill
    "bidir_prefill": ([30, 1, 12, 20], [0, 25, 0, 10], None, None,
                      [((3, 11), (14, 29)), (), ((2, 4),), ((5, 12), (14, 27))]),
    "bidir_window": ([40, 1, 18], [0, 12, 0], 6, None, [((4, 20), (24, 33)), (), ((0, 9),)]),
    "bidir_softcap_short": ([6, 1], [3, 9], None, 0.6, [((4, 8),), ()]),  # a short chunk: a decode-sized one
}


@pytest.fixture(params=["kernel", "gather"])
def decode_path(request, monkeypatch) -> str:
    if request.param == "kernel" and cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    monkeypatch.setattr(torch_attention, "use_cpu_kernel", request.param == "kernel")
    return request.param


def _batch(name, heads, block_size, dtype=torch.float32, device="cpu") -> tuple[PagedBatch, tuple]:
    q_lens, prefix_lens, window, softcap, ranges = CASES[name]
    batch = make_batch(q_lens, prefix_lens, *heads, block_size=block_size, dtype=dtype, device=device,
                       seed=list(CASES).index(name))
    if ranges is not None:
        with_ranges(batch, ranges)
    return batch, (window, softcap, ranges)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_attention_options_match_dense_reference(case, heads, block_size, decode_path):
    batch, (window, softcap, ranges) = _batch(case, heads, block_size)
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                                    window=window, softcap=softcap)
    expected = dense_reference(batch, window, softcap, ranges)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)
    # the options change the result: a test of them that the plain causal output passes proves nothing
    plain = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache,
                                      with_ranges(batch, ()).meta if ranges else batch.meta, SCALE)
    assert not torch.allclose(plain.double(), expected, atol=1e-4)


def test_cpu_kernel_window_and_softcap_at_head_sizes(decode_path):
    """The C kernel's specialised head sizes, its per-sequence and per-head work splits."""
    if decode_path != "kernel":
        pytest.skip("the gather path: test_torch_attention_options_match_dense_reference")
    for head_dim in (64, 128, 40):
        for q_lens, prefix_lens in (([1] * 12 + [3] * 4, [5 * i + 3 for i in range(16)]), ([1, 3, 1], [77, 18, 130])):
            batch = make_batch(q_lens, prefix_lens, 12, 4, head_dim=head_dim, block_size=16, seed=head_dim)
            out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                                            window=17, softcap=0.9)
            torch.testing.assert_close(out.double(), dense_reference(batch, 17, 0.9), atol=1e-5, rtol=1e-5)
            assert any(plan.kernel_seqs is not None for plan in batch.meta.plans.values())


def test_half_precision_window_and_ranges():
    batch, (window, softcap, ranges) = _batch("bidir_window", (8, 2), 8, dtype=torch.bfloat16)
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE, window=window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(batch, window, None, ranges), atol=2e-2, rtol=2e-2)


def test_metadata_key_ends_of_ranges():
    # seq 0: chunk of positions 2..9 with range [4, 8); seq 1: a decode at 5; seq 2: chunk 6..8 starting
    # inside [5, 9); seq 3: a range of one token (nothing to widen)
    meta = AttentionMetadata.build([8, 1, 3, 2], [10, 6, 9, 2], [[0, 1, 2], [3, 4], [5, 6, 7], [8]], 4,
                                   bidirectional_ranges=[((4, 8),), (), ((5, 9),), ((0, 1),)])
    assert meta.query_key_ends.tolist() == [3, 4, 8, 8, 8, 8, 9, 10] + [6] + [9, 9, 9] + [1, 2]
    assert meta.bidirectional_ranges[0] == ((4, 8),)
    plain = AttentionMetadata.build([1, 2], [5, 9], [[3, 1], [0, 2, 4]], 4, bidirectional_ranges=[(), ((0, 1),)])
    assert plain.query_key_ends is None  # nothing widened: the causal paths serve it
    assert AttentionMetadata.build([1], [5], [[3, 1]], 4).query_key_ends is None
    with pytest.raises(ValueError, match="a chunk must take a range whole"):
        AttentionMetadata.build([4], [6], [[0, 1]], 4, bidirectional_ranges=[((4, 8),)])


def test_bad_options_are_refused():
    batch = make_batch([3], [2])
    for kwargs in ({"window": 0}, {"window": 2.5}, {"softcap": 0.0}, {"softcap": -1.0}):
        with pytest.raises(ValueError):
            torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE, **kwargs)


# ---------------------------------------------------------------- triton

TRITON_CASES = [  # (case, (Hq, Hkv, D), block_size)
    ("window_mixed", (8, 2, 32), 8),
    ("window_decodes", (4, 1, 32), 8),
    ("softcap_window", (4, 2, 32), 16),
    ("bidir_prefill", (8, 2, 32), 8),
    ("bidir_window", (4, 4, 16), 16),
    ("bidir_softcap_short", (4, 2, 32), 8),
]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}


def check_triton_case(name, heads, block_size, dtype, device):
    from epd.engine.attention import triton_decode, triton_prefill
    from epd.engine.attention.triton_decode import MAX_QUERY_LEN

    batch, (window, softcap, ranges) = _batch(name, heads, block_size, dtype=dtype, device=device)
    expected = dense_reference(batch, window, softcap, ranges).to(device)
    tol = TOLERANCE[dtype]
    options = dict(window=window, softcap=softcap)
    out = triton_prefill.paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE,
                                                 **options)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    out = get_backend("triton").attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE, **options)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    if batch.meta.max_seqlen_q <= MAX_QUERY_LEN and batch.meta.query_key_ends is None:
        for num_splits in (1, 2, 4):
            out = triton_decode.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                                       SCALE, num_splits=num_splits, **options)
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol,
                                       msg=lambda m: f"num_splits={num_splits}: {m}")


@pytest.mark.skipif(not INTERPRETING, reason="run by test_triton_kernels_under_interpreter in a subprocess")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_interpreted(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cpu")


def test_triton_kernels_under_interpreter():
    run_interpreted(__file__, len(TRITON_CASES) * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_gpu(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cuda")
