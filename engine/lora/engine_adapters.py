"""`EngineAdapters`: `EngineCore`'s LoRA verbs (engine/engine_core.py mixes it in), over
its `LoRAManager` (`lora`, None without --enable-lora), scheduler and preparing requests.

    load_lora / prefetch_lora   an adapter read into host memory (waiting / in the loader thread)
    unload_lora                 forgotten at run time, its running requests keeping its weights
    trim_loras                  an idle worker: host memory back to --max-cpu-loras
    lora_state                  the adapters running, waiting and resident (its stats)
"""
from __future__ import annotations

from concurrent.futures import Future

from epd.engine.request import Request
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.wire_values import LoRAState


class EngineAdapters:
    def load_lora(self, lora: LoRARequest) -> None:
        """Reads and checks an adapter into host memory, waiting for it. ValueError unless
        it can run here: LoRA enabled, and the adapter reads and fits the model (its message
        names the field: r above --max-lora-rank, a target the model lacks, another base's shapes)."""
        self._check_lora_enabled(lora)
        self.lora.load(lora)

    def prefetch_lora(self, lora: LoRARequest) -> None:
        """Starts reading an adapter into host memory in the loader thread (a runtime load: ready
        before its first request; `trim_loras` when idle). ValueError when LoRA is not enabled."""
        self._check_lora_enabled(lora)
        self.lora.prefetch(lora)

    def unload_lora(self, lora: LoRARequest) -> bool:
        """Forgets an adapter (runtime unloading), its running requests keeping its weights until
        they end; False when this engine did not hold it."""
        running = {r.lora_request.key for r in self.scheduler.running if r.lora_request is not None}
        return self.lora is not None and self.lora.unload(lora.key, running)

    def trim_loras(self) -> None:
        """An idle worker's loop: host memory back to --max-cpu-loras after runtime loads (no step trims it)."""
        if self.lora is not None and not self.has_unfinished():
            self._keep_adapters_read()

    def _check_lora_enabled(self, lora: LoRARequest) -> None:
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is not enabled (--enable-lora)")

    def _lora_read(self, request: Request) -> Future | None:
        """The read of the request's adapter (LoRAManager.prefetch), None for the base model."""
        if request.lora_request is None:
            return None
        self._check_lora_enabled(request.lora_request)
        return self.lora.prefetch(request.lora_request)

    def _keep_adapters_read(self) -> tuple[list[Future], dict[str, str]]:
        """--max-cpu-loras between steps (LoRAManager.between_steps): the adapters' reads in
        flight, and the waiting requests failed because theirs, evicted after they came, could
        not be read again (its files deleted since): else they would wait for it for ever."""
        if self.lora is None:
            return [], {}
        gone = self.lora.failed_rereads()
        failed = {r.request_id: gone[r.lora_request.key] for r in self.scheduler.waiting
                  if r.lora_request is not None and r.lora_request.key in gone}
        self.abort(list(failed))
        return self.lora.between_steps(self.scheduler.running, self.scheduler.waiting), failed

    def lora_state(self) -> LoRAState | None:
        """The adapters of its running and waiting requests and those resident in its slots,
        by name (its stats: metrics and routing); None without --enable-lora."""
        if self.lora is None:
            return None

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))

        waiting = [*self.scheduler.waiting, *(r for r, _ in self._preparing.values())]
        return LoRAState(names(self.scheduler.running), names(waiting),
                         tuple(dict.fromkeys(name for name, *_ in self.lora.resident)), self.config.lora.max_loras,
                         self.lora.num_host)
