"""One try of a request on one set of workers, and the events its queue carries
besides TokenOutputs. The orchestrator sends a request again (a new Attempt,
a new id) when a worker the current try needs is lost."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from epd.requests import RequestError
from epd.serve.registry import WorkerInfo
from epd.transport.wire.roles import Role

DEADLINE = object()  # queued to an attempt when its request's deadline passes
SHUTDOWN = object()  # queued to every attempt when the server stops with requests still running


class Retry(Exception):
    """This attempt's work is lost (a worker died or failed a step): send the request again.
    `lost`: the worker death that lost it (None: a failed step)."""

    def __init__(self, why: str, lost: Lost | None = None):
        super().__init__(why)
        self.lost = lost


@dataclass
class Lost:
    """Queued to an attempt whose worker is gone. `is_suspect`: the attempt's own
    work may have killed it (docs/architecture.md, "Faults": an engine worker's
    every request, an encoder's batch in progress); False for a worker removed on
    purpose, or an encoder's queued items. `num_suspects`: how many requests share
    the blame (an encoder's batch)."""

    worker_id: str
    role: str = ""
    is_suspect: bool = False
    num_suspects: int = 0


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
    alone: bool = False  # its items are encoded each in a batch of its own (a suspect of an encoder's death)
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


def poison_error(lost: Lost, deaths: int, max_deaths: int, modality: str, has_media: bool) -> RequestError | None:
    """The error of a request among the suspects of a worker's death (`deaths` so far),
    or None: it may be sent again. The sole request of an encoder's batch in progress
    is failed at once; any other suspect at `max_deaths` deaths
    (--max-request-worker-deaths). A 400, not a 5xx: clients (the openai SDK) re-send
    a 5xx on their own, into the next worker."""
    if lost.role == Role.ENCODER and lost.num_suspects == 1:
        message = (f"the encoder worker {lost.worker_id} died while encoding this request's {modality}s "
                   f"(killed for memory, or crashed); the request was not sent again, so that its input "
                   f"does not take down the next encoder")
    elif deaths >= max_deaths:
        message = (f"{deaths} workers died while running this request (the last: {lost.worker_id}); it was not "
                   f"sent again, so that its input does not take down the next (--max-request-worker-deaths "
                   f"{max_deaths})")
    else:
        return None
    return RequestError(message, status=400, code="input_crashed_worker", param="messages" if has_media else None)
