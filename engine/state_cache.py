"""The state cache beside the paged KV: one slot per running request of every state-carrying layer.

A model whose layers carry per-request state (a Gated DeltaNet layer's conv and recurrent state)
declares it: `state_shapes()` lists, per such layer, one request's (conv state, recurrent state)
shapes. The cache holds `num_slots` of each, allocated once beside the KV cache and budgeted
with it (`bytes_per_slot`). The runner gives a request a slot the first step it runs and takes
it back when the request finishes, is aborted or released, or is preempted (recomputed from
its first token, it starts again from zeros); the layers read and write the slots named in the
step's `ForwardBatch`. A step that verifies drafts keeps each draft's state after each of its
positions, and the runner `roll_back`s a slot to the last accepted one. There are as many slots as `max_num_seqs`, and the scheduler never runs
more requests than that, so a request it admits always finds one (docs/decisions/state-cache.md).

Between workers (e-p-d) a request's state travels as named tensors (`names`: `conv.<i>` and
`recurrent.<i>` of its i-th such layer): the prefill worker `export`s it when the prompt is done
(its slot taken back: the request runs no more there), the decode worker `put`s it, checked,
and the slot the request gets at its first step starts from it.

For prefix caching a `SnapshotPool` keeps copies of slots at block boundaries: the scheduler's
block manager picks where (engine/state_snapshots.py, docs/decisions/state-snapshots.md), the
runner copies a slot into a snapshot after a step and a snapshot into the slot of a request
whose prefix hit resumes there, before the step.
"""
from __future__ import annotations

from math import prod

import torch

from epd.engine.scheduler_config import SchedulerConfig


StateShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]  # per layer: (conv state, recurrent state) of one request


def state_shapes(model) -> StateShapes:
    """The model's per-request state shapes; [] for a model with KV only."""
    declared = getattr(model, "state_shapes", None)
    return declared() if declared is not None else []


STATEFUL_SPEC_METHODS = ("ngram", "mtp")  # speculation verified with the state rolled back (roll_back)


def check_stateful_engine(spec_method: str | None) -> None:
    """ValueError for what an engine cannot run yet with a model whose layers carry per-request
    state: speculation other than STATEFUL_SPEC_METHODS (not tested over such a model yet: a draft
    model of this kind would carry state of its own that nothing rolls back)."""
    if spec_method is not None and spec_method not in STATEFUL_SPEC_METHODS:
        raise ValueError(f"speculative decoding with method {spec_method!r} is not supported yet for a model whose "
                         f"layers carry per-request state; use {' or '.join(STATEFUL_SPEC_METHODS)}")


def num_state_snapshots(config: SchedulerConfig) -> int:
    """How many state snapshots (`SnapshotPool`) a model with per-request state keeps for prefix
    caching: one per slot (`max_num_seqs`), so each running request's prompt snapshot can outlive
    it; 0 with prefix caching off."""
    return config.max_num_seqs if config.enable_prefix_caching else 0


def bytes_per_slot(shapes: StateShapes, dtype: torch.dtype) -> int:
    """One request's state in every layer: the conv state in the model's dtype, the recurrent one in float32."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(element * prod(conv) + 4 * prod(rec) for conv, rec in shapes)


class StateCache:
    def __init__(self, shapes: StateShapes, num_slots: int, dtype: torch.dtype, device: torch.device):
        # per layer: conv states [num_slots, *conv] (model dtype), recurrent states [num_slots, *rec] (float32)
        self.layers = [(torch.zeros(num_slots, *conv, dtype=dtype, device=device),
                        torch.zeros(num_slots, *rec, dtype=torch.float32, device=device)) for conv, rec in shapes]
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._slots: dict[str, int] = {}  # request id -> its slot
        self._arrived: dict[str, dict[str, torch.Tensor]] = {}  # request id -> state from a prefill worker (`put`)

    def slot(self, request_id: str) -> int:
        """The request's slot, given now if it has none (its state is then the one `put` for it,
        or whatever the slot held: the layers start a sequence's first chunk from zeros, never
        from the slot)."""
        slot = self._slots.get(request_id)
        if slot is None:
            assert self._free, "more running requests than state slots (max_num_seqs)"
            slot = self._slots[request_id] = self._free.pop()
            arrived = self._arrived.pop(request_id, None)
            if arrived is not None:
                for name, slots in self._named():
                    slots[slot] = arrived[name]
        return slot

    def free(self, request_ids) -> None:
        """Takes back the slots of requests that finished, left or were preempted (unknown ids: nothing)."""
        for request_id in request_ids:
            self._arrived.pop(request_id, None)
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def roll_back(self, slot: int, checkpoints: dict[int, tuple[torch.Tensor, torch.Tensor]], row: int,
                  position: int) -> None:
        """Sets `slot` to the state after `position` (0-based, < the draft's length d) of a verified
        draft: `checkpoints` are the step's (`ForwardBatch.state_checkpoints`: layer -> (conv,
        recurrent), each [num_drafts, longest d, ...]), `row` the draft's among them. Speculative
        decoding calls it when the target rejects the draft's tokens after `position`."""
        for i, (conv, rec) in enumerate(self.layers):
            conv[slot], rec[slot] = checkpoints[i][0][row, position], checkpoints[i][1][row, position]

    def names(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One request's state tensors by name: `conv.<i>`, `recurrent.<i>` of the i-th layer -> (shape, dtype)."""
        return {name: (tuple(slots.shape[1:]), slots.dtype) for name, slots in self._named()}

    def _named(self):
        """(name, every slot's tensor) of each state tensor: `conv.<i>`, `recurrent.<i>` of the i-th layer."""
        for i, (conv, rec) in enumerate(self.layers):
            yield f"conv.{i}", conv
            yield f"recurrent.{i}", rec

    def export(self, request_id: str) -> dict[str, torch.Tensor]:
        """The request's state on the CPU, by name (`names`), and its slot taken back. KeyError
        if it holds none (it never ran)."""
        slot = self._slots[request_id]
        state = {name: slots[slot].cpu() for name, slots in self._named()}
        self.free([request_id])
        return state

    def check(self, state: dict[str, torch.Tensor]) -> None:
        """ValueError unless `state` holds exactly this cache's named tensors (`names`), each
        of its shape and a floating dtype (e.g. a prefill worker of another model)."""
        want = self.names()
        if set(state) != set(want):
            missing, unknown = sorted(set(want) - set(state)), sorted(set(state) - set(want))
            raise ValueError(f"the per-request state does not fit this model's: missing {missing[:4]}"
                             f"{'...' if len(missing) > 4 else ''}, unknown {unknown[:4]}"
                             f"{'...' if len(unknown) > 4 else ''}")
        for name, (shape, _) in want.items():
            t = state[name]
            if tuple(t.shape) != shape or not t.dtype.is_floating_point:
                raise ValueError(f"per-request state {name!r} is {t.dtype} {list(t.shape)}: "
                                 f"want a floating tensor {list(shape)}")

    def put(self, request_id: str, state: dict[str, torch.Tensor]) -> None:
        """A request's state from a prefill worker (`check`ed first): the slot it gets at its
        first step (`slot`) starts from it; gone if it leaves before."""
        self.check(state)
        self._arrived[request_id] = {name: t.to(self.layers[0][0].device) for name, t in state.items()}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The share of slots held, 0..1."""
        return len(self._slots) / self.num_slots


class SnapshotPool:
    """Copies of state slots at block boundaries, for prefix hits (engine/state_snapshots.py
    says which index holds which block's): `num_snapshots` of each of a `StateCache`'s tensors,
    budgeted with it (`bytes_per_slot` each)."""

    def __init__(self, cache: StateCache, num_snapshots: int):
        # per layer: conv [num_snapshots, *conv], recurrent [num_snapshots, *rec], as the cache's
        self.layers = [(conv.new_zeros(num_snapshots, *conv.shape[1:]), rec.new_zeros(num_snapshots, *rec.shape[1:]))
                       for conv, rec in cache.layers]
        self.cache = cache
        self.num_snapshots = num_snapshots

    def save(self, slot: int, index: int) -> None:
        """Snapshot `index` := the state in `slot`."""
        for (conv, rec), (snap_conv, snap_rec) in zip(self.cache.layers, self.layers):
            snap_conv[index] = conv[slot]
            snap_rec[index] = rec[slot]

    def restore(self, index: int, slot: int) -> None:
        """The state in `slot` := snapshot `index`."""
        for (conv, rec), (snap_conv, snap_rec) in zip(self.cache.layers, self.layers):
            conv[slot] = snap_conv[index]
            rec[slot] = snap_rec[index]
