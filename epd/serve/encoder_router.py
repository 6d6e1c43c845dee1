"""Choosing the encoder for each image or video of a request (`--encoder-router`).

round_robin  images to the encoders in turn.
cost         (default) by predicted finish time, from the work each encoder
             holds, the image's own cost and where it was encoded before.

The cost model, in vision patches (an image's patch count comes from its
header size through ImageGeometry, in the orchestrator's prepare step; a
video's is its plan's t x h x w, every temporal group's patches: frames x
patches, each patch covering `temporal_patch_size` frames):

    backlog(e) = patches queued in e at its last WorkerStats
               + patches sent to e that it had not yet received then
    cost(i, e) = 0 if e encoded image i last (`holder`), else patches(i)
    finish(i, e) = backlog(e) + planned(e) + cost(i, e)

ViT time grows with patches (its MLPs linearly, attention faster for big
images), and every encoder is taken to run at the same speed. A request's
images are placed largest first, each on the encoder where it would finish
earliest (LPT scheduling), so its last image finishes as early as the
backlogs allow; ties go to the encoders in turn.

Work sent between two reports is counted here: each encoder reports the
EncodeRequests it has received (`num_requests_received`), and the patches of
those sent after that count are added to its backlog, so a burst is spread
rather than all sent to the encoder that looked idle. A repeat sent to its
holder adds nothing (it is a cache read), so repeats that outrun the
holder's reports do not push the image away from its cache.

Locality: where caches are per host, the API cannot see an encoder's cache,
so the router remembers which encoder last took each mm_hash (bounded LRU).
That encoder answers a repeat from its cache, which costs it next to nothing:
it is chosen unless its backlog exceeds another's by more than the image's
own cost. With one shared cache the API finds a hit itself and sends nothing;
a repeat in flight still goes where its first copy is queued, and the
encoder skips it once the first is cached.

Tower adapters (--enable-tower-lora): for a request whose images run an
adapter's tower, either policy chooses among router.prefer_adapter's encoders
(those whose latest WorkerStats.lora.resident holds it, when their load is
within the engine routers' slack of the least loaded's; else all), plus the
encoder that last took each of its images (a repeat there is a cache read,
cheaper than any slot).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epd.serve.router import prefer_adapter

if TYPE_CHECKING:
    from epd.serve.registry import WorkerInfo

MAX_REMEMBERED_IMAGES = 65536  # mm_hash -> encoder entries kept for locality


@dataclass
class _Sent:
    """What the router sent one encoder (since its last `Ready`)."""

    num_sent: int = 0  # EncodeRequests
    unreceived: deque = field(default_factory=deque)  # patches of the most recent sends, oldest first

    def in_flight(self, num_received: int) -> int:
        """Patches of the requests sent that the encoder had not received at its report."""
        while self.unreceived and self.num_sent - len(self.unreceived) < num_received:
            self.unreceived.popleft()
        return sum(self.unreceived)


class EncoderRouter:
    def __init__(self, policy: str = "cost", max_remembered: int = MAX_REMEMBERED_IMAGES):
        if policy not in ENCODER_ROUTERS:
            raise ValueError(f"unknown encoder router {policy!r}")
        self.policy = policy
        self.max_remembered = max_remembered
        self._turn = itertools.count()
        self._sent: dict[str, _Sent] = {}
        self._holder: OrderedDict[str, str] = OrderedDict()  # mm_hash -> worker id that took it last

    def assign(self, encoders: list[WorkerInfo], images: list[tuple[str, int]],
               lora_name: str | None = None) -> list[WorkerInfo]:
        """One encoder per image (`(mm_hash, num_patches)`), in the images' order; `lora_name`:
        the tower adapter they run (None: the base tower).
        The caller reports each EncodeRequest it sends with `on_sent`."""
        encoders = self._candidates(encoders, images, lora_name)
        if self.policy == "round_robin":
            return [encoders[next(self._turn) % len(encoders)] for _ in images]
        return self._by_cost(encoders, images)

    def _candidates(self, encoders: list[WorkerInfo], images: list[tuple[str, int]],
                    lora_name: str | None) -> list[WorkerInfo]:
        """The encoders holding the tower adapter when their load is close, and the images' holders; else all."""
        warm = {e.worker_id for e in prefer_adapter(encoders, lora_name)}
        if len(warm) == len(encoders):
            return encoders
        holders = {self._holder.get(key) for key, _ in images}
        return [e for e in encoders if e.worker_id in warm or e.worker_id in holders]

    def on_sent(self, encoder: WorkerInfo, mm_hash: str, num_patches: int) -> None:
        """An EncodeRequest left for `encoder`: part of its backlog until it reports receiving it."""
        sent = self._sent.setdefault(encoder.worker_id, _Sent())
        sent.num_sent += 1
        repeat = self._holder.get(mm_hash) == encoder.worker_id  # answered from its cache: next to no work
        sent.unreceived.append(0 if repeat else num_patches)
        self._holder[mm_hash] = encoder.worker_id
        self._holder.move_to_end(mm_hash)
        if len(self._holder) > self.max_remembered:
            self._holder.popitem(last=False)

    def _by_cost(self, encoders: list[WorkerInfo], images: list[tuple[str, int]]) -> list[WorkerInfo]:
        start = next(self._turn)
        order = [encoders[(start + k) % len(encoders)] for k in range(len(encoders))]  # ties in turn
        finish = {e.worker_id: self.backlog(e) for e in order}
        chosen: dict[int, WorkerInfo] = {}
        for i in sorted(range(len(images)), key=lambda i: -images[i][1]):  # largest first (stable)
            key, patches = images[i]
            holder = self._holder.get(key)
            # the holder wins ties: it is left only when its backlog exceeds another's by more than the cost
            best = min(order, key=lambda e: (finish[e.worker_id] + (0 if e.worker_id == holder else patches),
                                             e.worker_id != holder))
            finish[best.worker_id] += 0 if best.worker_id == holder else patches
            chosen[i] = best
        return [chosen[i] for i in range(len(images))]

    def backlog(self, encoder: WorkerInfo) -> int:
        """Patches queued in `encoder` or on their way to it, as far as we know."""
        counters = encoder.stats.encoder if encoder.stats is not None else None
        queued, received = (0, 0) if counters is None else (counters.num_queued_patches,
                                                            counters.num_requests_received)
        sent = self._sent.get(encoder.worker_id)
        return queued + (sent.in_flight(received) if sent is not None else 0)

    def on_ready(self, worker_id: str) -> None:
        """A (re)started encoder: empty queue, counters from zero, empty cache if it had its own."""
        self._sent.pop(worker_id, None)
        for key in [k for k, wid in self._holder.items() if wid == worker_id]:
            del self._holder[key]


ENCODER_ROUTERS = ("cost", "round_robin")
