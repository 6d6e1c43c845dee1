"""Where a worker's adapters are: read in host memory, resident in device slots.

    requests' LoRARequest --load--> host cache (at most --max-cpu-loras, LRU)
                          --activate (each step)--> device slots (--max-loras, LRU)

`prefetch` reads and checks an adapter in the loader thread the first time a
request names it (a bad one fails that request with the adapter's message) and
keeps its tensors in host memory: the engine admits the request when the read
is done, so a slow read never stalls the step loop and the requests it runs
(`load` waits for it: the offline `LLM`, which checks adapters before any
work). Host memory is trimmed back to --max-cpu-loras between steps
and on an idle worker's loop (`keep_read`), never dropping a running
request's adapter; an adapter
evicted before its request runs (more adapters in flight than
--max-cpu-loras) is read again in the loader thread, and the scheduler
admits its request once it is read (`weights_of`): no step reads a disk.
Each read hashes the adapter's files (`weights_of`: the request's
`lora_weights`), and slots and the prefix cache key an adapter by name, path
and that digest: one retrained in place and read again is another adapter,
never served the KV or the slot of its old weights. Every error reading an
adapter (files gone, unreadable, torn) is a LoRAAdapterError naming it: it
fails the requests that named it, never the worker. An adapter unloaded at
run time while requests run with it is retired, not dropped: they keep its
weights until they end (`unload`, `keep_read`). An adapter with no
language-model weight (a tower-only one, --enable-tower-lora) reads as ""
and takes no slot: the base language model runs its requests.
`activate` gives every adapter of a step a slot, writing the weights of one that is not resident over the least recently used slot no
adapter of this step holds; the scheduler never runs more distinct adapters
in one step than there are slots (`Scheduler`'s `max_loras`). `rows` turns
the step's per-token adapters into the rows `LoRALinear` adds deltas to
(groups for torch, tiles for the Triton kernels when `use_triton`).
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.lora.adapter import (WEIGHTS_FILE, AdapterSpec, LoRAAdapterError, ProjectionShapes, read_adapter,
                                     split_fused)
from epd.engine.lora.config import LoRAConfig
from epd.engine.lora.layers import LoRAStep, wrap_model
from epd.engine.lora.step_rows import StepRows, step_rows
from epd.transport.weights.lora_files import adapter_digest
from epd.transport.wire.lora_request import LoRARequest

AdapterKey = tuple[str, str]  # (lora_name, lora_path): LoRARequest.key, what is read
WeightsKey = tuple[str, str, str]  # (lora_name, lora_path, digest of the files read): Request.lora_key


@dataclass
class _HostAdapter:
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B) on the CPU
    digest: str  # of the files read (transport/weights/lora_files.adapter_digest)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, use_triton: bool = False):
        """`use_triton`: the gathered matmul in the Triton kernels (a GPU), else in torch."""
        self.config, self.use_triton = config, use_triton
        self.shapes = ProjectionShapes.of(model.cfg)
        self.step = LoRAStep(config.max_loras)
        self._wrappers = wrap_model(model, config.max_loras, config.max_lora_rank, self.step)
        self._host: OrderedDict[AdapterKey, _HostAdapter] = OrderedDict()  # LRU first
        self._slots: OrderedDict[WeightsKey, int] = OrderedDict()  # resident adapters, LRU first
        self._lock = threading.Lock()  # `_host` and `_reading`: the loader thread adds, the step thread reads
        self._reading: dict[AdapterKey, Future] = {}  # adapters being read, by the loader thread
        # unloaded while requests ran with them: kept (step thread only) until they end
        self._retired: dict[AdapterKey, _HostAdapter] = {}
        self._rereads: dict[AdapterKey, Future] = {}  # read again for waiting requests (`between_steps`)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self.num_loads = 0  # adapters read from disk (a host-cache miss)
        self.num_slot_loads = 0  # adapters written into a device slot (a slot miss)

    # -- host memory ---------------------------------------------------------------

    def prefetch(self, lora: LoRARequest) -> Future:
        """Future[_HostAdapter]: done at once when the adapter is in host memory, else
        read and checked in the loader thread (one read per adapter however many ask);
        its exception is a LoRAAdapterError (a ValueError) naming what is wrong."""
        with self._lock:
            entry = self._host.get(lora.key)
            if entry is not None:
                self._host.move_to_end(lora.key)
                done: Future = Future()
                done.set_result(entry)
                return done
            future = self._reading.get(lora.key)
            if future is None:
                future = self._reading[lora.key] = self._loader.submit(self._read, lora)
            return future

    def load(self, lora: LoRARequest) -> AdapterSpec:
        """The adapter read and checked, waiting for the read. LoRAAdapterError naming what is wrong."""
        return self.prefetch(lora).result().spec

    def is_loaded(self, key: AdapterKey) -> bool:
        """Whether the adapter is in host memory."""
        with self._lock:
            return key in self._host

    def weights_of(self, lora: LoRARequest) -> str | None:
        """The digest of the adapter's files as read into host memory (a request's
        `lora_weights`), "" when they hold no language-model weight (a tower-only
        adapter: no slot, the base language model); None when it is not read."""
        with self._lock:
            entry = self._host.get(lora.key)
        if entry is None:
            return None
        return entry.digest if entry.weights else ""

    def unload(self, key: AdapterKey, running: set[AdapterKey] = frozenset()) -> bool:
        """Forgets an adapter (runtime unloading): out of host memory, so a request naming
        it again reads it again. While requests in `running` use it (the step thread's
        view), its weights are retired instead, theirs until they end (`keep_read` drops
        them): no step reads a disk for them. False when it was not held."""
        with self._lock:
            entry = self._host.pop(key, None)
        in_slot = any(k[:2] == key for k in self._slots)
        if entry is not None and key in running:
            self._retired[key] = entry
        elif key not in running:
            self._retired.pop(key, None)
            for k in [k for k in self._slots if k[:2] == key]:
                del self._slots[k]
        return entry is not None or in_slot

    @property
    def num_host(self) -> int:
        """Adapters held in host memory (at most --max-cpu-loras beside those retired
        for their running requests, and a step's reads in flight)."""
        with self._lock:
            return len(self._host) + len(self._retired)

    def keep_read(self, running: set[AdapterKey], wanted: list[LoRARequest]) -> dict[AdapterKey, Future]:
        """Between two steps (the step thread): host memory back to --max-cpu-loras, least
        recently used first, never the adapter of a running request (`running`: at most
        --max-loras of them with language-model weights, and tower-only ones, which hold no
        tensor) or one in `wanted` (those of the waiting requests next in line,
        at most --max-cpu-loras less the running ones); then the reads of the `wanted`
        adapters evicted earlier start in the loader thread. Returns those reads' futures by adapter.

        Only this thread evicts, so an adapter the scheduler sees read (`weights_of`) stays
        read until the step that admits its request has written it into a slot, and a running
        request's adapter is always read: a step never waits for a disk."""
        keep = running | {lora.key for lora in wanted}
        for key in [k for k in self._retired if k not in running]:
            del self._retired[key]  # its last request ended
        with self._lock:
            excess = len(self._host) - self.config.num_cpu_loras
            for key in [k for k in self._host if k not in keep][:max(0, excess)]:
                del self._host[key]  # a resident one keeps its slot
            missing = [lora for lora in wanted if lora.key not in self._host]
        return {lora.key: self.prefetch(lora) for lora in missing}

    def between_steps(self, running: list, waiting: list) -> list[Future]:
        """`keep_read` for the scheduler's `running` and `waiting` requests: theirs stay in host
        memory, and those of the waiting requests next in line (as many as there is room for,
        and that --max-loras would let run) are read again if they were evicted, in the loader
        thread; the scheduler admits a request once its adapter is read. Returns the reads."""
        keys = {r.lora_request.key for r in running if r.lora_request is not None}
        in_slots = {r.lora_key for r in running if r.lora_key is not None}  # not tower-only ones
        room, is_full = self.config.num_cpu_loras - len(in_slots), len(in_slots) >= self.config.max_loras
        wanted: dict[AdapterKey, LoRARequest] = {}
        for request in waiting:
            if len(wanted) >= room:
                break
            lora = request.lora_request
            if lora is not None and lora.key not in keys and (not is_full or request.lora_weights == ""):
                wanted.setdefault(lora.key, lora)
        reads = self.keep_read(keys, list(wanted.values()))
        self._rereads.update(reads)
        return list(reads.values())

    def failed_rereads(self) -> dict[AdapterKey, str]:
        """The adapters `between_steps` read again that failed since the last call, with why."""
        done = {key: read for key, read in self._rereads.items() if read.done()}
        for key in done:
            del self._rereads[key]
        return {key: str(read.exception()) for key, read in done.items() if read.exception() is not None}

    @property
    def resident(self) -> list[WeightsKey]:
        """The adapters in device slots, least recently used first."""
        return list(self._slots)

    def _read(self, lora: LoRARequest) -> _HostAdapter:
        """The loader thread: the adapter from its directory into host memory. Any error is
        a LoRAAdapterError naming the adapter (files deleted or unreadable since it was
        loaded: the request's error, never the worker's)."""
        from safetensors.torch import load_file

        where = f"LoRA adapter {lora.lora_name!r} ({lora.lora_path})"
        try:
            # the header first (its size bounded), then the digest before the tensors: files
            # rewritten during this read differ by the next
            spec = read_adapter(lora.lora_name, lora.lora_path, self.shapes, self.config.max_lora_rank,
                                tower=self.config.enable_tower_lora)
            digest = adapter_digest(lora.lora_path)
            try:
                tensors = load_file(f"{lora.lora_path}/{WEIGHTS_FILE}")
            except Exception as exc:  # a torn or truncated file
                raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is unreadable ({exc})") from None
            weights = split_fused({k: (tensors[a], tensors[b]) for k, (a, b) in spec.tensors.items()})
            entry = _HostAdapter(spec, weights, digest)
            with self._lock:  # evicted by the step thread (`keep_read`), never here: see there
                self._host[lora.key] = entry
                self.num_loads += 1
            return entry
        except LoRAAdapterError:
            raise
        except FileNotFoundError:
            raise LoRAAdapterError(f"{where}: its files are gone (deleted since it was loaded?)") from None
        except Exception as exc:  # unreadable (permissions, I/O), torn while read
            raise LoRAAdapterError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None
        finally:
            with self._lock:
                self._reading.pop(lora.key, None)

    # -- device slots ------------------------------------------------------------------

    def activate(self, adapters: dict[WeightsKey, LoRARequest]) -> dict[WeightsKey, int]:
        """A slot for each distinct adapter of a step (at most `max_loras` of them), by the
        weights its requests run (`Request.lora_key`), each with the LoRARequest it is read from."""
        if len(adapters) > self.config.max_loras:
            raise RuntimeError(f"{len(adapters)} adapters in one step, but --max-loras is {self.config.max_loras}")
        for key, lora in adapters.items():
            if key in self._slots:
                self._slots.move_to_end(key)
                continue
            self._write_slot(lora, key, self._free_slot(set(adapters)))
        return {key: self._slots[key] for key in adapters}

    def _free_slot(self, keep: set[WeightsKey]) -> int:
        used = set(self._slots.values())
        free = next((s for s in range(self.config.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(k for k in self._slots if k not in keep)  # LRU among those this step does not run
        return self._slots.pop(victim)

    def _write_slot(self, lora: LoRARequest, key: WeightsKey, slot: int) -> None:
        # in host memory (`keep_read`), or retired (unloaded at run time while its request ran)
        with self._lock:
            entry = next((e for e in (self._host.get(lora.key), self._retired.get(lora.key))
                          if e is not None and e.digest == key[2]), None)
        if entry is None:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): its weights "
                                   f"are not in host memory")  # an invariant: a step never reads a disk
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in entry.weights.items():
            by_layer.setdefault(layer, {})[module] = pair
        for layer, wrapper in self._wrappers:
            wrapper.set_slot(slot, by_layer.get(layer, {}))
        self.step.scaling[slot] = entry.spec.scaling
        self._slots[key] = slot
        self.num_slot_loads += 1

    # -- one step ------------------------------------------------------------------------

    def rows(self, token_slots: list[int], device: torch.device) -> StepRows:
        """Per token of the step its slot (-1: no adapter) -> the rows `LoRALinear` adds deltas to."""
        return step_rows(token_slots, self.step.scaling, device, self.use_triton)

    @contextlib.contextmanager
    def applied(self, rows: StepRows) -> Iterator[None]:
        with self.step.applied(rows):
            yield
