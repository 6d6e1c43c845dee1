"""What every worker process holds and does the same way: its inbox (bound),
its outbox, the LMDB embedding cache when it shares one, the `Ready` that
registers it with the API, and closing all three."""
from __future__ import annotations

import socket
from dataclasses import dataclass

from epd.transport.auth import WORKER, PlaneKeys
from epd.transport.channels import Outbox, Receiver
from epd.transport.messages import Ready
from epd.transport.mm_cache import MMCache
from epd.transport.roles import Role


@dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is and where it talks: the part every worker has."""

    worker_id: str
    role: Role
    inbox: str  # address this worker binds
    api: str  # the API's collector address
    mm_cache_dir: str | None  # None: no embedding cache on this worker
    mm_cache_bytes: int
    stats_interval_s: float = 0.25
    keys_dir: str | None = None  # worker-plane keys (`epd keys`): CURVE on tcp sockets; None on one host

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))  # a role's name is accepted too


class WorkerIO:
    """Base of the encoder and engine workers."""

    def __init__(self, spec: WorkerSpec, model_fingerprint: str):
        self.spec = spec
        keys = PlaneKeys.load(spec.keys_dir, WORKER) if spec.keys_dir else None
        self.inbox = Receiver(spec.inbox, keys=keys)
        self.outbox = Outbox(keys=keys, api_address=spec.api)
        self.cache = (MMCache(spec.mm_cache_dir, spec.mm_cache_bytes, model_fingerprint=model_fingerprint)
                      if spec.mm_cache_dir else None)

    def announce(self) -> None:
        """Registers with the API: where to reach this worker and which cache it reads."""
        self.outbox.send(self.spec.api, Ready(self.spec.worker_id, self.spec.role, self.inbox.address,
                                              socket.gethostname(), self.spec.mm_cache_dir or None))

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.inbox.close()
        self.outbox.close()
