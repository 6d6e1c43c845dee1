"""CUDA graphs of the language model's forward for decode-only steps (vLLM's "piecewise off, full decode").

On a GPU a decode step of a small model is host-bound: every layer launches
its kernels from Python (~13 ms a step for 14 layers on an H200, whatever the
batch). `DecodeGraphs` captures the forward once per batch size at start-up
and replays it: one launch for the whole step.

A graph replays fixed addresses and fixed launch shapes, so the forward
reads static buffers sized for the largest graph: token ids, positions
(as many rows as the model's `position_dims`), slots, context lengths and block tables as wide as
`max_model_len` needs. A step of n decodes uses the smallest captured size
b >= n: its rows are copied in, rows n..b are padding (slot -1: nothing
stored; context length 1: they read block 0 and their outputs are dropped).
The decode kernel's split count is fixed per size (it depends on the
table's width, never on the step), so the launch never changes.

Steps a graph does not take run eagerly: prefill chunks, speculative
verifications (several query tokens), image rows, bidirectional ranges,
LoRA adapters, and more sequences than the largest size. A layer's sliding
window and soft-cap are constants of its kernel launches (runtime arguments,
no per-step metadata), so they replay as captured. Greedy output equals eager's token for
token in float32 (tests/unit/engine/test_cuda_graphs.py, `pytest -m gpu`).
"""
from __future__ import annotations

import time

import torch

from epd.engine.attention.metadata import AttentionMetadata

MAX_CAPTURE_SIZE = 512  # vLLM's default cap on the sizes captured


def capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> list[int]:
    """vLLM's default sizes: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256,
    up to `max_capture_size` (default min(2 x max_num_seqs, 512)) and never past
    `max_num_seqs` (a decode step holds at most that many), which is captured too."""
    cap = min(2 * max_num_seqs, MAX_CAPTURE_SIZE) if max_capture_size is None else max_capture_size
    if cap < 1:
        return []
    cap = min(cap, max_num_seqs)
    sizes = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)] if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


class DecodeGraphs:
    """One captured forward per batch size; `run` replays the smallest that fits."""

    def __init__(self, forward, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 position_dims: int):
        """`forward(input_ids [n], positions [position_dims, n], meta) -> hidden [n, hidden]`: the
        model's decode forward on the given metadata (the runner's, with its KV cache and backend)."""
        self._forward = forward
        self.position_dims = position_dims  # the model's (engine/models/positions.py)
        self.block_size = block_size
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, hidden out)
        self.sizes: list[int] = []
        self.num_replays = 0  # steps a graph ran (the rest ran eagerly)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def capture(self, sizes: list[int]) -> float:
        """Captures a graph for each size, largest first (the others reuse its memory
        pool); returns the seconds it took. Raises what capture raises (an op
        that syncs with the host, say): the caller runs eagerly then."""
        started = time.perf_counter()
        n = max(sizes)
        long = dict(dtype=torch.long, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._input_ids = torch.zeros(n, **long)
        self._positions = torch.zeros(self.position_dims, n, **long)
        self._slots = torch.full((n,), -1, **long)
        self._seq_lens = torch.ones(n, **i32)
        self._cu_seqlens = torch.arange(n + 1, **i32)
        self._tables = torch.zeros(n, self.max_blocks_per_seq, **i32)
        pool = None
        stream = torch.cuda.Stream(self.device)
        for size in sorted(sizes, reverse=True):
            meta = self._meta(size)
            with torch.cuda.stream(stream):  # once eagerly first: kernels compiled, cuBLAS set up
                self._forward(self._input_ids[:size], self._positions[:, :size], meta)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                hidden = self._forward(self._input_ids[:size], self._positions[:, :size], meta)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        self.sizes = sorted(sizes)
        return time.perf_counter() - started

    def _meta(self, size: int) -> AttentionMetadata:
        """The static buffers' first `size` rows as one decode step's metadata."""
        return AttentionMetadata(slot_mapping=self._slots[:size], cu_seqlens_q=self._cu_seqlens[:size + 1],
                                 seq_lens=self._seq_lens[:size], block_tables=self._tables[:size],
                                 max_seqlen_q=1, max_seqlen_k=self.max_blocks_per_seq * self.block_size,
                                 is_decode_only=True)

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a graph can run this step: decodes only, at most the largest size,
        block tables no wider than the static one, no query in a bidirectional range."""
        return (meta.is_decode_only and meta.query_key_ends is None and 0 < meta.num_seqs <= self.max_size
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [n, hidden] of a decode step (`fits(meta)`), replayed from the smallest
        graph that holds n rows. The result is the graph's own buffer: read it before
        the next `run`."""
        n = meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        graph, hidden = self._graphs[size]
        self._input_ids[:n].copy_(input_ids)
        self._positions[:, :n].copy_(positions)
        self._slots[:n].copy_(meta.slot_mapping)
        self._seq_lens[:n].copy_(meta.seq_lens)
        self._tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:  # padding rows: store nothing, read one key (block ids left there are valid ones)
            self._slots[n:size].fill_(-1)
            self._seq_lens[n:size].fill_(1)
        graph.replay()
        self.num_replays += 1
        return hidden[:n]
