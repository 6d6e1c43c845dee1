"""The API process's side of a request: admission, the retry loop, drain.

    generate(request):
      admission (draining? too many requests?)                      _admit_request
      prepare: media -> bytes -> tokens, spans, mm_hash, patches     epd/serve/preparer.py
      each attempt (at most MAX_ATTEMPTS, on live workers):
        place: routers, cache lookup, encoders; PrefillRequest at once,
               then an EncodeRequest per missing image               epd/serve/placement.py
        stream: TokenOutputs in order -> detokenize, stop strings,
                coalesce -> Delta                                     epd/serve/attempt_stream.py
        a worker lost or a failed step -> Retry: sent again as prompt + tokens streamed,
        unless the request is a suspect of the death (a poison request): failed   attempt.poison_error
      closed early (client gone) or stopped by a stop string -> Abort to every worker involved

The collector socket receives everything workers send the API: Ready,
WorkerStats, Alive (a busy worker's heartbeat), TokenOutputs (one per engine
step; TokenOutput for a lone error) (and, with several API processes, the
launcher's WorkerExited); its reader and the worker faults it sees are
epd/serve/collector.py's. API process `api_index` names itself in each
PrefillRequest, so the workers send that request's tokens to its collector.
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
import logging
import time
from typing import AsyncIterator

from epd.engine.model_info import ModelInfo
from epd.config import ServeConfig
from epd.inputs.model_files import ModelFiles
from epd.lora_modules import LoRAModule, check_lora_modules
from epd.requests import Delta, GenerateRequest, RequestError
from epd.serve.attempt_stream import AttemptStream
from epd.serve.collector import Collector
from epd.serve.placement import PREFILL_ROLES, Placement
from epd.serve.preparer import Prepared, Preparer
from epd.serve.worker_metrics import WorkerMetrics
from epd.serve.attempt import SHUTDOWN, Attempt, Retry, poison_error
from epd.serve.registry import WorkerRegistry
from epd.processes.supervisor import Unsupervised, WorkerWatch
from epd.transport.wire.auth import API, COLLECTOR_DOMAIN, PlaneKeys
from epd.transport.wire.frame_limits import COLLECTOR_FRAME_BYTES
from epd.transport.wire.channels import AsyncOutbox, AsyncReceiver
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.messages import Abort, LoRAUpdate, Shutdown
from epd.transport.wire.roles import Role

log = logging.getLogger("epd.api")
LORA_CHECK_TIMEOUT_S = 30.0  # a runtime load's read of an adapter's config and header (bounded in size)

MAX_ATTEMPTS = 4  # tries of one request on different workers before it fails
DRAIN_POLL_S = 0.1  # while draining, look this often whether the requests in flight are done
END_S = 2.0  # past the drain, requests still running get this long to write their 503
ROLE_DOWN_RETRY_AFTER_S = 10  # Retry-After of a 503 for a role that is down (the supervisor probes it again)


class Orchestrator:
    """The API process's side of every request: admission, the retry loop over
    `Preparer`, `Placement` and `AttemptStream`, the collector, failover."""

    def __init__(self, config: ServeConfig, collector_address: str, mm_cache_dir: str,
                 keys_dir: str | None = None, api_index: int = 0, supervisor: WorkerWatch | None = None):
        """`mm_cache_dir`: the embedding cache the launcher's workers share
        (`--mm-cache-dir`, or one it made under its run dir). `keys_dir`: the
        worker-plane keys when the collector is on tcp (default `--worker-keys`).
        `api_index`: this API process's place among `--api-servers` (its
        collector's in WorkerSpec.apis). `supervisor`: who keeps the workers
        up, as this process sees it (epd/processes/supervisor.py; None: nobody here)."""
        self.config = config
        self.keys_dir = keys_dir or config.worker_keys
        # tokenizer, chat template, sampling defaults, image processor; CheckpointError names what is wrong
        self.files = ModelFiles.open(config.model, config.files)
        self.info = ModelInfo.from_pretrained(config.model, self.files.hf_config)
        self.tokenizer = self.files.tokenizer
        self.model_name = config.model_name
        self.max_model_len = config.engine.resolved_max_model_len(self.info.max_model_len)
        self.vocab_size = self.info.vocab_size
        self.collector_address = collector_address
        self.api_index = api_index
        # a worker busy past the request timeout holds nothing that can still finish
        supervisor = supervisor or Unsupervised()
        self.registry = WorkerRegistry(supervised=supervisor.sees_exit, stuck_after_s=config.limits.request_timeout_s)
        self.metrics = WorkerMetrics(self.registry, worker_restarts=supervisor.restart_counts)
        self.attempts: dict[str, Attempt] = {}  # attempt id -> the try its TokenOutputs go to
        self.preparer = Preparer(config, self.info, self.files, self.max_model_len, self.metrics)
        self.placement = Placement(config, self.info, self.registry, self.metrics, self.attempts, mm_cache_dir,
                                   api_index)
        self.encoder_router = self.placement.encoder_router  # told of every encoder's Ready
        self.metrics.prefix_index = self.placement.prefix_index  # /metrics: epd:router_cached_blocks
        self.collector = Collector(self.registry, self.attempts, self.encoder_router, self.placement.open_cache,
                                   self.placement.prefix_index)
        # the supervisor's and the encoder pool's word that a worker exited or was removed
        self.on_worker_exit = self.collector.on_worker_exit
        self.forget_worker = self.collector.forget_worker
        self.num_active = 0  # sequences in generate()
        self.draining = False  # SIGTERM: refuse new requests, let these finish
        self.ending = False  # past the drain: every request still running ends with a 503
        self.required_roles = [role for role, _ in config.mode_roles()]
        # the roles every request ends on (decode, pd or aggregated): one down, nothing can be served
        self.final_roles = [role for role in self.required_roles if role not in (Role.ENCODER, Role.PREFILL)]
        self._receiver: AsyncReceiver | None = None
        self._outbox: AsyncOutbox | None = None
        self._tasks: list[asyncio.Task] = []
        self._lora_checks = ThreadPoolExecutor(1, thread_name_prefix="lora-check")  # runtime loads' checks

    # ---------------------------------------------------------- lifecycle

    async def start(self) -> None:
        keys = PlaneKeys.load(self.keys_dir, API) if self.keys_dir else None
        self._receiver = AsyncReceiver(self.collector_address, keys=keys, domain=COLLECTOR_DOMAIN,
                                       max_frame_bytes=COLLECTOR_FRAME_BYTES)
        self._outbox = AsyncOutbox(keys=keys)
        self._tasks = self.collector.start(self._receiver, self._outbox)

    async def wait_for_workers(self, expected: int, timeout_s: float, alive=lambda: True) -> None:
        """Until `expected` workers sent Ready; raises if one died or time ran out."""
        deadline = time.monotonic() + timeout_s
        while len(self.registry.workers) < expected:
            if not alive():
                raise RuntimeError("a worker process exited during start-up (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.registry.workers)} of {expected} workers ready "
                                   f"after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        self.placement.open_cache()
        # where every socket lives, for operators (and the garbage-frame tests)
        workers = sorted(self.registry.workers.values(), key=lambda w: w.worker_id)
        sockets = [f"api={self.collector_address}"] + [f"{w.worker_id}={w.inbox}" for w in workers]
        print(f"EPD sockets: {' '.join(sockets)}", flush=True)

    async def stop(self, shutdown_workers: bool = True) -> None:
        """`shutdown_workers`: False for one of several API processes (the launcher stops the workers)."""
        if self._outbox is not None and shutdown_workers:
            for w in list(self.registry.workers.values()):
                try:
                    await asyncio.wait_for(self._outbox.send(w.inbox, Shutdown()), 1.0)
                except (asyncio.TimeoutError, Exception):
                    log.warning("could not send Shutdown to %s", w.worker_id)
        for task in self._tasks:
            task.cancel()
        self.placement.close()
        await self.preparer.aclose()
        await asyncio.sleep(0.05)  # let the Shutdowns leave
        if self._outbox is not None:
            self._outbox.close()
        if self._receiver is not None:
            self._receiver.close()

    # ------------------------------------------------------------- facade

    async def update_lora(self, lora: LoRARequest, is_load: bool) -> None:
        """A runtime adapter load (read and checked against the checkpoint here, torch-free:
        ValueError naming the field) or unload, announced to every live prefill and decode
        worker (`LoRAUpdate`). One that starts later learns of it from its first request."""
        if is_load:
            if not self.config.engine.lora.enable_lora:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: LoRA is not enabled (--enable-lora)")
            # off the event loop (a header takes up to ~1 s to parse), one at a time, with a deadline
            check = asyncio.get_running_loop().run_in_executor(
                self._lora_checks, check_lora_modules, (LoRAModule(lora.lora_name, lora.lora_path),),
                self.model_name, self.files.hf_config, self.config.engine.lora.max_lora_rank,
                self.config.engine.lora.enable_tower_lora)
            try:
                await asyncio.wait_for(check, LORA_CHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RequestError(f"LoRA adapter {lora.lora_name!r}: its files were not read within "
                                   f"{LORA_CHECK_TIMEOUT_S:g} s", status=503, type="service_unavailable",
                                   retry_after_s=5) from None
        for w in self.registry.live(*PREFILL_ROLES, Role.DECODE):
            try:
                await self._outbox.send(w.inbox, LoRAUpdate(lora, is_load))
            except Exception:
                log.warning("could not send LoRAUpdate to %s", w.worker_id)

    def missing_roles(self) -> list[str]:
        """The roles this mode needs that have no live worker now."""
        return self.registry.missing_roles(self.required_roles)

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def tokenize(self, req: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        """/tokenize: the prompt token ids `generate(req)` would send (Preparer.prompt_token_ids)."""
        return await self.preparer.prompt_token_ids(req, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    # ------------------------------------------------------------ requests

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """One sequence, start to finish. A worker that dies under it (or fails
        a step) costs nothing visible: the request is sent again, as prompt plus
        the tokens already streamed, to live workers (`Retry`)."""
        deadline = time.monotonic() + self.config.limits.request_timeout_s
        self._admit_request()
        self.num_active += 1
        prep = None
        try:
            prep = await self.preparer.prepare(req)
            stream = AttemptStream(self.tokenizer, prep, req.sampling, self.metrics,
                                   self.config.limits.request_timeout_s, lambda: self.preparer.release(prep))
            why, deaths, alone = "", 0, False
            for attempt_no in range(MAX_ATTEMPTS):
                if attempt_no:
                    self.metrics.requests_recovered["resumed" if stream.emitted else "retried"] += 1
                attempt = await self._start_attempt(req, prep, stream.emitted, attempt_no, deadline, alone)
                try:
                    async with contextlib.aclosing(stream.run(attempt, deadline)) as deltas:
                        async for delta in deltas:
                            yield delta
                    return
                except Retry as retry:
                    why = str(retry)
                    lost = retry.lost
                    if lost is not None and lost.is_suspect:  # a poison request is failed, not sent again
                        deaths += 1
                        error = poison_error(lost, deaths, self.config.limits.max_request_worker_deaths,
                                             "video" if prep.has_video else "image", bool(prep.items))
                        if error is not None:
                            log.warning("request %s failed as poison: %s", req.request_id, error.message)
                            self.metrics.requests_failed["poison"] += 1
                            raise error
                        alone = alone or lost.role == Role.ENCODER  # its items each in a batch of their own
                    log.warning("request %s: %s; sending it again (%d tokens streamed)", req.request_id, why,
                                len(stream.emitted))
                finally:
                    await self._end_attempt(attempt)
            self.metrics.requests_failed["worker_error"] += 1
            raise RequestError(status=503, message=f"the request failed on {MAX_ATTEMPTS} workers in turn ({why})",
                               type="service_unavailable", retry_after_s=1)
        finally:
            self.num_active -= 1
            if prep is not None:
                self.preparer.release(prep)

    def _admit_request(self) -> None:
        limits = self.config.limits
        if self.draining:
            self.metrics.requests_refused["draining"] += 1
            raise RequestError(status=503, message="the server is shutting down", type="service_unavailable",
                               retry_after_s=5)
        down = self.registry.down_roles(self.final_roles)
        if down:  # every request ends on one of these: none can be served until it is back
            self.metrics.requests_refused["role_down"] += 1
            raise RequestError(status=503, message=f"no live {' or '.join(down)} worker: the role is down "
                               f"(see /health)", type="service_unavailable", retry_after_s=ROLE_DOWN_RETRY_AFTER_S)
        if self.num_active >= limits.max_pending_requests:
            self.metrics.requests_refused["busy"] += 1
            raise RequestError(status=503, message=f"the server is busy: {self.num_active} requests in progress "
                               f"(--max-pending-requests)", type="service_unavailable", retry_after_s=1)

    async def drain(self, grace_s: float) -> None:
        """The server stops (SIGTERM: `grace_s` = --shutdown-grace; Ctrl-C: 0): new
        requests get 503 + Retry-After, those in flight may finish for `grace_s`,
        then each still running ends with a 503 of its own (a JSON error, or an
        error event and [DONE] mid-stream) and is given END_S to be written, so
        nothing is left for uvicorn to cut off."""
        self.draining = True
        await self._until_idle(grace_s)
        if self.num_active:
            log.warning("shutting down: ending %d requests still running", self.num_active)
            self.ending = True
            for attempt in list(self.attempts.values()):
                attempt.queue.put_nowait(SHUTDOWN)
            await self._until_idle(END_S)

    async def _until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)

    async def _start_attempt(self, req: GenerateRequest, prep: Prepared, emitted: list[int], attempt_no: int,
                             deadline: float, alone: bool = False) -> Attempt:
        """Places and sends one try of a request: prompt + `emitted`, with the
        rest of its token budget, to live workers; `alone`: each of its items
        encoded in a batch of its own."""
        if self.ending:
            self.metrics.requests_failed["shutdown"] += 1
            raise RequestError(status=503, message="the server is shutting down", type="service_unavailable",
                               retry_after_s=5)
        placed = await self.placement.place(prep, emitted, attempt_no, deadline,
                                            None if req.lora is None else req.lora.lora_name, req.session_id)
        attempt_id = req.request_id if attempt_no == 0 else f"{req.request_id}~retry{attempt_no}"
        attempt = Attempt(attempt_id, asyncio.Queue(), placed.prefill, placed.decode, len(prep.token_ids) + len(emitted),
                          alone=alone)
        self.attempts[attempt_id] = attempt
        try:
            await self.placement.send(self._outbox, attempt, placed, req, prep, emitted)
        except BaseException:  # the client left while we sent (cancelled): what was sent is aborted
            await self._end_attempt(attempt)
            raise
        return attempt

    async def _end_attempt(self, attempt: Attempt) -> None:
        """Forgets an attempt; unless it finished, frees every worker's share of it
        (client gone, stop string, error, or a retry elsewhere)."""
        self.attempts.pop(attempt.attempt_id, None)
        if attempt.is_finished:
            return
        self.collector.abandon(attempt.attempt_id)
        for w in attempt.workers():
            try:
                await self._outbox.send(w.inbox, Abort([attempt.attempt_id]))
            except Exception:
                log.warning("could not send Abort to %s", w.worker_id)

