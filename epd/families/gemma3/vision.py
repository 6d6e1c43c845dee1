"""Gemma 3's vision side: the SigLIP tower and the multimodal projector (encoder side).

SigLIP (transformers' SiglipVisionModel without its pooling head): a
`patch_size` convolution, a learned position per patch of the square
`image_size` input, pre-norm blocks (LayerNorm, attention with biases, GELU-tanh
MLP), a final LayerNorm. The projector (Gemma3MultiModalProjector) pools the
patch grid to `mm_tokens_per_image` tokens (average over square windows),
normalises them with Gemma's RMSNorm (x * (1 + w)) and projects them to the
text hidden size with one matrix (`mm_input_projection_weight`,
[vision hidden, text hidden]). Every crop is of the tower's fixed size, so each
gives the same number of tokens; an image is its original alone, or with
pan-and-scan the original and its crops, and its entry holds their tokens in
that order (the prompt's runs), with no extras.

Imports nothing of the engine: the encoder worker, the aggregated worker and
the offline LLM load it through `load_vision`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from epd.families.gemma3.image_processor import Gemma3ImageProcessor
from epd.families.gemma3.prompt_format import Gemma3Geometry
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.weights.checkpoint import load_weights, materialize

# checkpoint prefixes of the tower and the projector: transformers' layout, and the release's
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                   "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int

    @classmethod
    def from_hf(cls, hf_config) -> "SiglipConfig":
        vc = hf_config.vision_config
        if getattr(vc, "vision_use_head", False):
            raise ValueError("a SigLIP vision config with its pooling head (vision_use_head) is not Gemma 3's")
        if vc.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"SigLIP hidden_act {vc.hidden_act!r}: only gelu_pytorch_tanh is supported")
        return cls(vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, vc.num_attention_heads,
                   vc.image_size, vc.patch_size, vc.num_channels, vc.layer_norm_eps,
                   hf_config.mm_tokens_per_image, hf_config.text_config.hidden_size)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, S, S] -> [B, patches, hidden], patches in row-major order."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, P, hidden] -> [B, P, hidden]: every patch attends to every patch of its image."""
        b, p, _ = x.shape
        q, k, v = (proj(x).view(b, p, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [B, heads, P, D] each
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(o.transpose(1, 2).reshape(b, p, -1))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * (1 + weight), in float32, cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(nn.Module):
    """Patch grid -> `mm_tokens_per_image` embeddings of the text hidden size."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.patches_per_side = cfg.patches_per_side
        self.kernel = cfg.patches_per_side // int(cfg.mm_tokens_per_image ** 0.5)
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, tokens, text hidden]."""
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [B, tokens, d]
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3VisionTower(nn.Module):
    """SigLIP + projector: [B, C, S, S] pixels -> [B, mm_tokens_per_image, text hidden]."""

    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.projector = Gemma3Projector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.projector(self.post_layernorm(x))


def _weight_rule(name: str):
    """A checkpoint name -> (our parameter, None), or None for the language model's."""
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "projector." + name[len(prefix):], None
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):].removeprefix("encoder.")
            return rest.replace(".mlp.fc", ".fc"), None
    return None


def _describe(param: str, shard: int | None) -> str:
    """The checkpoint name (transformers' layout) expected for one of our parameters."""
    if param.startswith("projector."):
        return "model.multi_modal_projector." + param[len("projector."):]
    if param.startswith("layers."):
        param = "encoder." + param.replace(".fc", ".mlp.fc")
    return "model.vision_tower." + param


class Gemma3Vision:
    """Gemma 3's VisionModel: decoded images -> one `MMEntry` each."""

    def __init__(self, tower: Gemma3VisionTower, processor: Gemma3ImageProcessor):
        self.tower = tower
        self.processor = processor
        self.geometry: Gemma3Geometry = processor.geometry

    def preprocess(self, images: list) -> tuple[torch.Tensor, list[dict]]:
        """Images -> (pixel_values [crops, C, S, S]: each image's original, then its crops;
        one span metadata dict per image: its crop count, when it has crops)."""
        return self.processor(images), [self.geometry.span_meta(*image.size) for image in images]

    def forward(self, pixel_values: torch.Tensor, metas: list[dict]) -> list[MMEntry]:
        """One entry per image: the embeddings of its original and its crops, in that order
        [(1 + num_crops) * mm_tokens_per_image, text hidden]."""
        param = self.tower.projector.mm_input_projection_weight
        out = self.tower(pixel_values.to(param.device, param.dtype))  # [crops, tokens, text hidden]
        counts = [1 + meta.get("num_crops", 0) for meta in metas]
        assert sum(counts) == out.shape[0], (counts, out.shape)
        return [MMEntry(embeddings=crops.flatten(0, 1), meta=dict(meta))
                for crops, meta in zip(out.split(counts), metas)]

    def patches(self, width: int, height: int) -> int:
        """An image's cost for batching: the tower's patches, for its original and each crop."""
        return self.geometry.patches(width, height)


def load_vision(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu",
                processor_kwargs: dict | None = None) -> Gemma3Vision:
    """The checkpoint's tower and projector, filled from its safetensors, with its image processor."""
    cfg = SiglipConfig.from_hf(hf_config)
    with torch.device("meta"):
        tower = Gemma3VisionTower(cfg)
    tower = materialize(tower, device, dtype)
    load_weights(tower, model_dir, _weight_rule, describe=_describe)
    return Gemma3Vision(tower.eval(), Gemma3ImageProcessor(model_dir, hf_config, processor_kwargs))
