"""A LoRA adapter in PEFT's format, read and checked against the model it is to run on.

A PEFT adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`,
`use_rslora`, `target_modules`, ...) and `adapter_model.safetensors` holding,
per targeted projection, `...layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`
[r, in_features] and `lora_B.weight` [out_features, r]. The delta it adds to a
projection's output is `x @ A^T @ B^T * scaling`, with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`).

`read_adapter` does every check without torch (the config and the
safetensors header only), so `epd serve` refuses a bad `--lora-modules`
entry before any worker starts, and a worker refuses one a request names:
a rank above `--max-lora-rank`, a target the language model lacks, or
shapes of another base model, each with a message naming the field or the
tensor. Weights of the vision tower are ignored with a warning, as vLLM
does (tower adapters are a later step of issue 28). `load_weights` then
reads the tensors (torch).
"""
from __future__ import annotations

import json
import logging
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("epd.lora")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The language model's projections an adapter may target (PEFT's module names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
_LORA_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\.lora_([AB])(?:\.default)?\.weight$")
_TOWER_KEY = re.compile(r"(?:^|\.)visual\.")


class LoRAAdapterError(ValueError):
    """The adapter cannot run on this model; the message names the field or tensor."""


@dataclass(frozen=True)
class ProjectionShapes:
    """What an adapter must fit: (in_features, out_features) of each projection,
    the number of layers, and the layers whose MLP is a mixture of experts
    (no adapter on their gate/up/down: the experts have no such projection)."""

    num_layers: int
    sizes: dict[str, tuple[int, int]]
    moe_layer_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg) -> ProjectionShapes:
        """From the engine's `TextConfig` (or anything with its fields)."""
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return cls(cfg.num_layers, {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                                    "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)},
                   frozenset(cfg.moe_layer_ids))

    @classmethod
    def from_hf(cls, hf_config) -> ProjectionShapes:
        """From a transformers config without loading model code (the API process has no
        torch): the engine's rules for head_dim and MoE layers (models/qwen2_5_vl.py,
        qwen3_vl_moe.py), checked equal to `of(TextConfig)` by the tests."""
        tc = hf_config.text_config
        model_type = getattr(hf_config, "model_type", "")
        head_dim = tc.hidden_size // tc.num_attention_heads
        if model_type != "qwen2_5_vl":
            head_dim = getattr(tc, "head_dim", None) or head_dim
        moe: tuple[int, ...] = ()
        if model_type == "qwen3_vl_moe":
            mlp_only = set(getattr(tc, "mlp_only_layers", None) or ())
            step = int(getattr(tc, "decoder_sparse_step", 1) or 1)
            moe = tuple(i for i in range(tc.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)
        return cls.of(_Dims(tc.hidden_size, tc.intermediate_size, tc.num_attention_heads,
                            tc.num_key_value_heads or tc.num_attention_heads, head_dim, tc.num_hidden_layers, moe))


@dataclass(frozen=True)
class _Dims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    moe_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, scaling, and per (layer, module) the names of
    its A and B tensors in `adapter_model.safetensors`."""

    name: str
    path: str
    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.tensors}


def read_adapter(name: str, path: str | Path, shapes: ProjectionShapes, max_lora_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against `shapes` and `max_lora_rank` (torch-free).
    LoRAAdapterError naming what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    cfg = _read_config(Path(path), where)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive int, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{where}: r = {rank} is above --max-lora-rank {max_lora_rank}")
    if type(alpha) not in (int, float):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    _check_unsupported(cfg, where)
    _check_target_names(cfg.get("target_modules"), where)
    header = _read_header(Path(path) / WEIGHTS_FILE, where)
    tensors = _pair_tensors(header, shapes, rank, where)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(name, str(path), rank, float(scaling), tensors)


def _read_config(path: Path, where: str) -> dict:
    if not (path / CONFIG_FILE).is_file():
        raise LoRAAdapterError(f"{where}: no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _check_unsupported(cfg: dict, where: str) -> None:
    """PEFT options that change the math beyond x @ A^T @ B^T * scaling: refused, named."""
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{where}: use_dora is not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if cfg.get(name):
            raise LoRAAdapterError(f"{where}: {name} (per-module ranks or alphas) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not supported "
                               f"(an adapter may only add to {', '.join(SUPPORTED_MODULES)})")


def _check_target_names(targets, where: str) -> None:
    """A list of module names must name projections of the language model (a regex
    string, PEFT's other form, is checked through the tensors it produced)."""
    if not isinstance(targets, list):
        return
    lacking = [t for t in targets if t not in SUPPORTED_MODULES]
    if lacking:
        raise LoRAAdapterError(f"{where}: target_modules {lacking} are not projections this model's language "
                               f"model has (supported: {', '.join(SUPPORTED_MODULES)})")


def _read_header(path: Path, where: str) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} from a safetensors file's header."""
    if not path.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization)" \
            if (path.parent / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"{where}: no {WEIGHTS_FILE}{extra}")
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def _pair_tensors(header: dict[str, dict], shapes: ProjectionShapes, rank: int, where: str
                  ) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) -> (A name, B name), every shape checked; tower tensors skipped."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    num_tower = 0
    for key, meta in header.items():
        if _TOWER_KEY.search(key):
            num_tower += 1
            continue
        m = _LORA_KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a language-model "
                                   f"projection (target_modules may only be {', '.join(SUPPORTED_MODULES)})")
        layer, module, which = int(m[1]), m[3], m[4]
        _check_tensor(key, meta, layer, module, which, shapes, rank, where)
        found.setdefault((layer, module), {})[which] = key
    if num_tower:
        log.warning("%s: %d tensors of the vision tower ignored (LoRA runs on the language model only)",
                    where, num_tower)
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} has lora_{next(iter(pair))} "
                                   f"but no lora_{'B' if 'A' in pair else 'A'}")
    if not found:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weight of the language model")
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}


def _check_tensor(key: str, meta: dict, layer: int, module: str, which: str, shapes: ProjectionShapes,
                  rank: int, where: str) -> None:
    if module not in SUPPORTED_MODULES:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module!r}, which this model's "
                               f"language model lacks (supported: {', '.join(SUPPORTED_MODULES)})")
    if layer >= shapes.num_layers:
        raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the model has "
                               f"{shapes.num_layers} layers (an adapter for another base model?)")
    if module in MLP_MODULES and layer in shapes.moe_layer_ids:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module} of layer {layer}, "
                               f"a mixture-of-experts layer without that projection")
    in_features, out_features = shapes.sizes[module]
    want = [rank, in_features] if which == "A" else [out_features, rank]
    shape = list(meta.get("shape", []))
    if shape != want:
        raise LoRAAdapterError(f"{where}: tensor {key!r} has shape {shape}, expected {want} "
                               f"(r = {rank}; {module} is {in_features} -> {out_features} in this model: "
                               f"an adapter for another base model?)")
