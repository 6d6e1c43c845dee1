"""The API process's collector: the one reader of everything its workers send, and
the worker faults it sees: `Collector`.

    read():  TokenOutputs -> each output into its attempt's queue (an output no
             attempt waits for: Abort to its worker if the attempt was abandoned)
             WorkerStats / Alive -> the registry (load, heartbeats, working_on)
             KVBlocks -> the prefix index (--router cache_aware), from the registered session only
             Ready -> the registry, the encoder router, the embedding cache opened; a new
                      process: the prefix index forgets what its predecessor held
             WorkerExited (several API processes: the launcher's word) -> on_worker_exit
    watch_heartbeats(): a worker silent past the heartbeat timeout, or busy past the
             request timeout, is failed over as if it had died
    on_worker_exit / forget_worker -> _fail_over: every attempt that needs the
             worker gets a `Lost` (a suspect of its death, or sent again)

No one message, however bad, ends the reader: every worker would go silent.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable

from epd.serve.attempt import Attempt, Lost
from epd.serve.encoder_router import EncoderRouter
from epd.serve.placement import PREFILL_ROLES
from epd.serve.prefix_index import PrefixIndex
from epd.serve.registry import WorkerRegistry
from epd.transport.wire.channels import AsyncOutbox, AsyncReceiver
from epd.transport.wire.messages import (Abort, Alive, KVBlocks, Ready, TokenOutput, TokenOutputs, WireError,
                                         WorkerExited, WorkerStats)
from epd.transport.wire.roles import Role

log = logging.getLogger("epd.api")

HEARTBEAT_CHECK_S = 0.5
MAX_ABANDONED = 4096  # ids of abandoned tries whose late outputs are answered with Abort
DISPATCH_BURST = 512  # messages taken without yielding to the event loop, at most


class Collector:
    """Reads the collector socket into the attempts' queues and fails attempts over
    when a worker dies, goes silent or is removed. `attempts` is the orchestrator's
    own table (attempt id -> Attempt), shared, not copied."""

    def __init__(self, registry: WorkerRegistry, attempts: dict[str, Attempt], encoder_router: EncoderRouter,
                 on_new_worker: Callable[[], None], prefix_index: PrefixIndex | None = None):
        """`on_new_worker`: called when a worker registers (the embedding cache opens once one exists).
        `prefix_index`: where engine workers' KVBlocks go (--router cache_aware; None: dropped)."""
        self.registry = registry
        self.prefix_index = prefix_index
        self.attempts = attempts
        self.encoder_router = encoder_router
        self._on_new_worker = on_new_worker
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # ids of tries given up (bounded)
        self._silent: set[str] = set()  # workers past the heartbeat timeout, already failed over
        self._refused: set[str] = set()  # worker ids whose takeover by another session was refused (logged once)
        self._receiver: AsyncReceiver | None = None
        self._outbox: AsyncOutbox | None = None

    def start(self, receiver: AsyncReceiver, outbox: AsyncOutbox) -> list[asyncio.Task]:
        """The reader's and the heartbeat watch's tasks (the caller cancels them)."""
        self._receiver, self._outbox = receiver, outbox
        return [asyncio.create_task(self.read()), asyncio.create_task(self.watch_heartbeats())]

    def abandon(self, attempt_id: str) -> None:
        """An attempt given up before it finished: its late outputs are answered with Abort."""
        self._abandoned[attempt_id] = None
        while len(self._abandoned) > MAX_ABANDONED:
            self._abandoned.popitem(last=False)

    async def read(self) -> None:
        """The collector's reader: no one message, however bad, ends it (every worker would go silent)."""
        while True:
            try:
                msg = await self._receiver.recv()
            except WireError as exc:
                log.warning("collector: dropped a malformed message: %s", exc)
                continue
            await self._handle(msg)
            for _ in range(DISPATCH_BURST):  # the rest of a burst (a step's outputs), without awaiting each
                try:
                    msg = self._receiver.recv_nowait()
                except WireError as exc:
                    log.warning("collector: dropped a malformed message: %s", exc)
                    continue
                if msg is None:
                    break
                await self._handle(msg)

    async def _handle(self, msg) -> None:
        try:
            await self._on_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("collector: a %s failed; the collector reads on", type(msg).__name__)

    async def _on_message(self, msg) -> None:
        if isinstance(msg, TokenOutputs):  # one engine step's outputs
            attempts = self.attempts
            for out in msg.outputs:
                attempt = attempts.get(out.request_id)
                if attempt is not None:
                    attempt.queue.put_nowait(out)
                else:
                    await self._on_stray_output(out)
        elif isinstance(msg, TokenOutput):
            attempt = self.attempts.get(msg.request_id)
            if attempt is not None:
                attempt.queue.put_nowait(msg)
            else:
                await self._on_stray_output(msg)
        elif isinstance(msg, WorkerStats):
            self.registry.on_stats(msg)
            self._silent.discard(msg.worker_id)
        elif isinstance(msg, KVBlocks):
            info = self.registry.workers.get(msg.worker_id)
            if self.prefix_index is not None and info is not None and not info.is_dead \
                    and msg.session == info.session:
                self.prefix_index.apply(msg)
        elif isinstance(msg, Alive):
            info = self.registry.on_alive(msg)
            if info is not None and not self.registry.is_stuck(info):  # a stuck one is failed over once
                self._silent.discard(msg.worker_id)
        elif isinstance(msg, Ready):
            known = self.registry.workers.get(msg.worker_id)
            info = self.registry.on_ready(msg)
            if info is None:  # a live worker holds the id under another session
                if msg.worker_id not in self._refused:
                    self._refused.add(msg.worker_id)
                    log.warning("refused a Ready for %s: a live worker holds that id (a second process, "
                                "or a forged message); logged once", msg.worker_id)
                return
            if info is not known:  # registered now; re-announcements of a live worker change nothing
                self._silent.discard(msg.worker_id)
                if self.prefix_index is not None:  # a new process: its prefix cache starts empty
                    self.prefix_index.forget(msg.worker_id)
                self.encoder_router.on_ready(msg.worker_id)
                log.info("worker %s (%s) ready at %s", info.worker_id, info.role, info.inbox)
                self._on_new_worker()
        elif isinstance(msg, WorkerExited):
            self.on_worker_exit(msg.worker_id, msg.exit_code, msg.restarting)

    async def _on_stray_output(self, out: TokenOutput) -> None:
        """An output no try waits for: a worker (perhaps restarted) running a try
        given up is told to drop it; anything else (a try ended) is ignored."""
        if out.request_id in self._abandoned:
            del self._abandoned[out.request_id]
            await self._abort_everywhere(out.request_id)

    async def _abort_everywhere(self, attempt_id: str) -> None:
        for w in self.registry.live(*PREFILL_ROLES, Role.DECODE):
            try:
                await self._outbox.send(w.inbox, Abort([attempt_id]))
            except Exception:
                log.warning("could not send Abort to %s", w.worker_id)

    def on_worker_exit(self, worker_id: str, exit_code: int | None, restarting: bool = True) -> None:
        """The supervisor saw a worker process exit: route around it and
        recover the requests it held. `restarting`: it starts the worker again
        soon (else, given up for now, the role may be down: requests needing it
        are refused at once)."""
        info = self.registry.mark_dead(worker_id, restarting)
        if self.prefix_index is not None:  # a restart starts with an empty prefix cache
            self.prefix_index.forget(worker_id)
        log.warning("worker %s exited (code %s)%s", worker_id, exit_code, "" if restarting else ", not restarted")
        if info is not None:
            try:
                self._fail_over(worker_id, is_death=True)
            except Exception:  # the supervisor's watch calls this: it must go on restarting workers
                log.exception("failing over the tries of %s raised", worker_id)

    def forget_worker(self, worker_id: str) -> None:
        """A worker removed on purpose (autoscaling) after the registry retired it:
        the tries that still need it are sent again, and it leaves the registry."""
        if worker_id in self.registry.workers:
            self._fail_over(worker_id, is_death=False)
        self.registry.forget(worker_id)
        self._silent.discard(worker_id)
        if self.prefix_index is not None:
            self.prefix_index.forget(worker_id)

    def _fail_over(self, worker_id: str, is_death: bool) -> None:
        """Every try that needs `worker_id` is sent again, or failed if its request is a
        suspect of the death (`is_death`; not a worker removed on purpose): every try on
        an engine worker (a step runs them all), on an encoder those of the batch it
        said it was encoding (`Alive.working_on`), not those queued behind it."""
        info = self.registry.workers.get(worker_id)
        role = "" if info is None else str(info.role)
        encoding = set(info.working_on) if info is not None and info.role == Role.ENCODER else None
        lost = [a for a in self.attempts.values() if a.needs(worker_id)]
        suspects = {a.attempt_id for a in lost if is_death and (encoding is None or a.attempt_id in encoding)}
        # an encoder's batch may hold other API processes' requests too: its own count says how many share it
        num_suspects = len(suspects) if encoding is None else len(encoding)
        if is_death and encoding:
            log.warning("encoder %s died while encoding the items of %d requests", worker_id, len(encoding))
        for attempt in lost:
            is_suspect = attempt.attempt_id in suspects
            attempt.queue.put_nowait(Lost(worker_id, role, is_suspect, num_suspects if is_suspect else 0))

    async def watch_heartbeats(self) -> None:
        """Workers nobody supervises here (`epd worker` on other hosts, Ray
        actors) are dead once silent past the registry's heartbeat timeout, or
        stuck: busy (still saying Alive) past the request timeout."""
        while True:
            await asyncio.sleep(HEARTBEAT_CHECK_S)
            for w in list(self.registry.workers.values()):
                if w.is_dead or w.is_retired or self.registry.is_alive(w) or w.worker_id in self._silent:
                    continue
                self._silent.add(w.worker_id)
                if self.registry.is_stuck(w):
                    log.warning("worker %s busy for %.0f s (stuck): treated as dead until it reports again",
                                w.worker_id, w.busy_s)
                else:
                    log.warning("worker %s silent for %.0f s: treated as dead", w.worker_id,
                                self.registry.heartbeat_timeout_s)
                self._fail_over(w.worker_id, is_death=True)
