"""Every image the engine knows, by content hash (`mm_hash`): whether its
encoder output is here or still to come, which requests in the engine use
it, and when it is freed. The one place an image's state lives inside an
engine (`ImageArrivals` keeps the requests a worker has not yet let in).

One image goes

    pending  (a request uses it; its encoder output is still to come: early prefill)
      -> here    (`arrived`, or a request brought it: the output is held)
      -> unused  (its last user left; still held, a new request may take it again)
      -> freed   (`drop_unused`, at the start of the next step: forgotten)

`EngineCore` enters a request's images (`add`) and takes the request out
when it leaves the engine (`remove`: finished, aborted, released); the
scheduler asks how far a request may be computed (`prefill_bound`) and
whether it could be computed again (`can_recompute`, before preempting it);
the model runner reads the outputs (`get`).

Pure Python (no torch): an encoder output is an opaque value here.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from epd.engine.request import Request

if TYPE_CHECKING:
    from epd.transport.mm_entry import MMEntry


class ImageLedger:
    def __init__(self) -> None:
        self._entries: dict[str, MMEntry] = {}  # here (or unused): mm_hash -> encoder output
        self._pending: set[str] = set()  # used by a request, not here yet
        self._users: dict[str, set[str]] = {}  # mm_hash -> ids of the requests in the engine using it
        self._unused: dict[str, None] = {}  # here, no user left: freed at the next `drop_unused`, in order
        self._images_of: dict[str, list[str]] = {}  # request id -> its images

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
        if request.request_id in self._images_of:
            raise ValueError(f"request {request.request_id} is already in the image ledger")
        embeddings = embeddings or {}
        self._images_of[request.request_id] = request.mm_hashes
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
            for mm_hash in self._images_of.pop(request_id, ()):
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

    # -- counts ----------------------------------------------------------------------

    @property
    def num_images(self) -> int:
        """Images held (here or unused) or pending."""
        return len(self._entries) + len(self._pending)
