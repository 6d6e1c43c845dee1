"""Sparse mixture-of-experts MLPs, computing only routed experts.

`SparseMoeBlock` (Qwen3-VL-MoE): softmax over all experts in float32, top-k,
optionally renormalised to sum to 1 (Qwen3-VL-MoE always does), cast back to
the activation dtype. `GroupedMoeBlock` (GLM-4.5V; DeepSeek-V3's routing):
a float32 router of sigmoid scores, experts chosen by score plus a learned
correction bias within the best groups of experts, weighted by their scores
renormalised and scaled, plus always-on shared experts (a dense MLP).
Experts are SwiGLU MLPs stored fused as the checkpoints hold them:
`w13` [num_experts, 2 * intermediate, hidden] (gate rows, then up rows) and
`w2` [num_experts, hidden, intermediate]. The expert weights are buffers, not
parameters: engine/loader.py fills them itself because checkpoints store
them in either orientation.

CPU path (`run_experts`): the (token, expert) pairs are sorted by expert, the
rows gathered once, each expert that got tokens runs once on its contiguous
rows, and one index_add sums them back. `fused_moe_torch` runs the experts as
plain linears (the reference); in bfloat16, a block's `pack_experts` (called by
`pack_cpu_linears` after loading) packs each expert's projections for oneDNN
(`PackedExperts`). GPU path: the Triton kernel in layers/triton_moe.py, tested
against `fused_moe_torch`.

`add_mlp`: a decoder layer's residual plus its MLP, dense or either MoE block.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.mlp import MLP


def add_mlp(mlp: nn.Module, h: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """residual + mlp(h), h [N, hidden] normed. A dense `MLP` adds the residual on down_proj's
    call (where it is packed, cpu_linear.py); a MoE block runs the fused Triton kernel where
    the attention runs in Triton too (GPU)."""
    if isinstance(mlp, MLP):
        return mlp(h, residual=residual)
    return residual + mlp(h, use_triton=batch.backend.name == "triton")

def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (topk_weights, topk_ids), each [num_tokens, top_k]."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert [num_tokens * top_k], tokens per expert [num_experts]).
    Pair p is token p // top_k's choice p % top_k; the sort is stable, so an
    expert's rows keep token order."""
    flat = topk_ids.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def run_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [num_tokens, hidden] -> [num_tokens, hidden]: sum over each token's k experts of
    weight * expert(e, rows). The rows are gathered once in expert order, each expert that got
    tokens runs once on its contiguous rows, and one index_add sums them back (in the same order
    as one index_add per expert would)."""
    top_k = topk_ids.shape[1]
    pairs, counts = sort_by_expert(topk_ids, num_experts)
    tokens = pairs // top_k
    xs = x[tokens]  # [num_tokens * top_k, hidden], grouped by expert
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:  # never touched: no work for an expert nobody chose
            continue
        ys[start:start + n] = expert(e, xs[start:start + n])
        start += n
    ys.mul_(topk_weights.flatten()[pairs, None])
    return torch.zeros_like(x).index_add_(0, tokens, ys)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, hidden] -> [num_tokens, hidden]: sum over each token's k
    experts of weight * down(silu(gate(x)) * up(x))."""
    inter = w2.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = F.linear(rows, w13[e])  # [n, 2 * inter]
        return F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e])  # [n, hidden]

    return run_experts(x, topk_weights, topk_ids, w13.shape[0], expert)


# Packed on CPU (a measured gain on this project's AMX host; bench/dev/moe_cpu.py). float32 is not: its
# F.linear runs MKL on the plain weight about as fast.
PACKED_EXPERT_DTYPES = (torch.bfloat16,)


class PackedExperts:
    """Each expert's fused gate/up and down projections as oneDNN-packed weights (CPU, inference).
    Bare `F.linear` in bfloat16 reorders the weight into oneDNN's layout on every call; packed
    once, it is read as it lies. (Gate and up as two calls with the SiLU and the product as
    post-ops measured 1.06-1.17x slower than one call and two elementwise ops, 8-512 tokens.)"""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        self.inter = w2.shape[2]
        reorder = torch.ops.mkldnn._reorder_linear_weight
        with torch.no_grad():
            self.gate_up = [reorder(w.contiguous(), None) for w in w13]
            self.down = [reorder(w.contiguous(), None) for w in w2]

    def __call__(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, hidden] -> expert e's output [n, hidden]."""
        n = rows.shape[0]
        padded = bucket_rows(n)
        if padded != n:  # zero rows, dropped below: their outputs touch no real row
            rows = F.pad(rows, (0, 0, 0, padded - n))
        linear = torch.ops.mkldnn._linear_pointwise
        h = linear(rows, self.gate_up[e], None, "none", [], "")  # [padded, 2 * inter]
        return linear(F.silu(h[:, :self.inter]) * h[:, self.inter:], self.down[e], None, "none", [], "")[:n]


def bucket_rows(n: int) -> int:
    """n rounded up to one of 8 sizes an octave above 16 (at most 1/8 more rows). oneDNN builds a
    primitive for each row count it meets (1-3 ms each, bench/dev/moe_cpu.py); an expert's row
    count changes with every prefill chunk, so without buckets a prefill builds a new one per call."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def can_pack_experts(w13: torch.Tensor) -> bool:
    return (w13.device.type == "cpu" and w13.dtype in PACKED_EXPERT_DTYPES and not w13.is_meta
            and torch.backends.mkldnn.is_available())


class RoutedExperts(nn.Module):
    """What both MoE blocks share: their experts' `w13` / `w2` buffers (or `packed`, once
    `pack_experts` ran) and how the routed experts run."""

    num_experts: int
    packed: PackedExperts | None

    def pack_experts(self) -> bool:
        """The experts as `PackedExperts` where they can be packed (CPU bfloat16; `pack_cpu_linears`
        calls this after loading); the plain `w13` / `w2` are released (both would double the
        experts' memory). Returns whether they were packed."""
        if self.packed is not None or not can_pack_experts(self.w13):
            return False
        self.packed = PackedExperts(self.w13, self.w2)
        self.w13 = self.w2 = None
        return True

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, use_triton: bool) -> torch.Tensor:
        """The routed experts' weighted sum on x [num_tokens, hidden]: Triton (GPU), packed (CPU
        bfloat16), or plain torch."""
        if use_triton:
            from epd.engine.layers.triton_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        if self.packed is not None:
            return run_experts(x, weights, ids, self.num_experts, self.packed)
        return fused_moe_torch(x, self.w13, self.w2, weights, ids)


class SparseMoeBlock(RoutedExperts):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool):
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.register_buffer("w13", torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.register_buffer("w2", torch.empty(num_experts, hidden_size, intermediate_size))
        self.packed = None  # pack_experts (CPU bfloat16)

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.normalize)
        return self.routed(x, topk_weights, topk_ids, use_triton)


def route_grouped(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                  topk_groups: int, normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router_logits [num_tokens, num_experts] -> (topk_weights float32, topk_ids), each
    [num_tokens, top_k], as transformers' Glm4vMoeTextTopkRouter: a group's worth is the sum of its
    two best biased scores; experts outside the `topk_groups` best groups are never chosen."""
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    n, num_experts = choice.shape
    group_scores = choice.view(n, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(n, num_groups, num_experts // num_groups).reshape(n, num_experts)
    ids = torch.topk(choice.masked_fill(~expert_mask.bool(), float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class GroupedMoeBlock(RoutedExperts):
    """Routed experts by `route_grouped`, plus shared experts every token goes through."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, num_shared: int,
                 num_groups: int, topk_groups: int, normalize: bool, scaling: float):
        super().__init__()
        self.num_experts, self.top_k, self.normalize, self.scaling = num_experts, top_k, normalize, scaling
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router; the loader keeps it float32
        self.register_buffer("e_score_correction_bias", torch.empty(num_experts))
        self.register_buffer("w13", torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.register_buffer("w2", torch.empty(num_experts, hidden_size, intermediate_size))
        self.packed = None  # pack_experts (CPU bfloat16)
        self.shared_experts = MLP(hidden_size, intermediate_size * num_shared)

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]: routed experts' sum plus the shared experts'."""
        logits = self.gate(x.float())  # [num_tokens, num_experts]; the router is float32 (maybe packed on CPU)
        weights, ids = route_grouped(logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                     self.topk_groups, self.normalize, self.scaling)
        return self.routed(x, weights.to(x.dtype), ids, use_triton) + self.shared_experts(x)
