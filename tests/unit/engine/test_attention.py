"""Paged attention: torch backend vs a naive dense reference, triton kernels
vs the torch backend.

Triton on CPU needs TRITON_INTERPRET=1 before the kernels are decorated, so
`test_triton_kernels_under_interpreter` reruns this file's
`test_triton_interpreted` cases in a subprocess with it set; on a CUDA
machine `test_triton_gpu` also runs them natively.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
import torch
from testkit.triton_interpreter import INTERPRETING, run_interpreted

from epd.engine.attention import AttentionMetadata, get_backend
from epd.engine.attention import cpu_kernel, torch_attention

HAS_CUDA = torch.cuda.is_available()
SCALE = 0.3


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # dense, per sequence: [seq_len, Hkv, D]
    values: list[torch.Tensor]
    q_lens: list[int]


def make_batch(q_lens, prefix_lens, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
               dtype=torch.float32, device="cpu", seed=0) -> PagedBatch:
    """Random K/V for each sequence scattered into a paged cache through a
    shuffled block table; every unused cache slot holds NaN, so reading
    outside a sequence's context poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(perm[start:start + n])
        start += n
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    for table, k, v in zip(tables, keys, values):
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=device)
    return PagedBatch(query.to(device), k_cache.to(device), v_cache.to(device), meta,
                      keys, values, list(q_lens))


def naive_attention(batch: PagedBatch, scale: float = SCALE) -> torch.Tensor:
    """Dense causal attention with offset, float64, one sequence at a time."""
    num_q_heads = batch.query.shape[1]
    outs, start = [], 0
    for q_len, k, v in zip(batch.q_lens, batch.keys, batch.values):
        seq_len, num_kv_heads, _ = k.shape
        q = batch.query[start:start + q_len].cpu().double()  # [q_len, Hq, D]
        start += q_len
        k = k.double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # [seq_len, Hq, D]
        v = v.double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q_len, seq_len)
        hidden = torch.arange(seq_len)[None, :] > positions[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(hidden, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


# (q_lens, prefix_lens): prefill without and with a cached prefix, decodes of
# very different lengths (several decode batches), and mixed batches
CASES = {
    "prefill": ([7, 16, 33], [0, 0, 0]),
    "prefill_prefix": ([5, 12, 1], [19, 33, 0]),
    "long_prefill_prefix": ([600, 3], [100, 40]),  # 600 query rows: several calls of rows
    "decode": ([1, 1, 1, 1, 1], [0, 15, 40, 7, 41]),
    "mixed": ([1, 9, 1, 4, 20], [30, 0, 2, 21, 17]),
    # long contexts: one-token decodes of at least _DECODE_ALONE_BYTES of K attended alone, beside
    # short ones batched and a prefill (the gather buffers are reused across sequences and calls)
    "long_decode": ([1, 1, 1, 1, 1, 7], [300, 700, 5, 600, 290, 12]),
    # speculative decoding: a decode's last token and its draft, behind its context (several query
    # tokens, causal among them), batched by count; beside one-token decodes and a prefill
    "verify": ([4, 4, 1, 3, 4, 17, 2], [30, 3, 12, 50, 1, 40, 0]),
}


@pytest.fixture(params=["kernel", "gather"])
def decode_path(request, monkeypatch) -> str:
    """The torch backend's CPU decodes: the C kernel (engine/attention/paged_attention_cpu.c), or
    the gather + SDPA path it replaces where it cannot be built."""
    if request.param == "kernel":
        if cpu_kernel.load() is None:
            pytest.skip("no C compiler here: the CPU kernel is not built")  # the gather path still runs
    monkeypatch.setattr(torch_attention, "use_cpu_kernel", request.param == "kernel")
    return request.param


def _kernel_used(meta: AttentionMetadata) -> bool:
    return any(plan.kernel_seqs is not None for plan in meta.plans.values())


@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_attention_matches_naive(case, heads, block_size, decode_path):
    q_lens, prefix_lens = CASES[case]
    batch = make_batch(q_lens, prefix_lens, *heads, block_size=block_size, seed=list(CASES).index(case))
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    assert out.shape == batch.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-6, rtol=2e-6)
    assert _kernel_used(batch.meta) == (decode_path == "kernel")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_cpu_kernel_head_sizes_threads_and_both_work_splits(head_dim, threads, decode_path):
    """The kernel's specialised head sizes (64, 128) and any other; a work item per sequence (16
    decodes: at least 4 a thread) and per (sequence, kv head) (3 decodes), on 1 and 2 threads;
    one-token decodes beside drafts' verifications (3 query tokens) and a prefill."""
    if decode_path != "kernel":
        pytest.skip("the gather path's head sizes: test_torch_attention_matches_naive")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q_lens, prefix_lens in (([1] * 12 + [3] * 4 + [9], [5 * i + 3 for i in range(16)] + [0]),
                                    ([1, 3, 1], [77, 18, 130])):
            batch = make_batch(q_lens, prefix_lens, 12, 4, head_dim=head_dim, block_size=16, seed=head_dim)
            out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)
            # float32 sums of up to 128 products in another order than the float64 reference's
            torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)
            assert _kernel_used(batch.meta)
    finally:
        torch.set_num_threads(before)


def test_cpu_kernel_refuses_a_block_id_outside_the_cache(decode_path):
    """It reads blocks by id unchecked: the plan checks them once a step."""
    batch = make_batch(*CASES["decode"])
    batch.meta.block_tables[2, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError if decode_path == "kernel" else IndexError):
        torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)


def test_loading_the_kernel_leaves_the_process_floating_point_alone():
    """Linked with -ffast-math, the library would flush subnormals to zero in the whole process
    when loaded (GCC's crtfastmath): torch's sums, and every other number, would change."""
    if cpu_kernel.load() is None:
        pytest.skip("no C compiler here: the CPU kernel is not built")
    assert 2.2250738585072014e-308 / 2 > 0
    assert float(torch.tensor([1e-38], dtype=torch.float32) / 100) > 0


def test_without_a_compiler_the_kernel_is_not_built_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert cpu_kernel._load() is None
    assert "CPU attention kernel not built" in caplog.text and not list(tmp_path.glob("*.so"))
    monkeypatch.setenv("EPD_CPU_ATTENTION_KERNEL", "0")  # switched off: not even tried
    caplog.clear()
    assert cpu_kernel._load() is None and not caplog.text


def test_torch_attention_in_and_out_of_inference_mode():
    """The gather buffers a thread keeps: one made under inference mode (the engine's) is not
    written outside it (an offline caller's), and the other way round."""
    batch = make_batch(*CASES["long_decode"])
    expected, outs, errors = naive_attention(batch), [], []

    def calls():  # a new thread: no buffer kept yet, the first one made under inference mode
        try:
            for inference in (True, False, True):
                with torch.inference_mode(inference):
                    outs.append(torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                                          SCALE))
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=calls)
    thread.start()
    thread.join(60)
    assert not errors and len(outs) == 3, errors
    for out in outs:
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_attention_half_precision(dtype):
    batch = make_batch(*CASES["mixed"], num_q_heads=8, num_kv_heads=2, dtype=dtype)
    out = torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    assert out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=tol, rtol=tol)


def test_torch_store_kv_writes_slots_and_skips_padding():
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    torch_attention.store_kv(key, value, k_cache, v_cache, torch.tensor([17, -1, 3]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 3], key[2]) and torch.equal(v_cache[0, 3], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # the padding token wrote nothing


def test_store_then_attend_equals_prefilled_cache():
    """The runner's order: store the new tokens' K/V, then attend."""
    batch = make_batch(*CASES["mixed"], num_q_heads=8, num_kv_heads=2, block_size=8)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    new_slots = batch.meta.slot_mapping
    k_cache.view(-1, 2, 32)[new_slots] = float("nan")  # forget the new tokens
    v_cache.view(-1, 2, 32)[new_slots] = float("nan")
    new_k = torch.cat([k[-q:] for q, k in zip(batch.q_lens, batch.keys)])
    new_v = torch.cat([v[-q:] for q, v in zip(batch.q_lens, batch.values)])
    torch_attention.store_kv(new_k, new_v, k_cache, v_cache, new_slots)
    out = torch_attention.attention(batch.query, k_cache, v_cache, batch.meta, SCALE)
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-6, rtol=2e-6)


def test_metadata_build():
    meta = AttentionMetadata.build([2, 1], [5, 9], [[3, 1], [0, 2, 4]], block_size=4)
    # seq 0: positions 3, 4 -> block 3 offset 3, block 1 offset 0; seq 1: position 8 -> block 4 offset 0
    assert meta.slot_mapping.tolist() == [15, 4, 16]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[3, 1, 0], [0, 2, 4]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.is_decode_only) == (2, 9, False)
    assert AttentionMetadata.build([1, 1], [5, 9], [[3, 1], [0, 2, 4]], 4).is_decode_only
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_get_backend():
    backend = get_backend("torch")
    assert backend.name == "torch" and backend.attention is torch_attention.attention
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


def test_attention_rejects_bad_shapes():
    batch = make_batch([3], [2], num_q_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        torch_attention.attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)


# ---------------------------------------------------------------- triton

TRITON_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}  # interpreter bf16 casts truncate
TRITON_CASES = [
    # name, q_lens, prefix_lens, (Hq, Hkv, D), block_size
    ("prefill_gqa_bs16", [5, 70, 1, 12], [19, 3, 40, 0], (8, 2, 32), 16),
    ("prefill_mha_bs8_d24", [9, 1, 17], [30, 2, 0], (2, 2, 24), 8),
    ("decode_gqa_bs16", [1] * 4, [0, 15, 299, 64], (8, 2, 32), 16),
    ("decode_g5_bs8", [1] * 3, [130, 6, 33], (5, 1, 32), 8),
    # speculative decoding's verification, in the decode kernel: drafts beside a decode and a short prefill;
    # a split whose keys the first draft rows cannot see yet (126 + 4 keys, splits of 128)
    ("verify_gqa_bs8", [4, 1, 3, 9], [21, 40, 2, 0], (4, 2, 32), 8),
    ("verify_split_edge_g4_bs16", [4, 4], [126, 60], (4, 1, 32), 16),
]


def check_triton_case(name, q_lens, prefix_lens, heads, block_size, dtype, device):
    from epd.engine.attention import triton_decode, triton_prefill, triton_store
    from epd.engine.attention.triton_decode import MAX_QUERY_LEN

    num_q_heads, num_kv_heads, head_dim = heads
    batch = make_batch(q_lens, prefix_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                       dtype=dtype, device=device, seed=len(name))
    tol = TOLERANCE[dtype]
    # reference: the torch backend in float32 on the same (rounded) inputs
    ref = torch_attention.attention(batch.query.float(), batch.k_cache.float(), batch.v_cache.float(),
                                    batch.meta, SCALE)

    # store_kv: bit-exact vs torch, padding slots skipped
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1
    new_k = torch.randn(slots.shape[0], num_kv_heads, head_dim, device=device).to(dtype)
    new_v = torch.randn_like(new_k)
    triton_store.store_kv(new_k, new_v, k_cache, v_cache, slots)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_attention.store_kv(new_k, new_v, ref_k, ref_v, slots)
    assert torch.equal(k_cache.nan_to_num(), ref_k.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), ref_v.nan_to_num())

    # the prefill kernel serves any batch, decodes included
    out = triton_prefill.paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)

    dispatched = get_backend("triton").attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, SCALE)
    torch.testing.assert_close(dispatched.float(), ref, atol=tol, rtol=tol)

    if batch.meta.max_seqlen_q <= MAX_QUERY_LEN:  # decodes, and decodes verifying a draft
        for num_splits in (1, 2, 4):
            out = triton_decode.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta,
                                                       SCALE, num_splits=num_splits)
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol,
                                       msg=lambda m: f"num_splits={num_splits}: {m}")


@pytest.mark.skipif(not INTERPRETING, reason="run by test_triton_kernels_under_interpreter in a subprocess")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_interpreted(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cpu")


def test_triton_kernels_under_interpreter():
    run_interpreted(__file__, len(TRITON_CASES) * len(TRITON_DTYPES))


GPU_CASES = TRITON_CASES + [  # plus Qwen3-VL-4B layer shapes
    ("qwen3vl_4b_mixed", [1, 1, 300, 1], [700, 2000, 90, 5], (32, 8, 128), 16),
    ("qwen3vl_4b_decode", [1] * 8, [4000, 1, 17, 900, 64, 3000, 2, 511], (32, 8, 128), 16),
    ("qwen3vl_4b_verify", [4, 4, 1, 3, 4], [700, 2000, 90, 5, 3000], (32, 8, 128), 16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_triton_gpu(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only message")
def test_bench_kernels_without_cuda_exits_with_message(capsys):
    from bench.dev import kernels

    assert kernels.main([]) == 1
    assert "CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("num_groups", [1, 2, 4, 7, 8, 32])
def test_the_triton_warm_up_covers_every_decode_tile(num_groups):
    """`triton_attention.prepare` compiles the decode kernel at `decode_query_lens`: every
    query length the decode kernel can be launched with maps to one of their tile heights
    (a length left out would compile, and stall its step, on first use)."""
    from epd.engine.attention.triton_attention import MAX_QUERY_LEN, decode_query_lens, uses_decode_kernel
    from epd.engine.attention.triton_decode import block_g

    warmed = {block_g(num_groups, q) for q in decode_query_lens(num_groups)}
    launched = {block_g(num_groups, q) for q in range(1, MAX_QUERY_LEN + 1) if q == 1 or uses_decode_kernel(q, num_groups)}
    assert warmed == launched
    assert len(decode_query_lens(num_groups)) == len(launched)  # one compile per tile height
