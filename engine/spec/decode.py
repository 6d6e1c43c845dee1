"""Speculative decoding's bookkeeping on the scheduler's side (no torch).

    before schedule()  the engine's proposer sets `request.draft_token_ids` of each decode
    schedule()         `draft_room`: how much of it the step can verify (budget, limits, blocks)
    runner             scores d + 1 positions, returns the accepted prefix + one target token
    update()           `SpecDecodeStats.record`; rejected positions are not computed,
                       their blocks go back (`BlockManager.shrink`)

The counters are vLLM's (`vllm:spec_decode_*`): drafts (sequences that
verified a draft in a step), draft tokens, accepted tokens, and accepted
tokens per draft position.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epd.engine.block_manager import BlockManager
from epd.engine.request import Request
from epd.engine.scheduler_output import ScheduledRequest


def add_drafts(scheduled: list[ScheduledRequest], token_budget: int, max_model_len: int, blocks: BlockManager,
               reserved_blocks: Callable[[int], int], next_prompt_tokens: int = 0) -> int:
    """Speculative decoding's share of a step, taken after the decodes and before
    any prefill: each decode in `scheduled` (in place) takes the draft its
    request holds, as much as `draft_room` leaves, and its blocks; the drafts
    are taken off the requests. Blocks are left for what the step's prefills
    need next: `reserved_blocks(budget)`, the running prefills' next chunks
    within that budget, and the first chunk of the waiting request of
    `next_prompt_tokens` tokens (0: none may be admitted), so speculation never
    makes anyone preempt nor holds back an admission. Returns the tokens added."""
    num_added = 0
    for i, s in enumerate(scheduled):
        request = s.request
        draft, request.draft_token_ids = request.draft_token_ids, []
        if not draft or num_added == token_budget:
            continue
        budget = token_budget - num_added
        reserved = reserved_blocks(budget) + blocks.num_blocks_for(min(next_prompt_tokens, budget))
        num_draft = draft_room(request, len(draft), budget, max_model_len, blocks, reserved)
        if num_draft and blocks.allocate(request, 1 + num_draft):
            scheduled[i] = dataclasses.replace(s, num_new_tokens=1 + num_draft, draft_token_ids=tuple(draft[:num_draft]))
            num_added += num_draft
    return num_added


def draft_room(request: Request, num_draft: int, token_budget: int, max_model_len: int,
               blocks: BlockManager, num_reserved_blocks: int) -> int:
    """Draft tokens a decode of `request` may verify this step (0..num_draft):
    within the step's remaining `token_budget`, so that the accepted tokens plus
    the target's own stay within its max_tokens and `max_model_len`, and within
    the blocks it holds plus the free ones beyond `num_reserved_blocks` (what
    running prefills need next: a draft never makes anyone preempt)."""
    num_free = max(0, blocks.num_free_blocks - num_reserved_blocks)
    slots = (len(request.block_ids) + num_free) * blocks.block_size - request.num_computed_tokens - 1
    return max(0, min(num_draft, token_budget, slots,
                      request.max_tokens - request.num_output_tokens - 1,
                      max_model_len - request.num_tokens - 1))


def accept_greedy(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> list[int]:
    """Greedy verification: the target's argmax at the d + 1 positions against the
    d draft tokens -> the longest prefix of the draft the target agrees with,
    then the target's own next token (its correction, or the bonus token)."""
    assert len(target_token_ids) == len(draft_token_ids) + 1
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    return list(target_token_ids[:num_accepted + 1])


def check_verified(draft_token_ids: Sequence[int], token_ids: Sequence[int]) -> int:
    """The number of draft tokens accepted, from what the runner returned for a
    step that verified `draft_token_ids`: their accepted prefix and one token of
    the target's. ValueError when `token_ids` is not that."""
    num_accepted = len(token_ids) - 1
    if not 0 <= num_accepted <= len(draft_token_ids) \
            or list(token_ids[:num_accepted]) != list(draft_token_ids[:num_accepted]):
        raise ValueError(f"verified tokens {list(token_ids)} are not a prefix of the draft "
                         f"{list(draft_token_ids)} and one more")
    return num_accepted


@dataclass
class SpecDecodeStats:
    """Totals since the engine started."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def record(self, draft_token_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """Counts a step's verification of `draft_token_ids` (nothing without a
        draft) from the tokens the runner returned; returns the rejected count."""
        if not draft_token_ids:
            return 0
        num_accepted = check_verified(draft_token_ids, token_ids)
        self._count(len(draft_token_ids), num_accepted)
        return len(draft_token_ids) - num_accepted

    def _count(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict[str, int | list[int]]:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position)}
