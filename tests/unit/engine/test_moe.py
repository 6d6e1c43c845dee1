"""Sparse MoE: the routed-experts torch path against a dense reference and
transformers' own block; the Triton kernel against the torch path.

Triton on CPU needs TRITON_INTERPRET=1 before the kernel is decorated, so
`test_triton_moe_under_interpreter` reruns this file's
`test_triton_interpreted` cases in a subprocess with it set; on a CUDA
machine `test_triton_gpu` runs them natively.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from testkit.triton_interpreter import INTERPRETING, run_interpreted

from epd.engine.layers.mlp import pack_cpu_linears
from epd.engine.layers.moe import SparseMoeBlock, bucket_rows, fused_moe_torch, route, run_experts

HAS_CUDA = torch.cuda.is_available()


def make_case(num_tokens=40, hidden=32, inter=24, num_experts=8, top_k=2, dtype=torch.float32,
              device="cpu", seed=0, unused_expert: int | None = None):
    """Random x and experts, router logits peaked enough that tokens spread over
    the experts; `unused_expert` is never chosen."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = 3 * torch.randn(num_tokens, num_experts, generator=gen)
    if unused_expert is not None:
        logits[:, unused_expert] = -1e4
    weights, ids = route(logits, top_k, normalize=True)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(**to), ids.to(device)


def dense_reference(x, w13, w2, topk_weights, topk_ids):
    """Every expert on every token, weighted by a dense [num_tokens, num_experts] routing matrix."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    dense = torch.zeros(x.shape[0], num_experts, dtype=torch.float64).scatter_add_(
        1, topk_ids, topk_weights.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(num_experts):
        h = x.double() @ w13[e].double().T
        out += dense[:, e:e + 1] * ((F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].double().T)
    return out.to(x.dtype)


def test_router_top_k_and_normalisation():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = route(logits, 2, normalize=True)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    raw, _ = route(logits, 2, normalize=False)
    torch.testing.assert_close(raw, F.softmax(logits, -1).gather(1, ids))
    assert raw.sum(-1).max() < 1


def test_torch_path_equals_dense_reference_on_tokens_that_pick_different_experts():
    x, w13, w2, weights, ids = make_case()
    chosen = {tuple(sorted(r)) for r in ids.tolist()}
    assert len(chosen) >= 10 and set(ids.flatten().tolist()) == set(range(8)), "routing should spread"
    torch.testing.assert_close(fused_moe_torch(x, w13, w2, weights, ids), dense_reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_torch_path_never_runs_an_expert_nobody_chose():
    x, w13, w2, weights, ids = make_case(unused_expert=5)
    w13[5], w2[5] = float("nan"), float("nan")  # a dense loop over all experts would spread the NaN
    out = fused_moe_torch(x, w13, w2, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense_reference(x, w13.nan_to_num(), w2.nan_to_num(), weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_block_equals_transformers_sparse_moe_block():
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    cfg = Qwen3VLMoeTextConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3)
    torch.manual_seed(0)
    ref = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    ours = SparseMoeBlock(32, 24, 6, 3, normalize=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        ours.gate.weight.copy_(ref.gate.weight)
        ours.w13.copy_(ref.experts.gate_up_proj)
        ours.w2.copy_(ref.experts.down_proj)
        x = torch.randn(1, 50, 32)
        torch.testing.assert_close(ours(x[0]), ref(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_packed_bfloat16_experts_match_the_reference_with_padded_row_counts():
    # 200 tokens x 2 over 8 experts: ~50 rows an expert, padded to a bucket (bucket_rows); expert 5 unused
    x, w13, w2, weights, ids = make_case(num_tokens=200, unused_expert=5)
    assert {bucket_rows(n) for n in ids.flatten().bincount().tolist()} - set(ids.flatten().bincount().tolist())
    block = SparseMoeBlock(32, 24, 8, 2, normalize=True).to(torch.bfloat16)
    with torch.no_grad():
        block.w13.copy_(w13)
        block.w2.copy_(w2)
    plain = fused_moe_torch(x.bfloat16(), block.w13, block.w2, weights.bfloat16(), ids)
    pack_cpu_linears(torch.nn.Sequential(block))  # as the engine does after loading
    assert block.packed is not None and block.w13 is None and block.w2 is None  # the plain copies released
    packed = run_experts(x.bfloat16(), weights.bfloat16(), ids, 8, block.packed)
    ref = dense_reference(x, w13.bfloat16().float(), w2.bfloat16().float(), weights, ids)
    # bfloat16 rounding only: no further from the float32 reference than the plain bfloat16 linears
    packed_err, plain_err = (packed.float() - ref).abs().max(), (plain.float() - ref).abs().max()
    assert packed_err <= 1.5 * plain_err and packed_err < 0.05 * ref.abs().max(), (packed_err, plain_err)


def test_float32_experts_stay_plain():
    block = SparseMoeBlock(32, 24, 8, 2, normalize=True)
    assert not block.pack_experts() and block.packed is None and block.w13 is not None


def test_bucket_rows_pads_by_at_most_an_eighth():
    sizes = [bucket_rows(n) for n in range(1, 4097)]
    assert sizes[:16] == list(range(1, 17))  # decode-sized counts exact
    assert all(n <= b <= n + n / 8 for n, b in enumerate(sizes, 1))
    assert len(set(sizes)) <= 16 + 8 * 8  # a handful of primitives per octave


# -- Triton ---------------------------------------------------------------------------

TRITON_CASES = [  # (name, num_tokens, hidden, inter, num_experts, top_k)
    ("decode_one_token", 1, 32, 24, 8, 2),
    ("prefill_ragged", 37, 48, 40, 6, 3),  # tiles with padding rows, N and K not block multiples
    ("more_experts_than_pairs", 3, 32, 16, 16, 2),  # most experts get nothing
]
TRITON_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_triton_case(name, num_tokens, hidden, inter, num_experts, top_k, dtype, device):
    from epd.engine.layers.triton_moe import align_by_expert, fused_moe

    x, w13, w2, weights, ids = make_case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=3)
    rows, tiles = align_by_expert(ids, num_experts, block_m=16)
    got = rows[rows >= 0].sort().values
    assert torch.equal(got.cpu(), torch.arange(num_tokens * top_k)), "every pair lands in exactly one row"
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not INTERPRETING, reason="run by test_triton_moe_under_interpreter in a subprocess")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_interpreted(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cpu")


def test_triton_moe_under_interpreter():
    run_interpreted(__file__, len(TRITON_CASES) * len(TRITON_DTYPES))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_gpu(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cuda")
