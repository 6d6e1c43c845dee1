"""A LoRA adapter's vision tower weights, read and checked against the tower (torch-free).

PEFT names the tower's projections as transformers' model has them, which is
how epd/families/qwen_vl/vision_tower.py (and qwen2_5_vision_tower.py) name them too:

    Qwen3-VL    blocks.N.attn.qkv, blocks.N.attn.proj, blocks.N.mlp.linear_fc1, blocks.N.mlp.linear_fc2,
                merger.linear_fc1/2, deepstack_merger_list.K.linear_fc1/2
    Qwen2.5-VL  blocks.N.attn.qkv, blocks.N.attn.proj, blocks.N.mlp.gate_proj/up_proj/down_proj,
                merger.mlp.0, merger.mlp.2

(a bare `linear_fc1` target adapts the mergers' as well as the blocks').
`TowerShapes.from_hf` gives every such projection's (in, out) from the
config alone, so the API checks `--lora-modules` before any worker starts;
`TowerShapes.of(tower)` reads them off a built tower (the tests check both
agree). `read_tower_adapter` pairs the `visual.` tensors of an adapter with
those projections: a tensor of another module (the patch embedding's
convolution), or of another shape, is refused naming the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from epd.transport.weights.lora_files import (TOWER_KEY, LoRAAdapterError, check_pairs, check_shape, is_tower_key,
                                      read_lora_files)


@dataclass(frozen=True)
class TowerShapes:
    """(in_features, out_features) of each linear projection of the tower, by its path."""

    sizes: dict[str, tuple[int, int]]

    @classmethod
    def from_hf(cls, hf_config) -> TowerShapes:
        vc, model_type = hf_config.vision_config, getattr(hf_config, "model_type", "")
        h, i = vc.hidden_size, vc.intermediate_size
        merged = h * vc.spatial_merge_size ** 2
        out = vc.out_hidden_size
        sizes: dict[str, tuple[int, int]] = {}
        for n in range(vc.depth):
            sizes[f"blocks.{n}.attn.qkv"] = (h, 3 * h)
            sizes[f"blocks.{n}.attn.proj"] = (h, h)
            if model_type == "qwen2_5_vl":
                sizes.update({f"blocks.{n}.mlp.gate_proj": (h, i), f"blocks.{n}.mlp.up_proj": (h, i),
                              f"blocks.{n}.mlp.down_proj": (i, h)})
            else:
                sizes.update({f"blocks.{n}.mlp.linear_fc1": (h, i), f"blocks.{n}.mlp.linear_fc2": (i, h)})
        if model_type == "qwen2_5_vl":
            sizes.update({"merger.mlp.0": (merged, merged), "merger.mlp.2": (merged, out)})
            return cls(sizes)
        mergers = ["merger"] + [f"deepstack_merger_list.{k}" for k in range(len(vc.deepstack_visual_indexes))]
        for name in mergers:
            sizes.update({f"{name}.linear_fc1": (merged, merged), f"{name}.linear_fc2": (merged, out)})
        return cls(sizes)

    @classmethod
    def of(cls, tower) -> TowerShapes:
        """From a built tower: each `nn.Linear` (not the patch embedding's convolution)."""
        from torch import nn

        return cls({name: (m.in_features, m.out_features) for name, m in tower.named_modules()
                    if type(m) is nn.Linear})


@dataclass(frozen=True)
class TowerAdapterSpec:
    """A checked adapter's tower part: rank, scaling, and per projection path the
    names of its A and B tensors in `adapter_model.safetensors`."""

    name: str
    path: str
    rank: int
    scaling: float
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)


def read_tower_adapter(name: str, path: str | Path, shapes: TowerShapes, max_lora_rank: int) -> TowerAdapterSpec:
    """The tower weights of the adapter at `path` (none: an empty `tensors`), every
    shape checked; LoRAAdapterError naming what is wrong."""
    files = read_lora_files(name, path, max_lora_rank)
    found: dict[str, dict[str, str]] = {}
    for key, meta in files.header.items():
        if not is_tower_key(key):
            continue
        m = TOWER_KEY.search(key)
        module = m[1] if m else None
        if module not in shapes.sizes:
            raise LoRAAdapterError(f"{files.where}: target_modules: tensor {key!r} adapts "
                                   f"{'visual.' + module if module else 'a module'} of the vision tower, which "
                                   f"tower LoRA does not cover (its linear projections only: attn.qkv, attn.proj, "
                                   f"the MLPs' and the mergers')")
        in_features, out_features = shapes.sizes[module]
        check_shape(key, meta, m[2], in_features, out_features, files.rank, f"visual.{module}", files.where)
        found.setdefault(module, {})[m[2]] = key
    check_pairs(found, files.where, lambda module: f"visual.{module}")
    return TowerAdapterSpec(name, str(path), files.rank, files.scaling,
                            {k: (v["A"], v["B"]) for k, v in sorted(found.items())})
