"""What every worker process holds and does the same way: its inbox (bound),
its outbox, the LMDB embedding cache when it shares one, the `Ready` that
registers it with the API, and closing all three.

With several API processes (`epd serve --api-servers N`) `spec.api` names
all N collectors, joined by ","; a worker registers with and reports its load
to each (`publish`), re-sends `Ready` every `REANNOUNCE_S` so that a
restarted API process learns it, and sends a request's TokenOutputs to the
collector its PrefillRequest named (`api_index`)."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from epd.transport.auth import WORKER, PlaneKeys
from epd.transport.channels import Outbox, Receiver
from epd.transport.messages import Message, Ready
from epd.transport.mm_cache import MMCache
from epd.transport.roles import Role


@dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is and where it talks: the part every worker has."""

    worker_id: str
    role: Role
    inbox: str  # address this worker binds
    api: str  # the API's collector address; with N API processes their N collectors, joined by ","
    mm_cache_dir: str | None  # None: no embedding cache on this worker
    mm_cache_bytes: int
    stats_interval_s: float = 0.25
    keys_dir: str | None = None  # worker-plane keys (`epd keys`): CURVE on tcp sockets; None on one host

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))  # a role's name is accepted too

    @property
    def apis(self) -> tuple[str, ...]:
        """Every API process's collector, by API index."""
        return tuple(self.api.split(","))


REANNOUNCE_S = 1.0  # several API processes: how often Ready is sent again (a restarted one learns us)


class WorkerIO:
    """Base of the encoder and engine workers."""

    def __init__(self, spec: WorkerSpec, model_fingerprint: str):
        self.spec = spec
        keys = PlaneKeys.load(spec.keys_dir, WORKER) if spec.keys_dir else None
        self.inbox = Receiver(spec.inbox, keys=keys)
        self.apis = spec.apis
        self.outbox = Outbox(keys=keys, api_address=self.apis)
        self.cache = (MMCache(spec.mm_cache_dir, spec.mm_cache_bytes, model_fingerprint=model_fingerprint)
                      if spec.mm_cache_dir else None)
        self._announced_s = 0.0

    def announce(self) -> None:
        """Registers with every API process: where to reach this worker and which cache it reads."""
        self._announced_s = time.monotonic()
        ready = Ready(self.spec.worker_id, self.spec.role, self.inbox.address, socket.gethostname(),
                      self.spec.mm_cache_dir or None)
        for api in self.apis:
            self.outbox.send(api, ready)

    def publish(self, stats: Message) -> None:
        """WorkerStats to every API process (each routes on its own registry)."""
        for api in self.apis:
            self.outbox.send(api, stats)
        if len(self.apis) > 1 and time.monotonic() - self._announced_s > REANNOUNCE_S:
            self.announce()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.inbox.close()
        self.outbox.close()
