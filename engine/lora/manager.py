"""Where a worker's adapters are: read in host memory, resident in device slots.

    requests' LoRARequest --load--> host cache (at most --max-cpu-loras, LRU)
                          --activate (each step)--> device slots (--max-loras, LRU)

`load` reads and checks an adapter the first time a request names it (a bad
one fails that request with the adapter's message) and keeps its tensors in
host memory. `activate` gives every adapter of a step a slot, writing the
weights of one that is not resident over the least recently used slot no
adapter of this step holds; the scheduler never runs more distinct adapters
in one step than there are slots (`Scheduler`'s `max_loras`). `rows` turns
the step's per-token adapters into the groups `LoRALinear` adds deltas to.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from epd.engine.lora.adapter import WEIGHTS_FILE, AdapterSpec, ProjectionShapes, read_adapter
from epd.engine.lora.config import LoRAConfig
from epd.engine.lora.layers import LoRAStep, SlotRows, wrap_model
from epd.transport.lora_request import LoRARequest

AdapterKey = tuple[str, str]  # (lora_name, lora_path): LoRARequest.key


@dataclass
class _HostAdapter:
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B) on the CPU


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig):
        self.config = config
        self.shapes = ProjectionShapes.of(model.cfg)
        self.step = LoRAStep(config.max_loras)
        self._wrappers = wrap_model(model, config.max_loras, config.max_lora_rank, self.step)
        self._host: OrderedDict[AdapterKey, _HostAdapter] = OrderedDict()  # LRU first
        self._slots: OrderedDict[AdapterKey, int] = OrderedDict()  # resident adapters, LRU first
        self.num_loads = 0  # adapters read from disk (a host-cache miss)
        self.num_slot_loads = 0  # adapters written into a device slot (a slot miss)

    # -- host memory ---------------------------------------------------------------

    def load(self, lora: LoRARequest) -> AdapterSpec:
        """The adapter read and checked, from the host cache or its directory.
        LoRAAdapterError (a ValueError) naming what is wrong."""
        entry = self._host.get(lora.key)
        if entry is not None:
            self._host.move_to_end(lora.key)
            return entry.spec
        spec = read_adapter(lora.lora_name, lora.lora_path, self.shapes, self.config.max_lora_rank)
        from safetensors.torch import load_file

        tensors = load_file(f"{lora.lora_path}/{WEIGHTS_FILE}")
        weights = {k: (tensors[a], tensors[b]) for k, (a, b) in spec.tensors.items()}
        self._host[lora.key] = _HostAdapter(spec, weights)
        self.num_loads += 1
        while len(self._host) > self.config.num_cpu_loras:
            self._host.popitem(last=False)  # a resident one keeps its slot; it is read again if needed there
        return spec

    # -- device slots ------------------------------------------------------------------

    def activate(self, loras: list[LoRARequest]) -> dict[AdapterKey, int]:
        """A slot for each distinct adapter of a step (at most `max_loras` of them)."""
        wanted = list(dict.fromkeys(lora.key for lora in loras))
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, but --max-loras is {self.config.max_loras}")
        by_key = {lora.key: lora for lora in loras}
        for key in wanted:
            if key in self._slots:
                self._slots.move_to_end(key)
                continue
            self._write_slot(by_key[key], self._free_slot(set(wanted)))
        return {key: self._slots[key] for key in wanted}

    def _free_slot(self, keep: set[AdapterKey]) -> int:
        used = set(self._slots.values())
        free = next((s for s in range(self.config.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(k for k in self._slots if k not in keep)  # LRU among those this step does not run
        return self._slots.pop(victim)

    def _write_slot(self, lora: LoRARequest, slot: int) -> None:
        self.load(lora)
        entry = self._host[lora.key]
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), pair in entry.weights.items():
            by_layer.setdefault(layer, {})[module] = pair
        for layer, wrapper in self._wrappers:
            wrapper.set_slot(slot, by_layer.get(layer, {}))
        self.step.scaling[slot] = entry.spec.scaling
        self._slots[lora.key] = slot
        self.num_slot_loads += 1

    # -- one step ------------------------------------------------------------------------

    def rows(self, token_slots: list[int], device: torch.device) -> list[SlotRows]:
        """Per token of the step its slot (-1: no adapter) -> the groups of rows per slot."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(token_slots):
            return [SlotRows(next(iter(by_slot)), None)]  # every row, one adapter: no gather
        return [SlotRows(slot, torch.tensor(rows, dtype=torch.long, device=device))
                for slot, rows in by_slot.items()]

    @contextlib.contextmanager
    def applied(self, groups: list[SlotRows]) -> Iterator[None]:
        with self.step.applied(groups):
            yield
