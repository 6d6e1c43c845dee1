"""What one scheduler step hands to the model runner, and what `update` returns.

Pure Python (no torch).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epd.engine.request import Request
from epd.engine.state_snapshots import SnapshotPlan
from epd.transport.wire.mm_span import MMSpan


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens).

    `start` is `request.num_computed_tokens` at schedule time; the runner
    computes KV for `token_ids` (`request.all_token_ids[start:]`, then the
    draft) at positions start.., writing into `request.block_ids` (block i
    holds positions [i * block_size, (i + 1) * block_size)).

    `is_last_chunk` is True when the chunk ends at `request.num_tokens` (plus
    its draft): the runner must sample for this request and pass the tokens
    to `Scheduler.update`. Without a draft that is exactly one token, from the
    logits of its last new position. A mid-prompt chunk of a chunked prefill
    samples nothing.

    `draft_token_ids` (speculative decoding, a decode only): d proposed tokens
    run after the request's last token, so the step scores d + 1 positions;
    the runner returns the accepted prefix of the draft plus one token of the
    target's (1..d + 1 tokens), and `update` counts only those as computed.
    """

    request: Request
    start: int
    num_new_tokens: int
    is_last_chunk: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def token_ids(self) -> list[int]:
        """Token ids to run this step, `num_new_tokens` of them (the draft last)."""
        if self.draft_token_ids:
            return self.request.all_token_ids[self.start:] + list(self.draft_token_ids)
        return self.request.all_token_ids[self.start:self.end]

    def sampled(self, sampled_token_ids: Mapping[str, int | Sequence[int]]) -> list[int]:
        """This chunk's tokens in the runner's output: [] unless it is a last chunk;
        ValueError when a last chunk has none."""
        if not self.is_last_chunk:
            return []
        if self.request_id not in sampled_token_ids:
            raise ValueError(f"no sampled token for request {self.request_id}, whose chunk ends at its last token")
        token_ids = sampled_token_ids[self.request_id]
        return [token_ids] if isinstance(token_ids, int) else list(token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Positions whose logits are sampled: the draft's and the last token's, or none."""
        return len(self.draft_token_ids) + 1 if self.is_last_chunk else 0

    def mm_slices(self) -> list[tuple[MMSpan, int, int]]:
        """Image spans overlapping this chunk, as (span, first, last + 1).

        `first`/`last + 1` index the span's placeholder tokens (0..span.length),
        i.e. the rows of that image's embeddings this chunk needs, from the
        span's `first_row` on. A chunk may start or end in the middle of an image.
        """
        return [(span, max(span.offset, self.start) - span.offset,
                 min(span.end, self.end) - span.offset)
                for span in self.request.mm_spans
                if span.offset < self.end and span.end > self.start]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the requests to run and how many tokens each.

    `preempted_request_ids` lost their KV this step (they will be recomputed
    from scratch); `finished_request_ids` finished, were aborted or released
    since the previous step. Runners that keep per-request state drop it for
    both. `dropped_request_ids` (also finished) were aborted by this step:
    they held blocks, needed one more and could not be recomputed here
    (`Scheduler._drop_stalled`); the caller answers them with an error.
    `snapshots` (a model with per-request state, prefix caching on) names the
    scheduled requests whose state slot starts from, or is copied into, a
    state snapshot (engine/state_snapshots.py).
    """

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    dropped_request_ids: list[str] = field(default_factory=list)
    snapshots: SnapshotPlan = field(default_factory=SnapshotPlan)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling_request_ids(self) -> list[str]:
        """Requests the runner must sample for, in batch order."""
        return [s.request_id for s in self.scheduled if s.is_last_chunk]


@dataclass(frozen=True)
class RequestUpdate:
    """What `Scheduler.update` reports for one request that sampled.

    `finish_reason` is "stop" (EOS or a stop token), "length" (max_tokens or
    model length) or None. `is_prefilled` (prefill-only role) means the
    prompt is done and the first token sampled: the request left the running
    queue but still holds its blocks until `Scheduler.release`.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    is_prefilled: bool = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
