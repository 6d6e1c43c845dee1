"""`Shard`: one rank's part of a tensor-parallel language model, and the arithmetic of it.

Megatron's split, as vLLM's linear layers make it: the q heads, the MLP's
intermediate rows and the vocabulary are cut into `size` equal runs (the
vocabulary's last run may be shorter); rank r holds run r. K/V heads are cut
the same way when there are at least `size` of them, else each is replicated
on `size // num_kv_heads` ranks (rank r holds head r * num_kv_heads // size),
so the q heads of a rank always find their K/V head on it. The projections
that produce heads or intermediate rows (q/k/v, gate/up) are column-parallel:
rank r reads only its rows of the checkpoint's tensors and needs no
communication; those that consume them (o_proj, down_proj) are row-parallel:
rank r reads its columns, and the partial sums are added by an all-reduce
(engine/parallel/layers.py). `narrowing` gives each parameter's part for
the loader (transport/weights/checkpoint.py `load_weights`).

`comm` is the group's communicator (engine/parallel/comm.py), set once the
ranks have met; the layers call it during a forward.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A model, a layer kind or a setting that this tensor-parallel step cannot shard."""


_COLUMN = re.compile(r"\.(qkv_proj|gate_up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class Shard:
    rank: int
    size: int
    comm: object = None  # engine/parallel/comm.py GroupComm, once the group has met

    def run(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's run of `total` items cut into `size` equal runs."""
        length = total // self.size
        return self.rank * length, length

    def vocab_run(self, vocab_size: int) -> tuple[int, int]:
        """(start, length) of this rank's vocabulary rows: runs of ceil(V / size), the last shorter."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(per_rank, vocab_size - start)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the K/V heads this rank holds: its run, or the one head it replicates."""
        if num_kv_heads >= self.size:
            return self.run(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def holders(self, num_kv_heads: int) -> list[tuple[int, int, int]]:
        """(rank, first, count): which rank's cache to take each run of the K/V heads from, in head
        order, each head once (a replicated head from the first rank that holds it)."""
        runs, next_head = [], 0
        for rank in range(self.size):
            first, count = Shard(rank, self.size).kv_heads(num_kv_heads)
            if first == next_head:
                runs.append((rank, first, count))
                next_head = first + count
        return runs

    def local_config(self, cfg):
        """A family's text config with this rank's head and intermediate counts (vocab_size kept:
        the sampler sees every token; the embedding and head hold their runs, layers.py)."""
        check_divisible(cfg, self.size)
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.size,
                                   num_kv_heads=self.kv_heads(cfg.num_kv_heads)[1],
                                   intermediate_size=cfg.intermediate_size // self.size)

    def narrowing(self, cfg):
        """(parameter name, fused piece) -> (dim, start, length) of the checkpoint tensor this rank
        reads, None: all of it (norms, the other replicated tensors). `cfg`: the whole model's."""
        head_dim = cfg.head_dim
        q_start, q_len = self.run(cfg.num_heads * head_dim)
        kv_first, kv_count = self.kv_heads(cfg.num_kv_heads)
        inter = self.run(cfg.intermediate_size)
        vocab = self.vocab_run(cfg.vocab_size)

        def part(param: str, piece: int | None) -> tuple[int, int, int] | None:
            if param in _VOCAB:
                return (0, *vocab)
            m = _COLUMN.search(param)
            if m and m[1] == "qkv_proj":
                return (0, q_start, q_len) if piece == 0 else (0, kv_first * head_dim, kv_count * head_dim)
            if m:  # gate or up
                return (0, *inter)
            m = _ROW.search(param)
            if m:
                return (1, q_start, q_len) if m[1] == "o_proj" else (1, *inter)
            return None

        return part


def check_divisible(cfg, size: int) -> None:
    """TensorParallelError unless the heads and the MLP's rows cut into `size` equal runs."""
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {size}")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} key/value heads")
    if cfg.intermediate_size % size:
        problems.append(f"an MLP of {cfg.intermediate_size} rows")
    if problems:
        raise TensorParallelError(f"--tensor-parallel-size {size} does not divide this model's "
                                  + " or ".join(problems))
