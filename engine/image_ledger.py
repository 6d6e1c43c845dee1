"""Every image the engine knows, by content hash (`mm_hash`): whether its
encoder output is here or still to come, which requests in the engine use
it, which of those wait for it, and when it is freed. The one place an
image's state lives inside an engine (`ImageArrivals` keeps only what has
not reached the engine: requests a worker has not let in yet, images and
failures that overtook their request).

One image goes

    pending  (a request uses it; its encoder output is still to come: early prefill)
      -> here    (`arrived`, or a request brought it: the output is held)
      -> unused  (its last user left; still held, a new request may take it again)
      -> freed   (`drop_unused`, at the start of the next step: forgotten)

`EngineCore` enters a request's images (`add`) and takes the request out
when it leaves the engine (`remove`: finished, aborted, released); the
scheduler asks how far a request may be computed (`prefill_bound`) and
whether it could be computed again (`can_recompute`, before preempting it);
the model runner reads the outputs (`get`). With early prefill a request
enters before its images; which requests still wait for a pending image
(`waiting_for`: to fail them when it fails) and which waited too long
(`overdue`) are asked here too, so the engine's worker keeps no copy.

A request *waits for* a pending image while it has not been computed past
one of that image's placeholders: it cannot finish without it. A request
whose prefix-cache hit covered the image does not wait for it (and samples
without it); one preempted after that waits again.

Pure Python (no torch): an encoder output is an opaque value here.
"""
from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from epd.engine.request import Request

if TYPE_CHECKING:
    from epd.transport.embedding_cache.mm_entry import MMEntry


class ImageLedger:
    def __init__(self) -> None:
        self._entries: dict[str, MMEntry] = {}  # here (or unused): mm_hash -> encoder output
        self._pending: set[str] = set()  # used by a request, not here yet
        self._users: dict[str, set[str]] = {}  # mm_hash -> ids of the requests in the engine using it
        self._unused: dict[str, None] = {}  # here, no user left: freed at the next `drop_unused`, in order
        self._requests: dict[str, Request] = {}  # request id -> the request, in the order they entered

    # -- a request enters and leaves -----------------------------------------------

    def missing(self, request: Request, embeddings: dict[str, MMEntry] | None = None,
                pending: Iterable[str] = ()) -> list[str]:
        """Its images that are neither here, nor in `embeddings`, nor in `pending`."""
        embeddings, pending = embeddings or {}, set(pending)
        return [h for h in request.mm_hashes if h not in self._entries and h not in embeddings
                and h not in pending]

    def add(self, request: Request, embeddings: dict[str, MMEntry] | None = None,
            pending: Iterable[str] = ()) -> None:
        """`request` enters the engine and uses its images: each held already,
        in `embeddings` (held from now on), or in `pending` (it comes later,
        through `arrived`). ValueError if an image is none of these or the
        request is here already; nothing changes then."""
        missing = self.missing(request, embeddings, pending)
        if missing:
            raise ValueError(f"request {request.request_id}: no embeddings for images {missing}")
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already in the image ledger")
        embeddings = embeddings or {}
        self._requests[request.request_id] = request
        for mm_hash in request.mm_hashes:
            self._users.setdefault(mm_hash, set()).add(request.request_id)
            self._unused.pop(mm_hash, None)  # taken again before it was dropped
            if mm_hash in self._entries or mm_hash in self._pending:
                continue
            if mm_hash in embeddings:
                self._entries[mm_hash] = embeddings[mm_hash]
            else:
                self._pending.add(mm_hash)

    def remove(self, request_ids: Iterable[str]) -> None:
        """The requests left the engine. An image no request uses any more is
        unused (dropped by the next `drop_unused`) or, still pending, forgotten
        (a late `arrived` then keeps nothing). Unknown ids are ignored."""
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            for mm_hash in () if request is None else request.mm_hashes:
                users = self._users[mm_hash]
                users.discard(request_id)
                if users:
                    continue
                del self._users[mm_hash]
                if mm_hash in self._pending:
                    self._pending.discard(mm_hash)
                else:
                    self._unused[mm_hash] = None

    def drop_unused(self) -> list[str]:
        """Frees the images whose last user left since the last call, and
        returns them in the order they became unused."""
        freed, self._unused = list(self._unused), {}
        for mm_hash in freed:
            del self._entries[mm_hash]
        return freed

    # -- images arrive ---------------------------------------------------------------

    def arrived(self, mm_hash: str, entry: MMEntry) -> bool:
        """A pending image is here: its requests may be computed past it.
        False, keeping nothing, when it is not pending (no request in the
        engine waits for it)."""
        if mm_hash not in self._pending:
            return False
        self._pending.discard(mm_hash)
        self._entries[mm_hash] = entry
        return True

    def get(self, mm_hash: str) -> MMEntry | None:
        """Its encoder output while the engine holds it (a request uses it,
        or the step that drops it has not started)."""
        return self._entries.get(mm_hash)

    # -- what the scheduler asks ---------------------------------------------------------

    def prefill_bound(self, request: Request, start: int | None = None) -> int:
        """How far `request` may be computed now: the first placeholder, at
        or after `start` (default: its computed tokens), of an image still
        pending; else all its tokens."""
        if not self._pending:
            return request.num_tokens
        start = request.num_computed_tokens if start is None else start
        for span in request.mm_spans:  # in prompt order
            if span.mm_hash in self._pending and span.end > start:
                return max(span.offset, start)
        return request.num_tokens

    def can_recompute(self, request: Request) -> bool:
        """Whether its prompt could be computed again here, were its KV
        dropped: every image of it is here or pending. A request prefilled on
        another worker (decode role) arrives without its images: False."""
        return all(h in self._entries or h in self._pending for h in request.mm_hashes)

    # -- what the engine's worker asks (early prefill) ----------------------------------

    def waiting_for(self, mm_hash: str) -> list[str]:
        """The requests that wait for the pending image `mm_hash`, in the
        order they entered: when it fails, these cannot be finished."""
        if mm_hash not in self._pending:
            return []
        return [rid for rid, request in self._requests.items() if self._waits(request, (mm_hash,))]

    def overdue(self, now_s: float, max_wait_s: float) -> list[str]:
        """The requests that wait for a pending image and arrived
        (`Request.arrival_time`, on `now_s`'s clock) more than `max_wait_s`
        before `now_s`, in the order they entered."""
        if not self._pending:
            return []
        return [rid for rid, request in self._requests.items()
                if now_s - request.arrival_time > max_wait_s and self._waits(request, self._pending)]

    def _waits(self, request: Request, pending: Container[str]) -> bool:
        """Whether a placeholder of an image in `pending` is not computed yet."""
        return any(span.mm_hash in pending and span.end > request.num_computed_tokens for span in request.mm_spans)

    # -- counts ----------------------------------------------------------------------

    @property
    def num_images(self) -> int:
        """Images held (here or unused) or pending."""
        return len(self._entries) + len(self._pending)
