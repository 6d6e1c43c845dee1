"""Requests waiting for their images, and images waiting for their requests:
what has reached an engine worker but not its engine.

A prefill (or pd, aggregated) worker admits a request to the engine once
every image of it is here: held by the engine already, in the embedding
cache, or arrived with an EncodeDone (or encoded in-process). With `early`
(early prefill, `EarlyPrefill.is_on`: engine/early_prefill.py) it admits it at once, with the images here so far
(`Admit.pending` names the others), and keeps nothing of it: the engine's
`ImageLedger` records which images it waits for, and the worker hands a
later image, a failure and the wait deadline to the engine
(`EngineCore.add_embedding`, `fail_image`, `abort_overdue`). Messages come
in any order (ZeroMQ fair-queues the API's and the encoders' pipes into one
inbox), so an image, or an image's failure, may overtake its
PrefillRequest: both are kept here, bounded, until the request arrives.

    add(request)              -> [Admit] when all its images are here (early: at once),
                                 [Failed] if one failed early
    arrived(mm_hash, entry)   -> the held requests it completes, each Admit; kept for a
                                 request still to come when none (nor the engine: `is_taken`) took it
    find(mm_hash)             -> the image, if it overtook its request or `lookup` has it
    failed(mm_hash, error)    -> the held requests waiting for it, each Failed
    expire(now_s, max_wait_s) -> the held requests waiting longer than that, each Failed

Pure Python (no torch): an image's encoder output is an opaque value here.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epd.engine.early_prefill import gave_up_error
from epd.engine.request import Request

if TYPE_CHECKING:
    from epd.transport.embedding_cache.mm_entry import MMEntry

MAX_EARLY = 256  # images (and failures) that arrived before their request, kept at most


@dataclass
class Admit:
    """Admit `request` to the engine: all its images are here (early: those here so far)."""

    request: Request
    embeddings: dict[str, MMEntry] = field(default_factory=dict)  # mm_hash -> encoder output, each image here
    pending: frozenset[str] = frozenset()  # early: its images still to come (EngineCore.add_embedding)


@dataclass
class Failed:
    """One of the request's images failed: answer it with `error`."""

    request_id: str
    error: str


Outcome = Admit | Failed


class ImageArrivals:
    def __init__(self, lookup: Callable[[str], MMEntry | None], max_early: int = MAX_EARLY,
                 early: bool = False):
        """`lookup(mm_hash)`: the image's encoder output if the engine or the
        embedding cache has it, else None. `early`: admit requests before
        their images are all here."""
        self.lookup = lookup
        self.max_early = max_early
        self.early = early
        self._pending: dict[str, tuple[Request, set[str]]] = {}  # held: request id -> (request, missing mm_hashes)
        self._staged: dict[str, MMEntry] = {}  # images of held requests, here
        self._early: OrderedDict[str, MMEntry] = OrderedDict()  # images no request waited for yet
        self._early_failures: OrderedDict[str, str] = OrderedDict()  # request id -> error, before the request
        self._since_s: dict[str, float] = {}  # request id -> when it started waiting (the caller's clock)

    @property
    def num_pending(self) -> int:
        """Requests held here, not yet admitted to the engine."""
        return len(self._pending)

    @property
    def num_early(self) -> int:
        """Images and failures kept for requests still to come."""
        return len(self._early) + len(self._early_failures)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    # -- events ------------------------------------------------------------------

    def add(self, request: Request, now_s: float = 0.0) -> list[Outcome]:
        """A request arrived (at `now_s`). Held until its last image is here
        (early: admitted at once, nothing kept), unless one already failed (it
        is then not kept)."""
        error = self._early_failures.pop(request.request_id, None)
        if error is not None:
            return [Failed(request.request_id, error)]
        missing = set()
        for mm_hash in request.mm_hashes:
            if mm_hash in self._staged:
                continue
            entry = self.find(mm_hash)
            if entry is None:
                missing.add(mm_hash)
            else:
                self._staged[mm_hash] = entry
        if missing and not self.early:
            self._pending[request.request_id] = (request, missing)
            self._since_s[request.request_id] = now_s
            return []
        return [self._admit(request, missing)]  # early: the engine waits for the missing ones

    def arrived(self, mm_hash: str, entry: MMEntry, is_taken: bool = False, keep: bool = True) -> list[Admit]:
        """An image is here. `is_taken`: the engine took it (requests in it
        waited for it: `EngineCore.add_embedding`). Kept for a request still
        to come when no held request waits for it and the engine did not take it,
        unless not `keep` (its request ended here: none will come for it)."""
        waiting = self._waiting_for(mm_hash)
        if not waiting and not is_taken:
            if keep:
                self._remember(self._early, mm_hash, entry)
            return []
        self._early.pop(mm_hash, None)
        outcomes = []
        for request_id in waiting:
            missing = self._pending[request_id][1]
            missing.discard(mm_hash)
            self._staged[mm_hash] = entry
            if not missing:
                outcomes.append(self._take(request_id))
        return outcomes

    def find(self, mm_hash: str) -> MMEntry | None:
        """The image's encoder output if it overtook its request (taken: not
        kept twice) or `lookup` has it (the engine, the embedding cache)."""
        entry = self._early.pop(mm_hash, None)
        return entry if entry is not None else self.lookup(mm_hash)

    def failed(self, mm_hash: str, error: str, request_id: str | None = None) -> list[Failed]:
        """An image could not be encoded: every held request waiting for it
        fails. `request_id`, the request the encode was for, is remembered
        when it is not held (its EncodeDone overtook it); the caller passes
        None when the request is in the engine already."""
        waiting = self._waiting_for(mm_hash)
        for rid in waiting:
            self._drop(rid)
        if request_id is not None and request_id not in waiting:
            self._remember(self._early_failures, request_id, error)
        return [Failed(rid, error) for rid in waiting]

    def expire(self, now_s: float, max_wait_s: float) -> list[Failed]:
        """Gives up on held requests that waited more than `max_wait_s` for an
        image (its encoder died, or the API that would abort it did)."""
        late = [rid for rid, since in self._since_s.items() if now_s - since > max_wait_s]
        for rid in late:
            self._drop(rid)
        return [Failed(rid, gave_up_error(max_wait_s)) for rid in late]

    def remove(self, request_id: str) -> bool:
        """Forgets a held request (aborted); False if it was not held."""
        if request_id not in self._pending:
            return False
        self._drop(request_id)
        return True

    # -- internals ---------------------------------------------------------------

    def _waiting_for(self, mm_hash: str) -> list[str]:
        return [rid for rid, (_, missing) in self._pending.items() if mm_hash in missing]

    def _take(self, request_id: str) -> Admit:
        """Admits a held request, all its images here."""
        request, missing = self._pending.pop(request_id)
        self._since_s.pop(request_id, None)
        assert not missing, f"request {request_id} still misses images {missing}"
        return self._admit(request, missing)

    def _admit(self, request: Request, missing: set[str]) -> Admit:
        """`request` with its images here; the engine waits for `missing` (early prefill)."""
        embeddings = {h: self._staged[h] for h in request.mm_hashes if h not in missing}
        self._unstage(request.mm_hashes)
        return Admit(request, embeddings, frozenset(missing))

    def _drop(self, request_id: str) -> None:
        request, _ = self._pending.pop(request_id)
        self._since_s.pop(request_id, None)
        self._unstage(request.mm_hashes)

    def _unstage(self, mm_hashes: list[str]) -> None:
        """Drops staged images no held request needs."""
        still_needed = {h for request, _ in self._pending.values() for h in request.mm_hashes}
        for mm_hash in mm_hashes:
            if mm_hash not in still_needed:
                self._staged.pop(mm_hash, None)

    def _remember(self, bounded: OrderedDict, key: str, value) -> None:
        """Keeps `value` under `key`, forgetting the oldest entries past `max_early`."""
        bounded[key] = value
        while len(bounded) > self.max_early:
            bounded.popitem(last=False)
