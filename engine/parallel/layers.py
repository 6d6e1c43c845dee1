"""The layers a tensor-parallel rank swaps into a model built over engine/layers/.

`parallelize(model, shard)` runs on the model built on "meta" with the rank's
head and intermediate counts (`Shard.local_config`), before it is filled: the
q/k/v and gate/up projections are already column-parallel by their sizes
(plain `nn.Linear`s of the rank's rows, packed as usual); what needs a
collective is swapped here, keeping the parameter names the checkpoint fills:

  * `RowParallelLinear` (o_proj, down_proj): x [N, in / size] -> the sum over
    ranks [N, out] by an all-reduce; a bias added once, after the sum.
  * `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary run,
    zeros elsewhere, and an all-reduce sums them (each row from exactly one rank).
  * `VocabParallelHead` (lm_head): each rank's logits of its run, padded to the
    longest run, gathered on rank 0 and cut to the vocabulary (rank 0 samples;
    a follower's call returns its own run only).

Where a layer kind is not sharded yet (MoE blocks, Gated DeltaNet, LoRA,
quantized linears) `parallelize` refuses it by name. Packing for oneDNN
(transport/weights/cpu_linear.py) reaches these through their `pack_weights`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.attention import Attention
from epd.engine.layers.mlp import MLP
from epd.engine.parallel.shard import Shard, TensorParallelError
from epd.transport.weights.cpu_linear import PackedLinear, can_pack


class RowParallelLinear(nn.Module):
    """A linear whose input features are cut over the ranks: the output is the all-reduced sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard):
        super().__init__()
        self.in_features, self.out_features, self.shard = in_features, out_features, shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: PackedLinear | None = None

    def pack_weights(self) -> None:
        """The weight packed for oneDNN where it can be (CPU float32); the plain copy released."""
        if self.packed is not None:
            return
        plain = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        plain.weight = self.weight
        if can_pack(plain):
            self.packed = PackedLinear(plain)
            del self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in / size] -> [N, out], summed over the ranks."""
        y = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        self.shard.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token embedding's rows [start, start + length) on this rank."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard):
        super().__init__()
        self.shard = shard
        self.start, self.length = shard.vocab_run(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.length, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, hidden]."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.length)
        x = F.embedding(local.clamp(0, max(self.length - 1, 0)), self.weight)
        x[outside] = 0
        return self.shard.comm.all_reduce(x)


class VocabParallelHead(nn.Module):
    """The output head's rows of this rank's vocabulary run; rank 0 gets all the logits."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard):
        super().__init__()
        self.shard, self.vocab_size = shard, vocab_size
        self.start, self.length = shard.vocab_run(vocab_size)
        self.per_rank = -(-vocab_size // shard.size)
        self.weight = nn.Parameter(torch.empty(self.length, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] on rank 0 ([N, ceil(vocab / size)], its own run, on the others)."""
        logits = F.linear(hidden, self.weight)
        if self.length < self.per_rank:  # the last run is shorter: padded for the gather, cut after it
            logits = F.pad(logits, (0, self.per_rank - self.length))
        runs = self.shard.comm.gather(logits.contiguous())
        return logits if runs is None else torch.cat(runs, dim=-1)[:, :self.vocab_size]


def parallelize(model: nn.Module, shard: Shard) -> nn.Module:
    """`model` (a `DecoderForCausalLM` over engine/layers/, on "meta", built with the rank's head
    and intermediate counts) with its row-parallel linears, embedding and head swapped in place."""
    cfg = model.cfg
    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            module.o_proj = _row_parallel(module.o_proj, shard)
        elif isinstance(module, MLP):
            module.down_proj = _row_parallel(module.down_proj, shard)
        elif name and hasattr(module, "pack_experts"):
            raise TensorParallelError(f"{name}: mixture-of-experts layers are not sharded by tensor "
                                      "parallelism yet")
        elif name and hasattr(module, "state_idx"):
            raise TensorParallelError(f"{name}: Gated DeltaNet layers are not sharded by tensor parallelism yet")
    model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
    model.lm_head = VocabParallelHead(cfg.vocab_size, cfg.hidden_size, shard)
    return model


def _row_parallel(linear: nn.Module, shard: Shard) -> RowParallelLinear:
    if type(linear) is not nn.Linear:
        raise TensorParallelError(f"a {type(linear).__name__} projection is not sharded by tensor parallelism yet")
    return RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, shard)
