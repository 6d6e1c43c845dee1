"""`--lora-modules`: the adapters `epd serve` serves by name (vLLM's flag and forms).

    --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat", "base_model_name": "qwen"}'

Each becomes a `LoRAModule`; the API maps a request's `model` to its
`LoRARequest` (ids 1, 2, ... in flag order) and lists it in /v1/models with
`parent` (its `base_model_name`, else the served model). Every adapter is read
and checked against the checkpoint before any process starts
(`check_lora_modules`), so a bad one stops `epd serve` with a message naming
the field. Torch-free: the API process imports it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from epd.transport.wire.lora_request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None  # /v1/models' `parent` (None: the served model)


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """`name=path` or vLLM's JSON object form, each; ValueError naming the flag."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({exc})") from None
            unknown = sorted(set(item) - {"name", "path", "base_model_name"}) if isinstance(item, dict) else []
            if not isinstance(item, dict) or unknown or not isinstance(item.get("name"), str) \
                    or not isinstance(item.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: expected {{\"name\": ..., \"path\": ..., "
                                 f"\"base_model_name\"?: ...}}" + (f"; unknown keys {unknown}" if unknown else ""))
            modules.append(LoRAModule(item["name"], item["path"], item.get("base_model_name")))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path or a JSON object, got {value!r}")
            modules.append(LoRAModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name given twice in {names}")
    return tuple(modules)


def lora_requests(modules: tuple[LoRAModule, ...]) -> dict[str, LoRARequest]:
    """Adapter name -> the LoRARequest its requests carry (ids 1.. in flag order; the
    path made absolute: every worker reads it, from its own working directory)."""
    return {m.name: LoRARequest(m.name, i, os.path.abspath(m.path)) for i, m in enumerate(modules, start=1)}


def check_lora_modules(modules: tuple[LoRAModule, ...], served_model_name: str, hf_config,
                       max_lora_rank: int, enable_tower_lora: bool = False) -> None:
    """Every adapter read and checked against the checkpoint (torch-free); ValueError naming
    the adapter and the field (r above --max-lora-rank, a target the model lacks, another base).
    `enable_tower_lora`: its vision tower weights are checked against the tower too (else
    they are ignored, with a warning); on a family whose tower takes no adapter an adapter
    with tower weights is refused, naming it."""
    from epd.encoders.tower_adapter import TowerShapes, read_tower_adapter
    from epd.engine.lora.adapter import ProjectionShapes, read_adapter
    from epd.families.registry import family_of

    shapes = ProjectionShapes.from_hf(hf_config)
    family = family_of(hf_config)
    for module in modules:
        if module.name == served_model_name:
            raise ValueError(f"--lora-modules: {module.name!r} is the served model's own name")
        read_adapter(module.name, module.path, shapes, max_lora_rank, tower=enable_tower_lora)
        if not enable_tower_lora or getattr(hf_config, "vision_config", None) is None:
            continue
        if family.tower_lora:
            read_tower_adapter(module.name, module.path, TowerShapes.from_hf(hf_config), max_lora_rank)
        else:
            refuse_tower_tensors(module.name, module.path, family.name, max_lora_rank)


def refuse_tower_tensors(name: str, path: str, family: str, max_lora_rank: int) -> None:
    """A LoRAAdapterError naming the adapter and a tensor when it adapts the vision tower
    of `family`, whose tower takes no adapter (--enable-tower-lora covers the Qwen towers)."""
    from epd.transport.weights.lora_files import LoRAAdapterError, read_lora_files

    files = read_lora_files(name, path, max_lora_rank)
    keys = files.tower_keys()
    if keys:
        raise LoRAAdapterError(f"{files.where}: tensor {keys[0]!r} (and {len(keys) - 1} more) adapts {family}'s "
                               f"vision tower, which tower LoRA (--enable-tower-lora) does not cover yet; "
                               f"without --enable-tower-lora its tower tensors are ignored, as vLLM does")


class TowerAdapters:
    """Which adapters run on the vision tower (--enable-tower-lora), and the digest of
    their files that keys their images' embeddings apart (transport/embedding_cache/mm_cache.adapted_mm_hash).
    An adapter without tower weights (or tower LoRA off) has none: its requests share the
    base model's embeddings. Each adapter's files are read once (by name, path and id: an
    adapter loaded again at run time gets a new id, and is read again)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._digests: dict[tuple[str, int, str], str | None] = {}

    def digest(self, lora: LoRARequest | None) -> str | None:
        """None: the request's images run through the base tower. ValueError naming the
        adapter when its files cannot be read."""
        if lora is None or not self.enabled:
            return None
        key = (lora.lora_name, lora.lora_int_id, lora.lora_path)
        if key not in self._digests:
            from epd.transport.weights.lora_files import adapter_digest, touches_tower

            try:
                self._digests[key] = adapter_digest(lora.lora_path) if touches_tower(lora.lora_path) else None
            except OSError as exc:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): unreadable ({exc})") from None
        return self._digests[key]


class LoRARegistry:
    """The adapters a request's `model` may name: --lora-modules at start, then those
    loaded and unloaded at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter,
    with --allow-runtime-lora-updating). Ids count on from the flag's (vLLM's rule:
    an id is never reused, so a reloaded adapter is a new one to every cache)."""

    def __init__(self, modules: tuple[LoRAModule, ...] = ()):
        self._modules = {m.name: m for m in modules}
        self._requests = lora_requests(modules)
        self._next_id = len(modules) + 1

    def get(self, name: str) -> LoRARequest | None:
        return self._requests.get(name)

    def module(self, name: str) -> LoRAModule | None:
        return self._modules.get(name)

    @property
    def names(self) -> list[str]:
        """Every adapter's name, in the order they came."""
        return list(self._modules)

    def make(self, name: str, path: str) -> LoRARequest:
        """The LoRARequest an adapter loaded now would carry (not registered yet); its id is
        taken, even if the load fails (as vLLM's counter)."""
        lora = LoRARequest(name, self._next_id, os.path.abspath(path))
        self._next_id += 1
        return lora

    def add(self, module: LoRAModule, lora: LoRARequest) -> None:
        """Registers `make`'s LoRARequest under `module.name`; ValueError if the name is taken."""
        if module.name in self._modules:
            raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
        self._modules[module.name], self._requests[module.name] = module, lora
        self._next_id = max(self._next_id, lora.lora_int_id + 1)

    def remove(self, name: str) -> LoRARequest:
        """Unregisters an adapter; KeyError when there is none of that name."""
        del self._modules[name]
        return self._requests.pop(name)
