"""LoRA on the vision tower (--enable-tower-lora): `TowerLoRA`, one per encoder.

    EncodeRequest.lora --applied(lora)--> host memory (--max-cpu-loras, LRU; read on a miss)
                                      --> a device slot (--max-loras, LRU; written on a miss)
                                      --> the tower's forward with every row adapted

Every linear projection of the tower (encoders/tower_adapter.py lists them)
is wrapped in a `LoRALinear` (transport/weights/lora_linear.py, the language
model's wrapper too; its step: encoders/tower_lora_layer.py) before the
CPU weight packing (transport/weights/cpu_linear.pack_linears), as the engine wraps
its language model. A tower forward runs one adapter (or none) for all its
rows: the encoder batches images by adapter (a block's rows are patches, a
merger's merged tokens, so one row map could not serve both), which keeps
the forward free of gathers. Reads happen in the encoder's own loop (it runs
one forward at a time anyway); a bad adapter fails the images that name it.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from epd.encoders.tower_adapter import TowerAdapterSpec, TowerShapes, read_tower_adapter
from epd.encoders.tower_lora_layer import TowerStep, wrap_tower
from epd.transport.weights.lora_files import WEIGHTS_FILE, LoRAAdapterError
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.wire_values import LoRAState

AdapterKey = tuple[str, str]  # LoRARequest.key


@dataclass(frozen=True)
class TowerLoRASettings:
    """The engine's LoRA limits, as the encoder takes them (it may not import the engine's LoRAConfig)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    @classmethod
    def of(cls, lora_config) -> TowerLoRASettings | None:
        """From the engine's `LoRAConfig` (None unless --enable-tower-lora)."""
        if not lora_config.enable_tower_lora:
            return None
        return cls(lora_config.max_loras, lora_config.max_lora_rank, lora_config.num_cpu_loras)


@dataclass
class _HostAdapter:
    spec: TowerAdapterSpec
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # projection path -> (A, B) on the CPU


class TowerLoRA:
    def __init__(self, tower: nn.Module, settings: TowerLoRASettings):
        self.settings = settings
        self.shapes = TowerShapes.of(tower)
        self.step = TowerStep(settings.max_loras)
        self._wrappers = wrap_tower(tower, settings.max_loras, settings.max_lora_rank, self.step)
        self._host: OrderedDict[AdapterKey, _HostAdapter] = OrderedDict()  # LRU first
        self._slots: OrderedDict[AdapterKey, int] = OrderedDict()  # resident adapters, LRU first
        self.num_loads = 0  # adapters read from disk (a host-memory miss)
        self.num_slot_loads = 0  # adapters written into a slot (a slot miss)

    @contextlib.contextmanager
    def applied(self, lora: LoRARequest | None) -> Iterator[None]:
        """The tower's forwards inside run with `lora`'s tower weights (None: the base tower).
        LoRAAdapterError (a ValueError) naming what is wrong with the adapter."""
        if lora is None:
            yield
            return
        slot = self._activate(lora)
        with self.step.applied(slot):
            yield

    def load(self, lora: LoRARequest) -> TowerAdapterSpec:
        """The adapter's tower part read and checked into host memory (the offline LLM: before any work)."""
        return self._host_entry(lora).spec

    @property
    def resident(self) -> list[AdapterKey]:
        return list(self._slots)

    def state(self, waiting: list[LoRARequest | None]) -> LoRAState:
        """For the encoder's WorkerStats: the adapters of its queued images (`waiting`), those in
        its slots (the encoder router prefers an encoder that holds a request's adapter) and --max-loras."""
        return LoRAState(waiting=tuple(dict.fromkeys(lora.lora_name for lora in waiting if lora is not None)),
                         resident=tuple(name for name, _ in self._slots), max_lora=self.settings.max_loras)

    def _host_entry(self, lora: LoRARequest) -> _HostAdapter:
        entry = self._host.get(lora.key)
        if entry is not None:
            self._host.move_to_end(lora.key)
            return entry
        spec = read_tower_adapter(lora.lora_name, lora.lora_path, self.shapes, self.settings.max_lora_rank)
        from safetensors.torch import load_file

        try:
            tensors = load_file(f"{lora.lora_path}/{WEIGHTS_FILE}")
        except Exception as exc:  # a torn file: the request's error, not the worker's
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): "
                                   f"{WEIGHTS_FILE} is unreadable ({exc})") from None
        entry = self._host[lora.key] = _HostAdapter(spec, {m: (tensors[a], tensors[b])
                                                           for m, (a, b) in spec.tensors.items()})
        self.num_loads += 1
        while len(self._host) > self.settings.max_cpu_loras:
            self._host.popitem(last=False)
        return entry

    def _activate(self, lora: LoRARequest) -> int:
        slot = self._slots.get(lora.key)
        if slot is not None:
            self._slots.move_to_end(lora.key)
            return slot
        entry = self._host_entry(lora)
        used = set(self._slots.values())
        slot = next((s for s in range(self.settings.max_loras) if s not in used), None)
        if slot is None:
            slot = self._slots.pop(next(iter(self._slots)))  # the least recently used
        for path, wrapper in self._wrappers.items():
            wrapper.set_slot(slot, {path: entry.weights[path]} if path in entry.weights else {})
        self.step.scaling[slot] = entry.spec.scaling
        self._slots[lora.key] = slot
        self.num_slot_loads += 1
        return slot

