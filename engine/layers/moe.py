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

CPU path (`fused_moe_torch`): the (token, expert) pairs are sorted by expert
and each expert that got tokens runs once on its rows. GPU path: the Triton
kernel in layers/triton_moe.py, tested against this one.

`add_mlp`: a decoder layer's residual plus its MLP, dense or either MoE block.
"""
from __future__ import annotations

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


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, hidden] -> [num_tokens, hidden]: sum over each token's k
    experts of weight * down(silu(gate(x)) * up(x))."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    inter = w2.shape[2]
    pairs, counts = sort_by_expert(topk_ids, num_experts)
    flat_weights = topk_weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:  # never touched: no work for an expert nobody chose
            continue
        rows = pairs[start:start + n]
        start += n
        tokens = rows // top_k
        h = F.linear(x[tokens], w13[expert])  # [n, 2 * inter]
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[expert])  # [n, hidden]
        out.index_add_(0, tokens, y * flat_weights[rows, None])
    return out


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool):
        super().__init__()
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.register_buffer("w13", torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.register_buffer("w2", torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]."""
        topk_weights, topk_ids = route(self.gate(x), self.top_k, self.normalize)
        if use_triton:
            from epd.engine.layers.triton_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        return fused_moe_torch(x, self.w13, self.w2, topk_weights, topk_ids)


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


class GroupedMoeBlock(nn.Module):
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
        self.shared_experts = MLP(hidden_size, intermediate_size * num_shared)

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]: routed experts' sum plus the shared experts'."""
        logits = self.gate(x.float())  # [num_tokens, num_experts]; the router is float32 (maybe packed on CPU)
        weights, ids = route_grouped(logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                     self.topk_groups, self.normalize, self.scaling)
        weights = weights.to(x.dtype)
        if use_triton:
            from epd.engine.layers.triton_moe import fused_moe

            routed = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            routed = fused_moe_torch(x, self.w13, self.w2, weights, ids)
        return routed + self.shared_experts(x)
