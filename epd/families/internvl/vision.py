"""InternVL's vision side: InternViT, pixel-unshuffle and the projector.

Input is what the checkpoint's image processor gives (image_processor.py):
448x448 tiles `[num_tiles, 3, size, size]`, each image's tiles in a row
(its grid's tiles, then the thumbnail). Each tile goes through InternViT
(a CLS token plus one token per patch, learned absolute positions, pre-norm
blocks with layer scale, optional q/k RMSNorm over the whole width), the
features of `vision_feature_layer` without the CLS token are pixel-unshuffled
(2x2 neighbours into one token when `downsample_ratio` is 0.5) and projected
to the text width (LayerNorm, Linear, GELU, Linear): 256 tokens a tile for
InternVL3.5's 448-pixel tiles and 14-pixel patches. Parameter names are the
release's under `model.vision_tower.` and `model.multi_modal_projector.`.
`load_vision` gives the family's vision model (the interface the encoder
uses: `geometry`, `preprocess`, `forward`, `patches`). No transformers modeling code: only its config class.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from epd.families.internvl.image_processor import TilePreprocessor
from epd.families.internvl.prompt_format import TileGeometry
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.weights.checkpoint import load_weights, materialize

# the release's prefixes (transformers' own layout, then the older *-hf one) -> ours
_PREFIXES = {"model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector.",
             "vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."}
_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "silu": F.silu, "relu": F.relu}


def _pair(v) -> int:
    """A square side from an int or an (h, w) pair (the config keeps both forms)."""
    if isinstance(v, (list, tuple)):
        if v[0] != v[1]:
            raise ValueError(f"non-square {v!r} is not supported")
        return int(v[0])
    return int(v)


@dataclass(frozen=True)
class InternVisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    norm_type: str  # "layer_norm" or "rms_norm": the blocks' norms
    layer_norm_eps: float
    image_size: int  # a tile's side in pixels
    patch_size: int
    attention_bias: bool
    qk_norm: bool
    use_mean_pooling: bool  # False: a final LayerNorm on the last layer's output
    text_hidden_size: int
    downsample_ratio: float
    projector_hidden_act: str
    vision_feature_layer: int
    select_strategy: str  # "default": drop the CLS token; "full": keep it

    @classmethod
    def from_hf(cls, hf_config) -> "InternVisionConfig":
        vc = hf_config.vision_config
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: only one layer is supported")
        if hf_config.vision_feature_select_strategy != "default":
            raise ValueError(f"vision_feature_select_strategy {hf_config.vision_feature_select_strategy!r} "
                             "is not supported (only 'default')")
        for name in ("hidden_act",):
            if getattr(vc, name) not in _ACTIVATIONS:
                raise ValueError(f"vision {name} {getattr(vc, name)!r} is not supported")
        if hf_config.projector_hidden_act not in _ACTIVATIONS:
            raise ValueError(f"projector_hidden_act {hf_config.projector_hidden_act!r} is not supported")
        if vc.norm_type not in ("layer_norm", "rms_norm"):
            raise ValueError(f"vision norm_type {vc.norm_type!r} is not supported")
        if not vc.use_absolute_position_embeddings:
            raise ValueError("a vision tower without absolute position embeddings is not supported")
        return cls(
            hidden_size=vc.hidden_size, num_layers=vc.num_hidden_layers, num_heads=vc.num_attention_heads,
            intermediate_size=vc.intermediate_size, hidden_act=vc.hidden_act, norm_type=vc.norm_type,
            layer_norm_eps=vc.layer_norm_eps, image_size=_pair(vc.image_size), patch_size=_pair(vc.patch_size),
            attention_bias=bool(vc.attention_bias), qk_norm=bool(vc.use_qk_norm),
            use_mean_pooling=bool(vc.use_mean_pooling), text_hidden_size=hf_config.text_config.hidden_size,
            downsample_ratio=float(hf_config.downsample_ratio), projector_hidden_act=hf_config.projector_hidden_act,
            vision_feature_layer=layer, select_strategy=hf_config.vision_feature_select_strategy,
        )

    @property
    def unshuffle(self) -> int:
        """Tokens a side merged into one by the pixel-unshuffle (2 for downsample_ratio 0.5)."""
        return int(1 / self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        """Placeholder tokens one tile gives (256 for 448-pixel tiles of 14-pixel patches)."""
        return (self.image_size // self.patch_size // self.unshuffle) ** 2


class VisionRMSNorm(nn.Module):
    """InternViT's RMSNorm: float32 statistics, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(cfg: InternVisionConfig) -> nn.Module:
    if cfg.norm_type == "rms_norm":
        return VisionRMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.projection = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)


class Embeddings(nn.Module):
    """CLS token + patch embeddings + learned absolute positions (bicubic-resized for
    another grid than the table's, as transformers does)."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.hidden_size))
        self.patch_embeddings = PatchEmbeddings(cfg)
        self.position_embeddings = nn.Parameter(torch.empty(1, (cfg.image_size // cfg.patch_size) ** 2 + 1,
                                                            cfg.hidden_size))

    def _positions(self, height: int, width: int) -> torch.Tensor:
        table = self.position_embeddings  # [1, 1 + side * side, hidden]
        side = int((table.shape[1] - 1) ** 0.5)
        rows, cols = height // self.patch_size, width // self.patch_size
        if rows == cols == side:
            return table
        grid = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat((table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)), dim=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles, 1 + patches, hidden]."""
        _, _, height, width = pixel_values.shape
        x = self.patch_embeddings.projection(pixel_values.to(self.cls_token.dtype))
        x = x.flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self._positions(height, width)


class Attention(nn.Module):
    """Bidirectional attention within a tile; q/k RMSNorm over the whole width when configured."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, d, bias=cfg.attention_bias)
        self.projection_layer = nn.Linear(d, d)
        self.q_norm = VisionRMSNorm(d) if cfg.qk_norm else nn.Identity()
        self.k_norm = VisionRMSNorm(d) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        heads = lambda t: t.reshape(b, s, self.num_heads, d // self.num_heads).transpose(1, 2)  # noqa: E731
        q = heads(self.q_norm(self.q_proj(x)))
        k = heads(self.k_norm(self.k_proj(x)))
        v = heads(self.v_proj(x))  # [b, heads, s, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.projection_layer(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    """Pre-norm block; each branch scaled per channel (layer scale) before its residual add."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)
        self.layernorm_before = _norm(cfg)
        self.layernorm_after = _norm(cfg)
        self.lambda_1 = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Encoder(nn.Module):
    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))


class InternViT(nn.Module):
    """The tower; `features(pixel_values)` is the chosen layer's output, CLS token included."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.layernorm = nn.Identity() if cfg.use_mean_pooling else nn.LayerNorm(cfg.hidden_size,
                                                                                eps=cfg.layer_norm_eps)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] -> [tiles, 1 + patches, hidden]: the last layer's output through the
        final norm (vision_feature_layer -1), else hidden state k (0: the embeddings, k: after
        layer k; negative counts from the end), as transformers' hidden_states tuple."""
        k = self.cfg.vision_feature_layer
        num_layers = len(self.encoder.layer)
        last = k == -1
        stop = num_layers if last else (k if k >= 0 else num_layers + 1 + k)
        if not 0 <= stop <= num_layers:
            raise ValueError(f"vision_feature_layer {k} is outside the tower's {num_layers} layers")
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer[:stop]:
            x = layer(x)
        return self.layernorm(x) if last else x


def pixel_unshuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """[tiles, side, side, C] -> [tiles, side * ratio, side * ratio, C / ratio^2]: transformers'
    InternVL `pixel_shuffle`, the same views and permutes (which neighbours share a token)."""
    b, w, h, c = x.shape
    x = x.view(b, w, int(h * ratio), int(c / ratio)).permute(0, 2, 1, 3).contiguous()
    x = x.view(b, int(h * ratio), int(w * ratio), int(c / ratio ** 2))
    return x.permute(0, 2, 1, 3).contiguous()


class Projector(nn.Module):
    """LayerNorm, Linear, activation, Linear: unshuffled features -> the text width."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.unshuffle ** 2
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, cfg.text_hidden_size)
        self.act = _ACTIVATIONS[cfg.projector_hidden_act]
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLVision(nn.Module):
    """The family's vision model: tiles -> placeholder embeddings. With its `preprocessor`
    (set by `load_vision`) it takes decoded images: `preprocess`, then `forward` per image."""

    def __init__(self, cfg: InternVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = InternViT(cfg)
        self.multi_modal_projector = Projector(cfg)
        self.preprocessor: TilePreprocessor | None = None

    @property
    def tower(self) -> nn.Module:
        """What the encoder packs (and tower LoRA would wrap): the whole vision side."""
        return self

    @property
    def geometry(self) -> TileGeometry:
        return self.preprocessor.geometry

    def preprocess(self, images: list) -> tuple[torch.Tensor, list[dict]]:
        """Decoded images -> (tiles [total, 3, size, size], each image's span metadata:
        {"num_tiles": n}, as the prompt's span has it)."""
        pixel_values, num_tiles = self.preprocessor(images)
        return pixel_values, [{"num_tiles": n} for n in num_tiles]

    def patches(self, width: int, height: int) -> int:
        """An image's cost for batching: its tiles' tower tokens."""
        return self.geometry.patches(width, height)

    def video_input(self, frames: torch.Tensor, plan) -> tuple[torch.Tensor, list[dict]]:
        """A video's normalised frames [n, 3, size, size] -> the tower's input: each frame one
        tile (InternVLProcessor hands them to the model as images), one entry per frame."""
        if tuple(frames.shape[-2:]) != (self.cfg.image_size, self.cfg.image_size):
            raise ValueError(f"video frames of {frames.shape[-1]}x{frames.shape[-2]} are not the tower's "
                             f"{self.cfg.image_size}-pixel tiles (the video processor's size)")
        return frames, [{"num_tiles": 1} for _ in range(frames.shape[0])]

    def embed_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, size, size] -> [tiles, tokens_per_tile, text hidden]: transformers' get_image_features."""
        x = self.vision_tower.features(pixel_values)[:, 1:]  # drop CLS: [tiles, patches, hidden]
        side = int(x.shape[1] ** 0.5)
        x = pixel_unshuffle(x.reshape(x.shape[0], side, side, -1), self.cfg.downsample_ratio)
        return self.multi_modal_projector(x.reshape(x.shape[0], -1, x.shape[-1]))

    def forward(self, pixel_values: torch.Tensor, metas: list[dict]) -> list[MMEntry]:
        """Tiles of several images, each image's in a row -> one MMEntry per image: its
        tiles' tokens in order, `[tiles * tokens_per_tile, text hidden]`, and its metadata."""
        num_tiles = [meta["num_tiles"] for meta in metas]
        assert sum(num_tiles) == pixel_values.shape[0], f"{num_tiles} tiles for {pixel_values.shape[0]}"
        out = self.embed_tiles(pixel_values.to(self.cls_dtype))
        entries, start = [], 0
        for n, meta in zip(num_tiles, metas):
            entries.append(MMEntry(embeddings=out[start:start + n].reshape(-1, out.shape[-1]), meta=dict(meta)))
            start += n
        return entries

    @property
    def cls_dtype(self) -> torch.dtype:
        return self.vision_tower.embeddings.cls_token.dtype


def _rule(name: str):
    for prefix, ours in _PREFIXES.items():
        if name.startswith(prefix):
            return ours + name[len(prefix):], None
    return None


def load_vision_weights(model_dir: str | Path, hf_config, dtype: torch.dtype,
                        device: str | torch.device = "cpu") -> InternVLVision:
    """The tower and projector of the checkpoint, weights filled, in eval mode (no preprocessor)."""
    cfg = InternVisionConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = InternVLVision(cfg)
    model = materialize(model, device, dtype)
    load_weights(model, model_dir, _rule, describe=lambda p, s: "model." + p)
    return model.eval()


def load_vision(model_dir: str | Path, hf_config, dtype: torch.dtype, device: str | torch.device = "cpu",
                processor_kwargs: dict | None = None) -> InternVLVision:
    """The family's vision model: weights filled, the checkpoint's image processor attached
    (`processor_kwargs`: --mm-processor-kwargs, prompt_format.PROCESSOR_KWARGS)."""
    model = load_vision_weights(model_dir, hf_config, dtype, device)
    model.preprocessor = TilePreprocessor(model_dir, processor_kwargs)
    if model.geometry.tokens_per_tile != model.cfg.tokens_per_tile:
        raise ValueError(f"{model_dir}: processor_config.json image_seq_length {model.geometry.tokens_per_tile} "
                         f"is not the {model.cfg.tokens_per_tile} tokens a tile gives")
    if model.geometry.merge_size != model.cfg.unshuffle:
        raise ValueError(f"{model_dir}: the geometry's {model.geometry.merge_size} patches a side per token are not "
                         f"the tower's {model.cfg.unshuffle}")
    if model.geometry.tile_size != model.cfg.image_size:
        raise ValueError(f"{model_dir}: the image processor's {model.geometry.tile_size}-pixel tiles are not "
                         f"the tower's {model.cfg.image_size}")
    return model
