"""A request as the engine sees it: token ids, image spans, progress, blocks.

Pure Python (no torch): the scheduler and block manager work on these.
`MMSpan` is transport's (the API builds spans, the wire carries them).
"""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.mm_span import MMSpan  # the one span type, shared with the wire
from epd.transport.wire.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    mm_spans: list[MMSpan] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # Which weights of that adapter this worker runs it with: the digest of the adapter's files as
    # the worker read them (LoRAManager.weights_of), set when it is admitted; None until then;
    # "" when they hold no language-model weight (a tower-only adapter: the base language model).
    lora_weights: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding: tokens proposed to follow `all_token_ids`, verified by the
    # next step that decodes it (never part of its tokens until accepted).
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def lora_key(self) -> tuple[str, str, str | None] | None:
        """Its adapter's identity in slots and the prefix cache: (name, path, lora_weights),
        so an adapter retrained in place is another one; None for the base model and for an
        adapter without language-model weights (a tower-only one: its effect is in the image
        embeddings, keyed apart by their `mm_hash`; no slot, the base's KV)."""
        if self.lora_request is None or self.lora_weights == "":
            return None
        return (*self.lora_request.key, self.lora_weights)

    @property
    def mm_hashes(self) -> list[str]:
        """Its distinct images, in prompt order."""
        return list(dict.fromkeys(s.mm_hash for s in self.mm_spans))

    def stop_status(self, max_model_len: int) -> RequestStatus | None:
        """How its last sampled token ends it, if it does: EOS (unless
        `ignore_eos`) or a `stop_token_ids` token once `min_tokens` are out
        -> FINISHED_STOPPED; `max_tokens` out or `max_model_len` reached ->
        FINISHED_LENGTH."""
        params = self.sampling_params
        token_id = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def append_tokens(self, token_ids: Sequence[int], max_model_len: int) -> tuple[RequestStatus | None, list[int]]:
        """Appends sampled tokens one by one until one ends the request (`stop_status`);
        returns that status (None: it goes on) and the tokens appended (those after
        a stop, from a verified draft, are dropped)."""
        for i, token_id in enumerate(token_ids):
            self.output_token_ids.append(token_id)
            status = self.stop_status(max_model_len)
            if status is not None:
                return status, list(token_ids[:i + 1])
        return None, list(token_ids)

    @property
    def max_tokens(self) -> int:
        """Output tokens allowed, bounded by the model length when known."""
        limit = self.sampling_params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - self.num_prompt_tokens
            limit = room if limit is None else min(limit, room)
        assert limit is not None, "max_tokens=None needs max_model_len"
        return limit
