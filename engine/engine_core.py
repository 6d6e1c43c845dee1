"""The engine every worker runs: scheduler + model runner, one step at a time.

    step():  drafts -> schedule() -> SchedulerOutput -> runner.execute() -> scheduler.update()

Works on token ids and image embeddings only: tokenizing, detokenizing, stop
strings and the vision tower live with the caller (the offline `LLM`, a
worker process). The same object serves the prefill, decode and pd
(prefill and decode in one engine) roles (see `Scheduler`). The images of
its requests are in one `ImageLedger`: this class enters them and takes a
request out when it leaves; the scheduler asks the ledger how far a request
may be prefilled, the runner reads the embeddings from it. Early prefill's
settings are one `EarlyPrefill` (engine/early_prefill.py), asked by the
scheduler, this class and the worker loop (`early_prefill`).

It is the only door into the engine: callers use the verbs below
(`add_request`, `add_embedding`, `fail_image`, `abort_overdue`,
`add_prefilled`, `export_kv`, `export_draft_state`, `export_state`, `release`, `abort`, `step`, `get_embedding`,
`load_lora`, `prefetch_lora`, `unload_lora`, the counts), never its scheduler or runner.
The adapter verbs are in engine/lora/engine_adapters.py (`EngineAdapters`, mixed in).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch

from epd.engine.attention import fp8_kv
from epd.engine.config import EngineConfig
from epd.engine.cuda_graphs import capture_sizes
from epd.engine.early_prefill import EarlyPrefill
from epd.engine.image_ledger import ImageLedger
from epd.engine.kv_cache_sizer import bytes_per_block, num_kv_blocks, profile_forward
from epd.engine.layers.mlp import pack_cpu_linears
from epd.transport.weights.quant.int8_linear import float_linears
from epd.engine.loader import load_language_model, resolve_dtype
from epd.engine.lora.config import fits_adapter_limit
from epd.engine.lora.engine_adapters import EngineAdapters
from epd.engine.lora.manager import LoRAManager
from epd.engine.model_info import ModelInfo
from epd.engine.model_runner import ModelRunner
from epd.engine.models.causal_lm import num_kv_layers
from epd.engine.parallel.comm import GroupFailed
from epd.engine.parallel.leader import check_supported, start_group
from epd.engine.request import Request
from epd.transport.wire.kv_events import KVCacheEvent
from epd.transport.wire.sampling import TokenLogprobs
from epd.transport.weights.cpu_linear import pack_linears
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_output import RequestUpdate
from epd.engine.spec.draft_model import DraftModelProposer, load_draft_model
from epd.engine.spec.eagle3_proposer import Eagle3Proposer, load_head
from epd.engine.spec.mtp import load_mtp_head
from epd.engine.spec.ngram import NgramProposer
from epd.engine.state_cache import bytes_per_slot, check_stateful_engine, num_state_snapshots, state_shapes
from epd.engine.structured_output import GrammarCompilerPool
from epd.transport.embedding_cache.mm_entry import MMEntry

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step raised: its requests (`request_ids`) were aborted, every other
    request and the engine itself are as before the step."""

    def __init__(self, request_ids: list[str], failed: dict[str, str] | None = None):
        super().__init__(f"a step of {len(request_ids)} requests failed")
        self.request_ids = request_ids
        self.failed = failed or {}  # request id -> error: grammars that failed before the step


@dataclass
class StepResult:
    updates: list[RequestUpdate] = field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per token of its update
    num_batched_tokens: int = 0
    requests: dict[str, Request] = field(default_factory=dict)  # every request run this step
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error (e.g. a grammar that fails to compile)
    # Dropped by the scheduler: no KV block left and it cannot be recomputed here
    # (decode role, images elsewhere); the caller may send it again elsewhere.
    dropped: list[str] = field(default_factory=list)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # with a request's first token


class EngineCore(EngineAdapters):
    def __init__(self, model_dir: str, config: EngineConfig, role: str = "pd",
                 hf_config=None, info: ModelInfo | None = None, tokenizer_dir: str | None = None,
                 kv_events: bool = False):
        """`tokenizer_dir`: where the grammar compiler's tokenizer is (--tokenizer; None: `model_dir`).
        `kv_events`: record the prefix cache's changes (`take_kv_events`) even without
        --kv-events-config (the worker reports them to a cache-aware router)."""
        from epd.families.registry import load_hf_config, served_config

        hf_config = served_config(hf_config) if hf_config is not None else load_hf_config(model_dir)
        self.info = info or ModelInfo.from_pretrained(model_dir, hf_config)
        self.config = config
        self.device = config.resolved_device()
        torch.manual_seed(config.seed)  # --seed: what unseeded requests draw from (vLLM seeds every worker)
        self.dtype = resolve_dtype(config.dtype, self.info.checkpoint_dtype)
        self.tensor_parallel = config.tensor_parallel_size > 1  # rank 0 of a group (engine/parallel/leader.py)
        if self.tensor_parallel:
            check_supported(config, self.device)
            model = start_group(model_dir, self.dtype, config.tensor_parallel_size, self.info.num_kv_heads)
        else:
            model = load_language_model(model_dir, hf_config, self.dtype, self.device)
        if config.lora.enable_lora:
            float_linears(model)  # W8A8's Int8Linears (transport/weights/quant/int8_linear.py) dequantized to wrap
        shapes = state_shapes(model)  # per-request state beside the KV: one slot per running request
        if shapes:
            check_stateful_engine(config.speculative_config and config.speculative_config.method)
        # --enable-lora: the projections wrapped, the adapter slots allocated (before the KV cache takes the rest)
        self.lora = LoRAManager(model, config.lora, use_triton=config.resolved_backend(self.device) == "triton") \
            if config.lora.enable_lora else None
        # CPU float32: oneDNN with packed weights (transport/weights/cpu_linear.py); after the LoRA wrapping, which
        # reads the base projections' weights, and reaches the base projections inside the wrappers
        pack_cpu_linears(model)
        spec = config.speculative_config
        # a draft model (decode-side engines): its KV shares the target's block ids, so a block costs both
        draft = load_draft_model(spec.model, tokenizer_dir or model_dir, self.dtype, self.device) \
            if spec is not None and spec.method == "draft_model" and role != "prefill" else None
        # --kv-cache-dtype fp8: a row of head_dim bytes and a scale per token and kv head (engine/attention/fp8_kv.py)
        kv_dtype = fp8_kv.kv_cache_dtype(config, self.dtype, self.device)
        num_kv_heads = model.cfg.num_kv_heads if self.tensor_parallel else self.info.num_kv_heads  # this rank's
        block_bytes = bytes_per_block(num_kv_layers(model), num_kv_heads,
                                      fp8_kv.row_width(self.info.head_dim, kv_dtype), config.scheduler.block_size,
                                      kv_dtype)
        head = None  # EAGLE-3 or MTP: its KV shares the target's blocks, so it counts in each block's bytes
        if spec is not None and spec.method in ("eagle3", "mtp"):
            head = load_head(spec.model, model.cfg, self.dtype, self.device) if spec.method == "eagle3" \
                else load_mtp_head(model, model_dir, hf_config, self.dtype, self.device)
            block_bytes += Eagle3Proposer.bytes_per_block(head[0], config.scheduler.block_size, self.dtype)
        if draft is not None:
            block_bytes += DraftModelProposer.bytes_per_block(draft, config.scheduler.block_size)
        sched_cfg = dataclasses.replace(config.scheduler,
                                        max_model_len=config.resolved_max_model_len(self.info.max_model_len))
        num_state_slots = sched_cfg.max_num_seqs if shapes else 0
        num_snapshots = num_state_snapshots(sched_cfg) if shapes else 0  # prefix hits resume from these
        num_blocks = num_kv_blocks(config, block_bytes, self.device,
                                   profile_forward=lambda: profile_forward(model, config, self.device),
                                   reserved_bytes=(num_state_slots + num_snapshots)
                                   * bytes_per_slot(shapes, self.dtype))
        self.images = ImageLedger()  # the images of the requests in the engine
        self.early_prefill = EarlyPrefill.of(config)
        self.scheduler = Scheduler(sched_cfg, num_blocks, role=role, images=self.images,
                                   max_loras=config.lora.max_loras if self.lora else 0,
                                   adapter_weights=self.lora.weights_of if self.lora else None,
                                   early_prefill=self.early_prefill,
                                   whole_mm_spans=getattr(model, "bidirectional_mm", False),
                                   num_state_snapshots=num_snapshots,
                                   kv_events=kv_events or (config.kv_events_config is not None
                                                           and config.kv_events_config.is_on))
        eagle3 = None
        if head is not None:  # every role feeds it (a prefill worker hands its KV over); decode-side ones draft
            (pack_linears if spec.method == "eagle3" else pack_cpu_linears)(head[1])  # MTP: the target's layer kind
            embed = model.model.embed_tokens if head[1].embed_tokens is None else head[1].embed_tokens
            eagle3 = Eagle3Proposer(*head, embed, num_blocks, config.scheduler.block_size,
                                    spec.num_speculative_tokens, torch.device(self.device), self.dtype)
        if self.tensor_parallel:  # the followers' KV caches: the same blocks, their heads
            model.setup(num_blocks, config.scheduler.block_size, config.resolved_backend(self.device))
        self.runner = ModelRunner(model, num_blocks, config.scheduler.block_size,
                                  self.info.image_token_id, self.images, config.resolved_backend(self.device),
                                  self.device, lora=self.lora, eagle3=eagle3, num_state_slots=num_state_slots,
                                  num_state_snapshots=num_snapshots, kv_dtype=kv_dtype)
        self.num_blocks = num_blocks
        self.kv_block_bytes = block_bytes
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB a 1,000 tokens), %s", num_blocks,
                 config.scheduler.block_size, num_blocks * config.scheduler.block_size,
                 block_bytes * 1000 / config.scheduler.block_size / (1 << 20),
                 str(kv_dtype).removeprefix("torch."))
        self.graph_capture_s = self._capture_decode_graphs(role, sched_cfg, eagle3)
        self.grammars = GrammarCompilerPool(tokenizer_dir or model_dir, self.info.vocab_size,
                                            self.info.eos_token_ids)
        # Speculative decoding (--speculative-config): decode-side engines only; a prefill
        # worker samples one token a request and has nothing to verify.
        self.proposer = None
        if draft is not None:
            self.proposer = DraftModelProposer(
                draft, spec.num_speculative_tokens, num_blocks, config.scheduler.block_size,
                config.resolved_backend(self.device), self.device, self.info.vocab_size, sched_cfg.max_num_seqs,
                sched_cfg.max_num_batched_tokens, model.positions)
        elif spec is not None and role != "prefill":
            self.proposer = eagle3 or NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                    spec.prompt_lookup_max)
        # Requests whose adapter is being read (LoRAManager's loader thread) or grammar
        # (or bad words) prepared (the compiler thread): they enter the scheduler when
        # done, so no step waits for a disk or a compile (their images are in the ledger already).
        self._preparing: dict[str, tuple[Request, list[Future]]] = {}

    def _capture_decode_graphs(self, role: str, sched_cfg, eagle3) -> float | None:
        """CUDA graphs for decode steps (engine/cuda_graphs.py) on a GPU with the Triton kernels,
        unless --enforce-eager; the seconds capture took, None when there are none. Not on a
        prefill worker (it never decodes), nor with LoRA or an EAGLE-3 head (their forwards
        take per-step inputs a graph does not hold yet): those run eagerly, said in the log."""
        config = self.config
        if not self.device.startswith("cuda") or config.enforce_eager or role == "prefill" \
                or config.resolved_backend(self.device) != "triton":
            return None
        if self.lora is not None or eagle3 is not None or self.runner.state_cache is not None:
            log.info("decode steps run eagerly: CUDA graphs do not take %s yet",
                     "LoRA adapters" if self.lora is not None else "an EAGLE-3 head" if eagle3 is not None
                     else "per-request state slots")
            return None
        sizes = capture_sizes(sched_cfg.max_num_seqs, config.max_cudagraph_capture_size)
        if not sizes:
            return None
        try:
            seconds = self.runner.capture_graphs(sizes, sched_cfg.max_model_len)
        except RuntimeError as exc:  # an op of the forward that cannot be captured: run eagerly
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            self.runner.graphs = None
            return None
        log.info("captured CUDA graphs for decode steps of %d sizes (1..%d sequences) in %.1f s",
                 len(sizes), sizes[-1], seconds)
        return seconds

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # -- intake ------------------------------------------------------------------

    def add_request(self, request: Request, mm_embeddings: dict[str, MMEntry] | None = None,
                    pending_mm_hashes: Iterable[str] = ()) -> None:
        """Queues a request; `mm_embeddings` must hold every image of its spans
        the engine does not hold already (`get_embedding`), except those in
        `pending_mm_hashes`: they come later through `add_embedding`, and the
        request is prefilled up to the first of them meanwhile (early
        prefill). ValueError if an image is unaccounted for, if a span's
        metadata is not the model's to place, or if the scheduler refuses the request."""
        self.runner.positions.check_spans(request.mm_spans)  # the family's metadata, before any work
        pending_mm_hashes = set(pending_mm_hashes)
        missing = self.images.missing(request, mm_embeddings, pending_mm_hashes)
        if missing:
            raise ValueError(f"request {request.request_id}: no embeddings for images {missing}")
        if not request.eos_token_ids:
            request.eos_token_ids = self.info.eos_token_ids
        if request.max_model_len is None:
            request.max_model_len = self.max_model_len
        if request.request_id in self._preparing:
            raise ValueError(f"request {request.request_id} is already queued")
        futures = self._preparations(request)
        if futures:
            self.scheduler.check(request)  # refuse what the scheduler would refuse, now
            self._preparing[request.request_id] = (request, futures)
        else:
            self.scheduler.add_request(request)
        self.images.add(request, mm_embeddings, pending_mm_hashes)

    def _preparations(self, request: Request) -> list[Future]:
        """What must be ready before the request may be scheduled, read or compiled in a
        background thread meanwhile: its adapter in host memory, then its grammar (the
        last future's result is the grammar's `CompiledConstraints`). [] when nothing is pending."""
        futures = []
        lora = self._lora_read(request)
        if lora is not None and not (lora.done() and lora.exception() is None):
            futures.append(lora)
        if GrammarCompilerPool.needs(request.sampling_params):
            futures.append(self.grammars.prepare(request.sampling_params))
        return futures

    def add_embedding(self, mm_hash: str, entry: MMEntry) -> bool:
        """An image that requests were added without (`pending_mm_hashes`) is
        here: they may be prefilled past it. False, keeping nothing, when it is
        not pending (no request in the engine uses it: aborted meanwhile)."""
        return self.images.arrived(mm_hash, entry)

    def fail_image(self, mm_hash: str) -> list[str]:
        """An image that requests were added without will never come (it could
        not be encoded, or it left the cache before use): the requests that
        wait for it (`ImageLedger.waiting_for`) are aborted, freeing what they
        hold. Returns their ids, for the caller to answer."""
        waiting = self.images.waiting_for(mm_hash)
        return self.abort(waiting) if waiting else []

    def abort_overdue(self, now_s: float, max_wait_s: float) -> list[str]:
        """Aborts the requests that have waited for an image more than
        `max_wait_s` (`early_prefill.max_image_wait_s`) since they arrived
        (`Request.arrival_time`, the clock of `now_s`): nobody else will give up
        on them when their encoder died. Returns their ids, for the caller to answer."""
        late = self.images.overdue(now_s, max_wait_s)  # asked between every two steps: [] fast
        return self.abort(late) if late else []

    def add_prefilled(self, request: Request, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                      draft_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      state: dict[str, torch.Tensor] | None = None) -> bool:
        """Decode role: takes a request prefilled elsewhere with its prompt KV
        (k/v each [num_layers, num_blocks, block_size, num_kv_heads, head_dim],
        blocks in token order) and `output_token_ids` holding its first token;
        `draft_state`: the EAGLE-3 head's blocks and features (`export_draft_state`);
        `state`: its named per-request state (`export_state`), which a model whose
        layers carry state needs and any other refuses.
        False, changing nothing, when there is no room now: retry later.
        ValueError when it can never be taken (bad KV or state, duplicate id, too long)."""
        self.runner.positions.check_spans(request.mm_spans)
        num_blocks = -(-request.num_prompt_tokens // self.config.scheduler.block_size)
        self.runner.check_blocks(k_blocks, v_blocks, num_blocks)
        self.runner.check_state(state or {})
        eagle3 = self.runner.eagle3
        if eagle3 is not None and draft_state is not None:
            eagle3.check_import(*draft_state, num_blocks)
        if request.lora_request is not None and self.lora is not None \
                and not self.lora.is_loaded(request.lora_request.key) \
                and not fits_adapter_limit(self.scheduler.running, request.lora_key, self.scheduler.max_loras):
            return False  # --max-loras others run already (a running one is read): no read yet, it would be trimmed
        lora = self._lora_read(request)
        if lora is not None:
            if not lora.done():
                return False  # the caller retries; the adapter is read meanwhile
            lora.result()  # LoRAAdapterError (a ValueError): it cannot run here
        if request.max_model_len is None:
            request.max_model_len = self.max_model_len
        prepared = None
        if GrammarCompilerPool.needs(request.sampling_params):
            future = self.grammars.prepare(request.sampling_params)  # compiled once, then cached
            if not future.done():
                return False  # the caller retries; the grammar compiles meanwhile
            prepared = future.result()  # ValueError: it cannot compile here either
        block_ids = self.scheduler.add_prefilled(request)
        if block_ids is None:
            return False
        self.runner.write_blocks(block_ids, k_blocks, v_blocks)
        if state:
            self.runner.put_state(request.request_id, state)
        if eagle3 is not None and draft_state is not None:  # without it: no drafts until it catches up
            eagle3.import_state(request, block_ids, *draft_state)
        if prepared is not None:  # its matcher catches up on the first token at the next sample
            self.runner.add_constraints(request, prepared)
        return True

    # -- prefill role: hand the KV over ---------------------------------------------

    def export_kv(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill role: a prefilled request's prompt KV, on the CPU for the wire:
        k and v, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim],
        blocks in token order. It stays held here until `release`."""
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise KeyError(f"request {request_id!r} is not held")
        num_blocks = -(-request.num_prompt_tokens // self.config.scheduler.block_size)
        k, v = self.runner.read_blocks(request.block_ids[:num_blocks])
        return k.cpu(), v.cpu()

    def export_draft_state(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Prefill role, with an EAGLE-3 head: what its decode worker needs to draft at
        once, beside the KV (`export_kv`): the head's blocks (k, v each [head layers,
        num_blocks, block_size, kv heads, head_dim]) and its fused features of the last
        prompt position ([hidden]), on the CPU. None without a head."""
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise KeyError(f"request {request_id!r} is not held")
        if self.runner.eagle3 is None:
            return None
        num_blocks = -(-request.num_prompt_tokens // self.config.scheduler.block_size)
        return self.runner.eagle3.export(request_id, request.block_ids[:num_blocks], request.num_prompt_tokens)

    def export_state(self, request_id: str) -> dict[str, torch.Tensor]:
        """Prefill role: a prefilled request's per-request state after its prompt, by name, on
        the CPU for the wire beside the KV ({}: the model has KV only). Its slot is taken back
        now: the request runs no more here."""
        if self.scheduler.get_request(request_id) is None:
            raise KeyError(f"request {request_id!r} is not held")
        return self.runner.export_state(request_id)

    def release(self, request_id: str) -> bool:
        """Prefill role: frees a prefilled request's blocks once the decode
        worker has its KV. False when it is no longer held (aborted meanwhile)."""
        try:
            self.scheduler.release(request_id)
        except ValueError:
            return False
        self.images.remove([request_id])
        return True

    def abort(self, request_ids) -> list[str]:
        """Finishes the requests wherever they are; returns the ids actually aborted."""
        request_ids = list(request_ids)
        parked = [rid for rid in request_ids if self._preparing.pop(rid, None) is not None]
        aborted = parked + self.scheduler.abort(request_ids)
        self.images.remove(aborted)
        self.runner.free_states(aborted)
        return aborted

    # -- one step --------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Whether `step` has work: requests waiting only for an image have none."""
        return self.scheduler.has_unfinished() or bool(self._preparing)

    def step(self) -> StepResult:
        """Admit requests whose grammar is ready, then schedule -> run -> update.
        An exception while running or updating aborts the step's requests and
        raises StepFailed naming them (and the grammars that failed meanwhile)."""
        failed = self._admit_prepared()
        self.images.drop_unused()  # images whose last request left since the last step
        self._propose_drafts()
        reads, unreadable = self._keep_adapters_read()
        failed.update(unreadable)
        out = self.scheduler.schedule()
        self.images.remove(out.dropped_request_ids)
        if reads and not out.scheduled:  # nothing to run until an adapter is read: no busy loop
            wait(reads, timeout=0.01, return_when=FIRST_COMPLETED)
        try:
            runner_out = self.runner.execute(out)
            updates = self.scheduler.update(out, runner_out.sampled_token_ids)
        except GroupFailed:  # not this step's requests' fault: the engine cannot go on (its worker stops)
            raise
        except Exception as exc:
            request_ids = [s.request_id for s in out.scheduled]
            self.abort(request_ids)
            raise StepFailed(request_ids, failed) from exc
        finished = [u.request_id for u in updates if u.is_finished]
        self.images.remove(finished)
        self.runner.free_states(finished)  # now, not at the next step: the slots' usage is true between steps
        logprobs = {u.request_id: runner_out.logprobs[u.request_id][:len(u.new_token_ids)]  # none after a stop
                    for u in updates if u.request_id in runner_out.logprobs}
        return StepResult(updates, logprobs, out.num_batched_tokens,
                          {s.request_id: s.request for s in out.scheduled}, failed, out.dropped_request_ids,
                          runner_out.prompt_logprobs)

    def _propose_drafts(self) -> None:
        """Speculative decoding: a draft for each running request whose next step
        decodes, from its own tokens (n-gram), a draft model's continuation of
        them (one batch for all) or an EAGLE-3 head's. Greedy and sampled requests alike:
        the runner verifies a sampled one by rejection sampling (engine/spec/verify.py),
        which keeps the target's distribution."""
        if self.proposer is None:
            return
        decodes = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        for request, draft in zip(decodes, self.proposer.propose_requests(decodes)):
            request.draft_token_ids = draft

    def _admit_prepared(self) -> dict[str, str]:
        """Moves requests whose adapter is read and grammar compiled into the scheduler;
        returns those that failed. Waits a little only when nothing else could run."""
        if not self._preparing:
            return {}
        if not self.scheduler.has_unfinished():
            wait([f for _, fs in self._preparing.values() for f in fs], timeout=0.01, return_when=FIRST_COMPLETED)
        failed = {}
        for rid, (request, futures) in list(self._preparing.items()):
            if not all(f.done() for f in futures):
                continue
            del self._preparing[rid]
            try:
                results = [f.result() for f in futures]
                self.scheduler.add_request(request)
            except Exception as exc:  # an adapter that cannot be read, a grammar: this request's error
                failed[rid] = str(exc)
                self.images.remove([rid])
                continue
            if GrammarCompilerPool.needs(request.sampling_params):
                self.runner.add_constraints(request, results[-1])
        return failed

    # -- state -----------------------------------------------------------------------

    def get_embedding(self, mm_hash: str) -> MMEntry | None:
        """An image's encoder output while the engine holds it (a request
        still uses it, or the step that drops it has not run yet)."""
        return self.images.get(mm_hash)

    def stats(self) -> dict[str, int | float | list[int]]:
        """The scheduler's gauges and counters, speculative decoding's and state snapshots' among them."""
        return {**self.scheduler.stats(), **self.scheduler.block_manager.snapshot_stats()}

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_waiting_for_images(self) -> int:
        """Requests in the engine that cannot go on until an image arrives."""
        return self.scheduler.num_waiting_for_images

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, as vLLM's KV events
        (none unless --kv-events-config or `kv_events` turned them on)."""
        log = self.scheduler.block_manager.kv_events
        return [] if log is None else log.take()

    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    @property
    def num_state_slots(self) -> int:
        """The per-request state cache's slots (engine/state_cache.py); 0: the model has KV only."""
        cache = self.runner.state_cache
        return 0 if cache is None else cache.num_slots

    def num_free_state_slots(self) -> int:
        cache = self.runner.state_cache
        return 0 if cache is None else cache.num_free

