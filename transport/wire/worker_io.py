"""What every worker process holds and does the same way: its inbox (bound),
its outbox, the LMDB embedding cache when it shares one, the `Ready` that
registers it with the API, and closing all three.

With several API processes (`epd serve --api-servers N`) `spec.apis` names
all N collectors, by API index; a worker registers with and reports its load
to each (`publish`), and sends a request's TokenOutputs to the collector its
PrefillRequest named (`api_index`). Every worker re-sends `Ready` every
`REANNOUNCE_S`: a restarted API process learns it, and an API that took it
for dead (silent past the heartbeat timeout on a slow link) takes it back.

Each worker process draws a `session` token at start (128 random bits, sent
only over the worker plane) and puts it in its Ready, WorkerStats and Alive:
the API's registry lets a worker id held by a live worker be taken over, and
believes stats about it, only with the same session (epd/serve/registry.py).

A worker sends nothing from its loop during a long ViT batch or prefill step;
its `Heartbeat` thread, with its own sockets (ZeroMQ sockets are not
thread-safe), then says `Alive` to every API process, so that an API which
judges it by silence (an `epd worker` elsewhere, a Ray actor) does not take
busy for dead. An encoder's loop also says which requests it is encoding
(`say_working_on`): the API's suspects if it dies."""
from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass

from epd.transport.wire.auth import WORKER, PlaneKeys
from epd.transport.wire.frame_limits import DEFAULT_MAX_IMAGE_BYTES
from epd.transport.wire.channels import Outbox, Receiver
from epd.transport.wire.messages import Alive, Ready, WorkerStats
from epd.transport.embedding_cache.mm_cache import MMCache
from epd.transport.wire.roles import Role


@dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is and where it talks: the part every worker has."""

    worker_id: str
    role: Role
    inbox: str  # address this worker binds
    apis: tuple[str, ...]  # every API process's collector address, by API index (one without --api-servers)
    mm_cache_dir: str | None  # None: no embedding cache on this worker
    mm_cache_bytes: int
    stats_interval_s: float = 0.25
    keys_dir: str | None = None  # worker-plane keys (`epd keys`): CURVE on tcp sockets; None on one host
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # the largest image or video an EncodeRequest carries (inbox cap)
    # an engine worker tells every API process its prefix cache's changes (KVBlocks): --router cache_aware
    reports_kv_blocks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))  # a role's name is accepted too
        if isinstance(self.apis, str) or not self.apis:
            raise TypeError(f"WorkerSpec.apis is a non-empty tuple of collector addresses, got {self.apis!r}")
        object.__setattr__(self, "apis", tuple(self.apis))


REANNOUNCE_S = 1.0  # how often Ready is sent again (a restarted API process learns us)
# While the loop has sent nothing for this long, the heartbeat thread says Alive this often:
# far below the API's heartbeat timeout (10 s; EPD_HEARTBEAT_TIMEOUT_S), so a late beat or two is harmless.
HEARTBEAT_INTERVAL_S = 0.5


class Heartbeat:
    """A thread that sends `Alive(worker_id, busy_s)` to every API collector
    each `interval_s` while the worker's loop has not published for that long.
    It opens its own Outbox (CURVE with the worker's keys) inside the thread."""

    def __init__(self, worker_id: str, apis: tuple[str, ...], keys: PlaneKeys | None,
                 interval_s: float = HEARTBEAT_INTERVAL_S, session: str = ""):
        self.worker_id = worker_id
        self.session = session
        self.apis = apis
        self.keys = keys
        self.interval_s = interval_s
        self.last_published_s = time.monotonic()  # written by the loop, read here: a float, no lock needed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-heartbeat", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self.last_published_s = time.monotonic()
            self._thread.start()

    def published(self) -> None:
        """The loop just sent WorkerStats: it is not busy."""
        self.last_published_s = time.monotonic()

    def _run(self) -> None:
        outbox = Outbox(keys=self.keys, api_address=self.apis)
        try:
            while not self._stop.wait(self.interval_s):
                busy_s = time.monotonic() - self.last_published_s
                if busy_s >= self.interval_s:
                    for api in self.apis:
                        outbox.send(api, Alive(self.worker_id, busy_s, self.session))
        finally:
            outbox.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1.0)


class WorkerIO:
    """Base of the encoder and engine workers."""

    def __init__(self, spec: WorkerSpec, model_fingerprint: str, max_frame_bytes: int | None = None):
        """`max_frame_bytes`: the largest frame its inbox takes (transport/wire/frame_limits.py)."""
        self.spec = spec
        keys = PlaneKeys.load(spec.keys_dir, WORKER) if spec.keys_dir else None
        self.inbox = Receiver(spec.inbox, keys=keys, max_frame_bytes=max_frame_bytes)
        self.apis = spec.apis
        self.outbox = Outbox(keys=keys, api_address=self.apis)
        self.session = secrets.token_hex(16)  # this process's; a restarted worker draws a new one
        self.heartbeat = Heartbeat(spec.worker_id, self.apis, keys, session=self.session)
        cache = (MMCache(spec.mm_cache_dir, spec.mm_cache_bytes, model_fingerprint=model_fingerprint)
                 if spec.mm_cache_dir else None)
        # a cache that could not be opened, nor replaced by a fresh one (mm_cache_env.py): none,
        # and Ready says so, so that no encoder leaves this worker's images in a cache it cannot read
        self.cache = cache if cache is not None and cache.is_open else None
        self._announced_s = 0.0

    def announce(self) -> None:
        """Registers with every API process: where to reach this worker and which cache it reads."""
        self._announced_s = time.monotonic()
        ready = Ready(self.spec.worker_id, self.spec.role, self.inbox.address, socket.gethostname(),
                      self.spec.mm_cache_dir if self.cache is not None else None, self.session)
        for api in self.apis:
            self.outbox.send(api, ready)
        self.heartbeat.start()

    def publish(self, stats: WorkerStats) -> None:
        """WorkerStats (built with `self.session`) to every API process (each routes on its own registry)."""
        for api in self.apis:
            self.outbox.send(api, stats)
        self.heartbeat.published()
        if time.monotonic() - self._announced_s > REANNOUNCE_S:
            self.announce()

    def say_working_on(self, request_ids: list[str]) -> None:
        """Tells every API process which requests' items the loop works on now (an
        encoder, as a batch starts; [] as it ends): if the process dies meanwhile,
        those requests are the suspects of its death. From the loop's own outbox,
        so the API reads it in order with the loop's stats."""
        alive = Alive(self.spec.worker_id, 0.0, self.session, list(request_ids))
        for api in self.apis:
            self.outbox.send(api, alive)

    def close(self) -> None:
        self.heartbeat.stop()
        if self.cache is not None:
            self.cache.close()
        self.inbox.close()
        self.outbox.close()
