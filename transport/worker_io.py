"""What every worker process holds and does the same way: its inbox (bound),
its outbox, the LMDB embedding cache when it shares one, the `Ready` that
registers it with the API, and closing all three."""
from __future__ import annotations

import socket

from epd.transport.channels import Outbox, Receiver
from epd.transport.messages import Ready
from epd.transport.mm_cache import MMCache


class WorkerIO:
    """Base of the encoder and engine workers. `spec` needs worker_id, inbox
    (the address to bind), api, mm_cache_dir and mm_cache_bytes."""

    def __init__(self, spec, model_fingerprint: str):
        self.spec = spec
        self.inbox = Receiver(spec.inbox)
        self.outbox = Outbox()
        self.cache = (MMCache(spec.mm_cache_dir, spec.mm_cache_bytes, model_fingerprint=model_fingerprint)
                      if spec.mm_cache_dir else None)

    def announce(self, role: str) -> None:
        """Registers with the API: where to reach this worker and which cache it reads."""
        self.outbox.send(self.spec.api, Ready(self.spec.worker_id, role, self.inbox.address, socket.gethostname(),
                                              self.spec.mm_cache_dir or None))

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.inbox.close()
        self.outbox.close()
