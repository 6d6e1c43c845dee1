"""A LoRA adapter in PEFT's format, read and checked against the language model it is to run on.

A PEFT adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`,
`use_rslora`, `target_modules`, ...) and `adapter_model.safetensors` holding,
per targeted projection, `...layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`
[r, in_features] and `lora_B.weight` [out_features, r] (a Gated DeltaNet layer's
`...layers.<i>.linear_attn.<proj>`: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
out_proj; its full-attention layers' q_proj gives each head's query and output gate, so
its B has twice the query's rows; a MoE layer's shared expert `...mlp.shared_expert.<proj>`).
A model whose transformers class fuses gate and up (GLM-4.1V's `mlp.gate_up_proj`) gets
adapters on the fused projection: one A, and a B over both halves
(`split_fused` gives each half its own pair, the same delta). The delta it adds to a
projection's output is `x @ A^T @ B^T * scaling`, with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`); transport/weights/lora_files.py reads the
files and checks what both sides share.

`read_adapter` does every check without torch (the config and the
safetensors header only), so `epd serve` refuses a bad `--lora-modules`
entry before any worker starts, and a worker refuses one a request names:
a rank above `--max-lora-rank`, a target the language model lacks, or
shapes of another base model, each with a message naming the field or the
tensor. Weights of the vision tower are the encoders' with
`--enable-tower-lora` (encoders/tower_adapter.py checks them; an adapter may
then hold only those); without it they are ignored with a warning, as vLLM
does. `load_weights` then reads the tensors (torch).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from epd.transport.weights.lora_files import (CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, check_pairs, check_shape,
                                      is_tower_key, read_lora_files)

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "LoRAAdapterError", "ProjectionShapes", "AdapterSpec", "read_adapter",
           "split_fused"]

log = logging.getLogger("epd.lora")

# The language model's projections an adapter may target (PEFT's module names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# a projection transformers' model fuses, as PEFT targets it -> the pieces it stands for, in its output's
# order (GLM-4.1V's MLP: gate then up; vLLM's glm4_1v packs "gate_up_proj" as itself)
FUSED_MODULES = {"gate_up_proj": ("gate_proj", "up_proj")}
# a Gated DeltaNet layer's projections (Qwen3.5's linear attention), as transformers names them; vLLM
# packs in_proj_qkv + in_proj_z and in_proj_b + in_proj_a, here each is its own projection
LINEAR_ATTENTION_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# a MoE layer's shared expert (Qwen3.5-MoE's `mlp.shared_expert.<proj>`): a dense SwiGLU MLP, adapted as
# one (its routed experts are not); named apart from the dense MLP's
SHARED_EXPERT_MODULES = tuple(f"shared_expert.{m}" for m in MLP_MODULES)
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES + tuple(FUSED_MODULES) + LINEAR_ATTENTION_MODULES
# modules of the language model PEFT can adapt and EPD does not: refused by name
UNADAPTED_MODULES = {"conv1d": "the Gated DeltaNet layers' causal convolution", "gate": "a mixture of experts' router",
                     "shared_expert_gate": "a mixture of experts' shared-expert gate"}
# The last name of a vision tower's linear projections (Qwen3-VL: blocks' qkv, proj, linear_fc1/2 and the
# mergers' linear_fc1/2; Qwen2.5-VL: qkv, proj, gate/up/down_proj, the merger's mlp.0 / mlp.2)
TOWER_MODULE_NAMES = ("qkv", "proj", "linear_fc1", "linear_fc2", "0", "2") + MLP_MODULES
_LORA_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp\.shared_expert|mlp|linear_attn)\.(\w+?)"
                       r"\.lora_([AB])(?:\.default)?\.weight$")
_EXPERTS_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.")  # routed experts' tensors (PEFT's target_parameters)


@dataclass(frozen=True)
class ProjectionShapes:
    """What an adapter must fit: (in_features, out_features) of each projection,
    the number of layers, the layers whose MLP is a mixture of experts
    (no adapter on their gate/up/down: the experts have no such projection; a
    shared expert's, SHARED_EXPERT_MODULES, where `sizes` has them), and the Gated
    DeltaNet layers (their own projections, LINEAR_ATTENTION_MODULES, in place of q/k/v/o)."""

    num_layers: int
    sizes: dict[str, tuple[int, int]]
    moe_layer_ids: frozenset[int] = frozenset()
    linear_layer_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, cfg) -> ProjectionShapes:
        """From the engine's `TextConfig` (or anything with its fields; a gated attention's
        `attn_output_gate` and a hybrid model's `linear_layer_ids` and `linear_*` sizes if it has them)."""
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_rows = 2 * q if getattr(cfg, "attn_output_gate", False) else q  # each head's query, then its gate
        sizes = {"q_proj": (h, q_rows), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)  # every MoE layer's shared expert
        if shared:
            sizes.update({"shared_expert.gate_proj": (h, shared), "shared_expert.up_proj": (h, shared),
                          "shared_expert.down_proj": (shared, h)})
        linear = frozenset(getattr(cfg, "linear_layer_ids", ()))
        if linear:
            keys, values = cfg.linear_num_k_heads * cfg.linear_k_dim, cfg.linear_num_v_heads * cfg.linear_v_dim
            sizes.update(in_proj_qkv=(h, 2 * keys + values), in_proj_z=(h, values), out_proj=(values, h),
                         in_proj_b=(h, cfg.linear_num_v_heads), in_proj_a=(h, cfg.linear_num_v_heads))
        return cls(cfg.num_layers, sizes, frozenset(cfg.moe_layer_ids), linear)

    def max_adapter_bytes(self, rank: int) -> int:
        """The most data an adapter of rank `rank` may hold: lora_A and lora_B of every projection
        of every layer in the widest dtype (8 bytes), twice over for its vision tower's (smaller
        than the language model in every family served). A larger file (padded, sparse, or
        tensors nothing reads) is refused before any worker reads it."""
        pieces = (sizes for module, sizes in self.sizes.items() if module not in FUSED_MODULES)
        return 2 * 8 * rank * self.num_layers * sum(i + o for i, o in pieces)

    @classmethod
    def from_hf(cls, hf_config) -> ProjectionShapes:
        """From a transformers config without loading model code (the API process has no
        torch): the families' text models' rules for head_dim and MoE layers (Qwen2.5-VL's and
        GLM-4.1V's head_dim, the MoE layers of Qwen3-VL-MoE, InternVL on Qwen3-MoE, GLM-4.5V and Qwen3.5-MoE),
        checked equal to `of(TextConfig)` by the tests."""
        tc = hf_config.text_config
        model_type = getattr(hf_config, "model_type", "")
        head_dim = tc.hidden_size // tc.num_attention_heads
        if model_type not in ("qwen2_5_vl", "glm4v"):  # theirs is hidden / heads, whatever head_dim says
            head_dim = getattr(tc, "head_dim", None) or head_dim
        moe: tuple[int, ...] = ()
        if model_type == "glm4v_moe":
            moe = tuple(range(tc.first_k_dense_replace, tc.num_hidden_layers))
        elif model_type == "qwen3_vl_moe" or getattr(tc, "model_type", "") == "qwen3_moe":
            mlp_only = set(getattr(tc, "mlp_only_layers", None) or ())
            step = int(getattr(tc, "decoder_sparse_step", 1) or 1)
            moe = tuple(i for i in range(tc.num_hidden_layers) if i not in mlp_only and (i + 1) % step == 0)
        elif model_type == "qwen3_5_moe":  # every layer routed (its loader refuses mlp_only_layers)
            moe = tuple(range(tc.num_hidden_layers))
        intermediate_size = getattr(tc, "intermediate_size", 0) or 0  # none in Qwen3.5-MoE's config
        dims = _Dims(tc.hidden_size, intermediate_size, tc.num_attention_heads,
                     tc.num_key_value_heads or tc.num_attention_heads, head_dim, tc.num_hidden_layers, moe)
        if model_type in ("qwen3_5", "qwen3_5_moe"):  # gated attention, Gated DeltaNet layers
            linear = tuple(i for i, kind in enumerate(tc.layer_types) if kind == "linear_attention")
            dims = replace(dims, attn_output_gate=True, linear_layer_ids=linear,
                           shared_expert_intermediate_size=getattr(tc, "shared_expert_intermediate_size", 0) or 0,
                           linear_num_k_heads=tc.linear_num_key_heads, linear_k_dim=tc.linear_key_head_dim,
                           linear_num_v_heads=tc.linear_num_value_heads, linear_v_dim=tc.linear_value_head_dim)
        return cls.of(dims)


@dataclass(frozen=True)
class _Dims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    moe_layer_ids: tuple[int, ...]
    attn_output_gate: bool = False
    linear_layer_ids: tuple[int, ...] = ()
    linear_num_k_heads: int = 0
    linear_k_dim: int = 0
    linear_num_v_heads: int = 0
    linear_v_dim: int = 0
    shared_expert_intermediate_size: int = 0


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


def read_adapter(name: str, path: str | Path, shapes: ProjectionShapes, max_lora_rank: int,
                 tower: bool = False) -> AdapterSpec:
    """The adapter at `path`, checked against `shapes` and `max_lora_rank` (torch-free).
    `tower` (--enable-tower-lora): its vision tower tensors are the encoders' (checked there),
    and it may have no language-model tensor at all; else they are ignored with a warning.
    LoRAAdapterError naming what is wrong."""
    files = read_lora_files(name, path, max_lora_rank)
    if files.data_bytes > shapes.max_adapter_bytes(files.rank):
        raise LoRAAdapterError(f"{files.where}: {WEIGHTS_FILE} holds {files.data_bytes} bytes of tensors, more "
                               f"than a rank-{files.rank} adapter of this model can ({shapes.max_adapter_bytes(files.rank)})")
    _check_target_names(files.target_modules, files.where)
    tensors = _pair_tensors(files.header, shapes, files.rank, files.where, tower)
    return AdapterSpec(name, str(path), files.rank, files.scaling, tensors)


def _check_target_names(targets, where: str) -> None:
    """A list of module names must name projections of the language model or the vision
    tower (a regex string, PEFT's other form, is checked through the tensors it produced)."""
    if not isinstance(targets, list):
        return
    unadapted = [t for t in targets if t in UNADAPTED_MODULES]
    if unadapted:
        raise LoRAAdapterError(f"{where}: target_modules {unadapted}: EPD does not adapt "
                               f"{', '.join(UNADAPTED_MODULES[t] for t in unadapted)}")
    lacking = [t for t in targets if t not in SUPPORTED_MODULES and str(t).rsplit(".", 1)[-1] not in TOWER_MODULE_NAMES]
    if lacking:
        raise LoRAAdapterError(f"{where}: target_modules {lacking} are not projections this model's language "
                               f"model has (supported: {', '.join(SUPPORTED_MODULES)}; the vision tower's "
                               f"with --enable-tower-lora)")


def _pair_tensors(header: dict[str, dict], shapes: ProjectionShapes, rank: int, where: str, tower: bool
                  ) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, module) -> (A name, B name), every shape checked; tower tensors skipped."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    tower_keys = [key for key in header if is_tower_key(key)]
    for key, meta in header.items():
        if is_tower_key(key):
            continue
        m = _LORA_KEY.search(key)
        if m is None and (moe := _EXPERTS_KEY.search(key)):
            raise LoRAAdapterError(f"{where}: tensor {key!r} adapts the routed experts of layer {moe[1]}'s "
                                   f"mixture of experts, which EPD does not adapt")
        if m is None:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is not a LoRA weight of a language-model "
                                   f"projection (target_modules may only be {', '.join(SUPPORTED_MODULES)})")
        layer, which = int(m[1]), m[4]
        module = f"shared_expert.{m[3]}" if m[2] == "mlp.shared_expert" else m[3]
        _check_tensor(key, meta, layer, module, which, shapes, rank, where)
        found.setdefault((layer, module), {})[which] = key
    if tower_keys and not tower:  # vLLM's warning, one line per adapter rather than per module
        log.warning("%s: regarding multimodal models, only the language model takes LoRA unless "
                    "--enable-tower-lora: %d tensors of the vision tower (%s, ...) will be ignored",
                    where, len(tower_keys), tower_keys[0])
    check_pairs(found, where, lambda k: f"layer {k[0]} {k[1]}")
    for (layer, module) in found:
        twice = [p for p in FUSED_MODULES.get(module, ()) if (layer, p) in found]
        if twice:
            raise LoRAAdapterError(f"{where}: layer {layer} is adapted both as {module} and as {', '.join(twice)}")
    if not found and not (tower and tower_keys):
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weight of the language model"
                               + (" (its vision tower weights need --enable-tower-lora)" if tower_keys else ""))
    return {k: (v["A"], v["B"]) for k, v in sorted(found.items())}


def _check_tensor(key: str, meta: dict, layer: int, module: str, which: str, shapes: ProjectionShapes,
                  rank: int, where: str) -> None:
    if module in SHARED_EXPERT_MODULES:
        if module not in shapes.sizes:
            raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts a shared expert, which "
                                   f"this model's language model lacks")
        if layer >= shapes.num_layers or layer not in shapes.moe_layer_ids:
            raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer}, which has no shared expert")
        in_features, out_features = shapes.sizes[module]
        check_shape(key, meta, which, in_features, out_features, rank, module, where)
        return
    if module in UNADAPTED_MODULES:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module!r}, "
                               f"{UNADAPTED_MODULES[module]}, which EPD does not adapt")
    if module not in SUPPORTED_MODULES:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module!r}, which this model's "
                               f"language model lacks (supported: {', '.join(SUPPORTED_MODULES)})")
    if layer >= shapes.num_layers:
        raise LoRAAdapterError(f"{where}: tensor {key!r} is for layer {layer}, but the model has "
                               f"{shapes.num_layers} layers (an adapter for another base model?)")
    if module in LINEAR_ATTENTION_MODULES and layer not in shapes.linear_layer_ids:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module} of layer {layer}, "
                               f"which is not a Gated DeltaNet (linear attention) layer")
    if module in ATTENTION_MODULES and layer in shapes.linear_layer_ids:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module} of layer {layer}, "
                               f"a Gated DeltaNet (linear attention) layer without that projection")
    if (module in MLP_MODULES or module in FUSED_MODULES) and layer in shapes.moe_layer_ids:
        raise LoRAAdapterError(f"{where}: target_modules: tensor {key!r} adapts {module} of layer {layer}, "
                               f"a mixture-of-experts layer without that projection")
    in_features, out_features = shapes.sizes[module]
    check_shape(key, meta, which, in_features, out_features, rank, module, where)


def split_fused(weights: dict[tuple[int, str], tuple]) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (A, B) with each fused module's pair given as its pieces': the
    same A, and B's rows cut in equal parts in order (x A^T B^T, cut by output rows)."""
    out = {}
    for (layer, module), (a, b) in weights.items():
        pieces = FUSED_MODULES.get(module, (module,))
        rows = b.shape[0] // len(pieces)
        out.update({(layer, piece): (a, b[k * rows:(k + 1) * rows]) for k, piece in enumerate(pieces)})
    return out
