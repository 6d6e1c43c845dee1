"""Qwen3-VL vision tower: patch embedding, interpolated learned position
embedding, 2-D rotary attention blocks, patch merger and deepstack mergers.

Input is what the checkpoint's image processor produces: flattened patches
already in spatial-merge-block order, `[num_patches, 3 * t_patch * p * p]`,
and each image's grid `(t, h, w)` in patches. Output per image: the merged
embeddings `[num_tokens, out_hidden]` that replace its placeholder tokens, and
the deepstack features `[num_deepstack, num_tokens, out_hidden]` the language
model adds to its first layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epd.encoders.layers.segment_attention import segment_attention
from epd.encoders.layers.vision_rotary import apply_rotary, merge_block_positions, rotary_cos_sin, rotary_inv_freq
from epd.transport.weights.checkpoint import unfilled_embedding


@dataclass(frozen=True)
class VisionTowerShape:
    """What every Qwen vision tower has: patching, blocks, merger. Each family's
    config adds its own fields (`VisionConfig`, `Qwen2_5VisionConfig`)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    rope_theta: float

    @staticmethod
    def fields_from_hf(vc) -> dict:
        rope = getattr(vc, "rope_parameters", None) or {}
        return dict(depth=vc.depth, hidden_size=vc.hidden_size, num_heads=vc.num_heads,
                    intermediate_size=vc.intermediate_size, hidden_act=vc.hidden_act,
                    patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size,
                    spatial_merge_size=vc.spatial_merge_size, in_channels=vc.in_channels,
                    out_hidden_size=vc.out_hidden_size, rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class VisionConfig(VisionTowerShape):
    """Qwen3-VL's tower: a learned position table and deepstack features."""

    num_position_embeddings: int = 0
    deepstack_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, vc) -> "VisionConfig":
        return cls(**cls.fields_from_hf(vc), num_position_embeddings=vc.num_position_embeddings,
                   deepstack_indexes=tuple(getattr(vc, "deepstack_visual_indexes", None) or ()))


@dataclass
class VisionOutput:
    """Per-image results, in input order."""

    embeds: list[torch.Tensor]  # each [num_tokens_i, out_hidden]
    deepstack: list[torch.Tensor]  # each [num_deepstack, num_tokens_i, out_hidden]


def deepstack_extras(deepstack: torch.Tensor) -> dict[str, torch.Tensor]:
    """One item's deepstack features [num_deepstack, n, out_hidden] as its entry's
    extras: "deepstack.{i}" -> view [n, out_hidden], each a frame no larger than
    the embeddings' (epd/families/qwen_vl/text_model.py reads them back in order)."""
    return {f"deepstack.{i}": d for i, d in enumerate(deepstack.unbind(0))}


def _activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported vision activation {name!r}")


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        # [num_patches, C * t * p * p] -> [num_patches, C, t, p, p]; the conv covers the whole patch
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seq_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [n, H, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.proj(segment_attention(q, k, v, seq_lens).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, seq_lens):
        x = x + self.attn(self.norm1(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Merges each 2x2 (spatial_merge_size^2) group of patches into one LM token.

    The deepstack mergers normalise after the shuffle (over the concatenated
    group), the final merger before it (per patch).
    """

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = unfilled_embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.num_grid_per_side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_indexes)
        self.reset_rotary(self.pos_embed.weight.device)

    def reset_rotary(self, device) -> None:
        """The 2-D rotary table: a plain float32 tensor (not a weight, so it keeps
        float32 whatever the tower's dtype)."""
        self.inv_freq = rotary_inv_freq(self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta, device)

    # -- per-patch geometry, in spatial-merge-block order ----------------------

    def _interpolated_pos_embed(self, rows, cols, h: int, w: int) -> torch.Tensor:
        """Bilinear (align_corners=True) resampling of the square learned table
        to an h x w grid, evaluated at the given patch coordinates."""
        side = self.num_grid_per_side
        out = 0
        taps = []
        for idx, size in ((rows, h), (cols, w)):
            src = idx.float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long().clamp(0, side - 1)
            hi = (lo + 1).clamp(0, side - 1)
            taps.append(((lo, 1 - frac), (hi, frac)))
        weight = self.pos_embed.weight
        for r_idx, r_w in taps[0]:
            for c_idx, c_w in taps[1]:
                out = out + weight[r_idx * side + c_idx] * (r_w * c_w)[:, None].to(weight.dtype)
        return out

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        """pixel_values: [num_patches, C*t*p*p] for all images; grid_thw: one (t, h, w) per image."""
        device = pixel_values.device
        rows, cols, pos = [], [], []
        for t, h, w in grid_thw:
            r, c = merge_block_positions(t, h, w, self.cfg.spatial_merge_size, device)
            rows.append(r)
            cols.append(c)
            pos.append(self._interpolated_pos_embed(r, c, h, w))
        rows_all, cols_all = torch.cat(rows), torch.cat(cols)
        x = self.patch_embed(pixel_values)  # [num_patches, hidden]
        x = x + torch.cat(pos).to(x.dtype)
        cos, sin = rotary_cos_sin(rows_all, cols_all, self.inv_freq)
        seq_lens = [t * h * w for t, h, w in grid_thw]
        # attention is within one temporal group (a video's frames pair), as transformers' cu_seqlens
        frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]

        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens)
            if i in self.cfg.deepstack_indexes:
                merger = self.deepstack_merger_list[self.cfg.deepstack_indexes.index(i)]
                deepstack.append(merger(x))  # [num_tokens, out_hidden]
        merged = self.merger(x)  # [num_tokens, out_hidden]

        unit = self.cfg.spatial_merge_size ** 2
        token_counts = [n // unit for n in seq_lens]
        embeds = list(merged.split(token_counts))
        if deepstack:
            stacked = torch.stack(deepstack)  # [num_deepstack, num_tokens, out_hidden]
            per_image = list(stacked.split(token_counts, dim=1))
        else:
            per_image = [merged.new_zeros(0, n, merged.shape[-1]) for n in token_counts]
        return VisionOutput(embeds=embeds, deepstack=per_image)
