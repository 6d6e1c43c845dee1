"""GLM-4.1V's vision tower and projector (GLM-4.5V's too): decoded images ->
the embeddings that replace their placeholder tokens, in the text hidden size.

    patches [n, C * t * p * p]       the image processor's, in spatial-merge-block order
    Conv3d patch embed, RMSNorm      -> [n, hidden]
    + learned positions              the square table resampled to each image's grid
                                     (bicubic `grid_sample` at patch centres, border padding)
    blocks                           RMSNorm, attention within each temporal group with a
                                     2-D rotary, RMSNorm, SwiGLU MLP (hidden -> out_hidden -> hidden)
    RMSNorm, downsample              a merge x merge Conv2d per group of patches -> [n / merge^2, out_hidden]
    merger                           Linear, LayerNorm, GELU, SwiGLU -> [n / merge^2, out_hidden]

out_hidden is the language model's hidden size. Parameter names are the
checkpoint's under `model.visual.` (transformers' Glm4vVisionModel).
`Glm4vVision` is the family's vision model: its processor, geometry and tower.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from epd.encoders.layers.segment_attention import segment_attention
from epd.encoders.layers.vision_norm import RMSNorm
from epd.encoders.layers.vision_rotary import apply_rotary, merge_block_positions, rotary_cos_sin, rotary_inv_freq
from epd.families.glm4v.image_processor import Glm4vImagePreprocessor
from epd.families.glm4v.prompt_format import Glm4vImageGeometry
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.weights.checkpoint import load_weights, materialize

_VISION_PREFIXES = ("model.visual.", "visual.")
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


@dataclass(frozen=True)
class TowerConfig:
    """config.json's vision_config, the fields the tower is built from."""

    depth: int
    hidden_size: int
    num_heads: int
    out_hidden_size: int  # the language model's hidden size
    intermediate_size: int  # the merger's SwiGLU width
    hidden_act: str
    attention_bias: bool
    rms_norm_eps: float
    image_size: int  # the learned position table covers (image_size / patch_size)^2 patches
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float

    @classmethod
    def from_hf(cls, vc) -> "TowerConfig":
        rope = getattr(vc, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"GLM-4.1V's vision rotary is axial; the checkpoint asks for {rope['rope_type']!r}")
        if vc.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {vc.hidden_act!r}")
        return cls(depth=vc.depth, hidden_size=vc.hidden_size, num_heads=vc.num_heads,
                   out_hidden_size=vc.out_hidden_size, intermediate_size=vc.intermediate_size,
                   hidden_act=vc.hidden_act, attention_bias=bool(vc.attention_bias),
                   rms_norm_eps=float(vc.rms_norm_eps), image_size=int(vc.image_size),
                   patch_size=int(vc.patch_size), temporal_patch_size=int(vc.temporal_patch_size),
                   spatial_merge_size=vc.spatial_merge_size, in_channels=vc.in_channels,
                   rope_theta=float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class PatchEmbed(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.cfg = cfg
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        # [n, C * t * p * p] -> [n, C, t, p, p]; the conv covers the whole patch
        x = patches.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, c.hidden_size)


class PositionEmbedding(nn.Module):
    """The learned square table of positions, resampled to each image's grid."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor, heights: torch.Tensor,
                widths: torch.Tensor) -> torch.Tensor:
        """Positions [n, hidden] of patches at (rows, cols) of grids heights x widths (each [n]):
        the table as a side x side image, sampled bicubically at each patch's centre in float32."""
        weight = self.position_embedding.weight
        side = int(weight.shape[0] ** 0.5)
        table = weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()  # [1, hidden, side, side]
        x = ((cols + 0.5) / widths) * 2 - 1  # patch centres in [-1, 1]
        y = ((rows + 0.5) / heights) * 2 - 1
        grid = torch.stack((x, y), dim=-1)[None, :, None, :]  # [1, n, 1, 2]
        out = F.grid_sample(table, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return out[0, :, :, 0].T.to(weight.dtype)  # [n, hidden]


class Attention(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [n, H, D] each
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.proj(segment_attention(q, k, v, seq_lens).reshape(n, -1))


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, dim: int, inner: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.out_hidden_size, cfg.hidden_act)  # the release's width

    def forward(self, x, cos, sin, seq_lens):
        x = x + self.attn(self.norm1(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Linear, LayerNorm, GELU, then a SwiGLU of `intermediate_size`: [m, out_hidden] -> [m, out_hidden]."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        dim = cfg.out_hidden_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, dim, bias=False)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Glm4vVisionTower(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.post_conv_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.embeddings = PositionEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m = cfg.spatial_merge_size
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=m, stride=m)
        self.merger = Merger(cfg)
        self.reset_rotary(self.post_layernorm.weight.device)

    def reset_rotary(self, device) -> None:
        """The rotary's frequencies: a plain float32 tensor (not a weight, so it keeps
        float32 whatever the tower's dtype)."""
        self.inv_freq = rotary_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """pixel_values [num_patches, C*t*p*p] of every item; grid_thw: one (t, h, w) per item
        -> each item's embeddings [t * h * w / merge^2, out_hidden]."""
        c, device = self.cfg, pixel_values.device
        m = c.spatial_merge_size
        positions = [merge_block_positions(t, h, w, m, device) for t, h, w in grid_thw]
        rows = torch.cat([r for r, _ in positions])
        cols = torch.cat([col for _, col in positions])
        sizes = [t * h * w for t, h, w in grid_thw]
        per_patch = torch.tensor(sizes, device=device)
        heights = torch.tensor([float(h) for _, h, _ in grid_thw], device=device).repeat_interleave(per_patch)
        widths = torch.tensor([float(w) for _, _, w in grid_thw], device=device).repeat_interleave(per_patch)

        x = self.post_conv_layernorm(self.patch_embed(pixel_values))  # [n, hidden]
        x = x + self.embeddings(rows, cols, heights, widths)
        cos, sin = rotary_cos_sin(rows, cols, self.inv_freq)
        group_lens = [h * w for t, h, w in grid_thw for _ in range(t)]  # attention within a temporal group
        for block in self.blocks:
            x = block(x, cos, sin, group_lens)
        x = self.post_layernorm(x)
        x = x.view(-1, m, m, c.hidden_size).permute(0, 3, 1, 2)  # [n / m^2, hidden, m, m]
        x = self.merger(self.downsample(x).view(-1, c.out_hidden_size))  # [n / m^2, out_hidden]
        return list(x.split([n // m ** 2 for n in sizes]))


def _vision_rule(name: str):
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):], None
    return None


def load_tower(model_dir: str | Path, hf_config, dtype: torch.dtype,
               device: str | torch.device = "cpu") -> Glm4vVisionTower:
    """The checkpoint's tower, filled from its safetensors, in eval mode."""
    with torch.device("meta"):
        tower = Glm4vVisionTower(TowerConfig.from_hf(hf_config.vision_config))
    tower = materialize(tower, device, dtype)
    tower.reset_rotary(device)
    load_weights(tower, model_dir, _vision_rule, describe=lambda p, s: "model.visual." + p)
    return tower.eval()


class Glm4vVision:
    """The family's vision model: decoded images -> one `MMEntry` per image
    (its embeddings, no extras, meta {"grid_thw": (t, h, w)})."""

    def __init__(self, tower: Glm4vVisionTower, processor: Glm4vImagePreprocessor):
        self.tower = tower
        self.processor = processor
        self.geometry: Glm4vImageGeometry = processor.geometry

    def preprocess(self, images: list) -> tuple[torch.Tensor, list[dict]]:
        """PIL images -> (pixel_values [num_patches, C*t*p*p], one {"grid_thw": (t, h, w)} per image)."""
        return self.processor(images)

    def forward(self, pixel_values: torch.Tensor, metas: list[dict]) -> list[MMEntry]:
        """One entry per grid of `metas` (an image, or a video's temporal group)."""
        weight = self.tower.post_layernorm.weight
        embeds = self.tower(pixel_values.to(weight.device, weight.dtype), [m["grid_thw"] for m in metas])
        return [MMEntry(e, {}, dict(meta)) for e, meta in zip(embeds, metas)]

    def patches(self, width: int, height: int) -> int:
        """The image's cost for batching: the tower's patches."""
        return self.geometry.patches(width, height)


def load_vision(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu",
                processor_kwargs: dict | None = None) -> Glm4vVision:
    """The family's `VisionModel` for a checkpoint: its image processor and filled tower."""
    return Glm4vVision(load_tower(model_dir, hf_config, dtype, device),
                       Glm4vImagePreprocessor(model_dir, processor_kwargs))
