"""How many tokens a prefill chunk takes: up to the image ledger's `prefill_bound`, within the
step's budget, and, for a model whose image tokens see each other both ways (its
`bidirectional_mm`), never ending inside an image span (docs/decisions/bidirectional-image-spans.md);
for a model with per-request state, ending where its state is snapshotted (block_manager.py).

Pure Python (no torch): the scheduler's rule. A decode-role scheduler has it off: it
prefills no image (its local prefills are text, and it recomputes no request with images).
"""
from __future__ import annotations

from collections.abc import Callable

from epd.engine.image_ledger import ImageLedger
from epd.engine.request import Request


class ChunkSizes:
    def __init__(self, images: ImageLedger, max_num_batched_tokens: int, whole_mm_spans: bool,
                 snapshot_cut: Callable[[Request, int, int], int] | None = None):
        """`snapshot_cut(request, start, num_new_tokens)`: a chunk ended where the state of a model
        with per-request state is snapshotted (BlockManager.snapshot_cut)."""
        self.images, self.max_num_batched_tokens, self.whole_mm_spans = images, max_num_batched_tokens, whole_mm_spans
        self.snapshot_cut = snapshot_cut

    def check(self, request: Request) -> None:
        """ValueError when the request has an image span no step could take whole."""
        longest = max((span.length for span in request.mm_spans), default=0)
        if self.whole_mm_spans and longest > self.max_num_batched_tokens:
            raise ValueError(f"an image of {longest} tokens does not fit one step's token budget "
                             f"(max_num_batched_tokens={self.max_num_batched_tokens}): this model attends an "
                             "image's tokens both ways, so a step takes an image whole")

    def size(self, request: Request, start: int, token_budget: int) -> int:
        """Tokens `request` may compute from `start` (<= 0: none now). With `whole_mm_spans` a chunk
        that would end inside a span ends at its start instead, or takes nothing when it starts there
        or inside it (a prefix-cache hit may end inside one: its KV was computed with the whole span)."""
        num_new_tokens = min(self.images.prefill_bound(request, start) - start, token_budget)
        if self.snapshot_cut is not None and num_new_tokens > 0:
            num_new_tokens = self.snapshot_cut(request, start, num_new_tokens)
        if not self.whole_mm_spans or num_new_tokens <= 0:
            return num_new_tokens
        end = start + num_new_tokens
        for span in request.mm_spans:  # sorted and disjoint: at most one holds `end`
            if span.offset < end < span.end:
                return max(span.offset - start, 0)
        return num_new_tokens
