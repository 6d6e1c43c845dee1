"""How many tokens a prefill chunk takes: up to the image ledger's `prefill_bound`, within the
step's budget, and, for a model whose image tokens see each other both ways (its
`bidirectional_mm`), never ending inside an image span (docs/decisions/bidirectional-image-spans.md).

Pure Python (no torch): the scheduler's rule. A decode-role scheduler has it off: it
prefills no image (its local prefills are text, and it recomputes no request with images).
"""
from __future__ import annotations

from epd.engine.image_ledger import ImageLedger
from epd.engine.request import Request


class ChunkSizes:
    def __init__(self, images: ImageLedger, max_num_batched_tokens: int, whole_mm_spans: bool):
        self.images, self.max_num_batched_tokens, self.whole_mm_spans = images, max_num_batched_tokens, whole_mm_spans

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
        if not self.whole_mm_spans or num_new_tokens <= 0:
            return num_new_tokens
        end = start + num_new_tokens
        for span in request.mm_spans:  # sorted and disjoint: at most one holds `end`
            if span.offset < end < span.end:
                return max(span.offset - start, 0)
        return num_new_tokens
