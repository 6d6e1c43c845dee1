"""Qwen2.5-VL vision tower: patch embedding (no bias, no position table), 2-D
rotary attention blocks with RMSNorm and a gated SiLU MLP, window attention
except in the `fullatt_block_indexes` blocks, and an RMSNorm patch merger.
No deepstack.

Window attention: the merged-token grid of each image is cut into windows of
`window_size // (patch_size * spatial_merge_size)` merged tokens a side
(ragged at the right and bottom edges). The patches are reordered window by
window (whole merge groups move together) before the first block, every
window block attends within a window, full-attention blocks within an image,
and the merger's output is put back in the image processor's order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epd.encoders.layers.vision_norm import RMSNorm
from epd.encoders.layers.vision_rotary import merge_block_positions, rotary_cos_sin, rotary_inv_freq
from epd.families.qwen_vl.vision_tower import VisionAttention, VisionOutput, VisionTowerShape, _activation


@dataclass(frozen=True)
class Qwen2_5VisionConfig(VisionTowerShape):
    """Qwen2.5-VL's tower: window attention but in `fullatt_block_indexes`."""

    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, vc) -> "Qwen2_5VisionConfig":
        return cls(**cls.fields_from_hf(vc), window_size=vc.window_size,
                   fullatt_block_indexes=tuple(vc.fullatt_block_indexes))


class GatedMLP(nn.Module):
    def __init__(self, cfg: Qwen2_5VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: Qwen2_5VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedMLP(cfg)

    def forward(self, x, cos, sin, seq_lens):
        x = x + self.attn(self.norm1(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """RMSNorm per patch, then each spatial-merge group concatenated -> MLP."""

    def __init__(self, cfg: Qwen2_5VisionConfig):
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


def window_index(grid_thw: list[tuple[int, int, int]], spatial_merge_size: int,
                 merger_window: int) -> tuple[torch.Tensor, list[int]]:
    """(merged-token order window by window [num_merged], patches per window).

    Merged token j of the output comes from position argsort(order)[j]; every
    window length is in patches (merged tokens x spatial_merge_size^2)."""
    order, window_lens, offset = [], [], 0
    unit = spatial_merge_size ** 2
    for t, h, w in grid_thw:
        mh, mw = h // spatial_merge_size, w // spatial_merge_size
        index = torch.arange(t * mh * mw).view(t, mh, mw)
        for frame in range(t):
            for r in range(0, mh, merger_window):
                for c in range(0, mw, merger_window):
                    ids = index[frame, r:r + merger_window, c:c + merger_window].reshape(-1)
                    order.append(ids + offset)
                    window_lens.append(ids.numel() * unit)
        offset += t * mh * mw
    return torch.cat(order), window_lens


class Qwen2_5VisionTower(nn.Module):
    def __init__(self, cfg: Qwen2_5VisionConfig):
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = Merger(cfg)
        self.reset_rotary(self.patch_embed.proj.weight.device)

    def reset_rotary(self, device) -> None:
        """The 2-D rotary table: float32 whatever the tower's dtype (not a weight)."""
        self.inv_freq = rotary_inv_freq(self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta, device)

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        # [num_patches, C * t * p * p] -> [num_patches, C, t, p, p]; the conv covers the whole patch
        x = pixel_values.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.patch_embed.proj(x.to(self.patch_embed.proj.weight.dtype)).view(-1, c.hidden_size)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionOutput:
        """pixel_values: [num_patches, C*t*p*p] for all images; grid_thw: one (t, h, w) per image."""
        c, device = self.cfg, pixel_values.device
        unit = c.spatial_merge_size ** 2
        rows, cols = zip(*(merge_block_positions(t, h, w, c.spatial_merge_size, device) for t, h, w in grid_thw))
        cos, sin = rotary_cos_sin(torch.cat(rows), torch.cat(cols), self.inv_freq)  # [num_patches, head_dim]

        order, window_lens = window_index(grid_thw, c.spatial_merge_size,
                                          c.window_size // c.spatial_merge_size // c.patch_size)
        order = order.to(device)

        def by_window(x: torch.Tensor) -> torch.Tensor:  # whole merge groups move together
            return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])

        x = by_window(self._embed(pixel_values))  # [num_patches, hidden], window order
        cos, sin = by_window(cos), by_window(sin)
        image_lens = [t * h * w for t, h, w in grid_thw]
        # full attention is within one temporal group (a video's frames pair), as transformers'
        # cu_seqlens; windows never cross groups
        frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens if i in c.fullatt_block_indexes else window_lens)
        merged = self.merger(x)[torch.argsort(order)]  # [num_tokens, out_hidden], processor order
        token_counts = [n // unit for n in image_lens]
        embeds = list(merged.split(token_counts))
        return VisionOutput(embeds=embeds, deepstack=[merged.new_zeros(0, n, merged.shape[-1])
                                                      for n in token_counts])
