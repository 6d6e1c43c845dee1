"""One try of a request on one set of workers, and the events its queue carries
besides TokenOutputs. The orchestrator sends a request again (a new Attempt,
a new id) when a worker the current try needs is lost."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from epd.serve.registry import WorkerInfo

DEADLINE = object()  # queued to an attempt when its request's deadline passes
SHUTDOWN = object()  # queued to every attempt when the server stops with requests still running


class Retry(Exception):
    """This attempt's work is lost (a worker died or failed a step): send the request again."""


@dataclass
class Lost:
    """Queued to an attempt whose worker is gone."""

    worker_id: str


@dataclass
class Attempt:
    """One try of a request on one set of workers, under its own id (so late
    outputs of an abandoned try are never taken for the new one's)."""

    attempt_id: str
    queue: asyncio.Queue  # TokenOutputs (and Lost, DEADLINE) for this try
    prefill: WorkerInfo  # prefill, pd or aggregated
    decode: WorkerInfo | None
    num_prompt_tokens: int  # the prompt sent (with the tokens a try before it streamed)
    encoders: list[WorkerInfo] = field(default_factory=list)
    num_emitted: int = 0  # tokens this try produced
    is_finished: bool = False

    def workers(self) -> list[WorkerInfo]:
        every = [self.prefill] + ([self.decode] if self.decode else []) + self.encoders
        return list({w.worker_id: w for w in every}.values())

    def needs(self, worker_id: str) -> bool:
        """Whether losing `worker_id` loses this try's work."""
        if worker_id == self.prefill.worker_id:
            # a prefill worker hands over at the first token; until the decode worker's
            # first token the KV transfer may not have arrived
            return self.decode is None or self.num_emitted < 2
        if self.decode is not None and worker_id == self.decode.worker_id:
            return True
        return self.num_emitted == 0 and any(e.worker_id == worker_id for e in self.encoders)
