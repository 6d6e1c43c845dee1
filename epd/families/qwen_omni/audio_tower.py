"""Qwen2.5-Omni's audio tower (Whisper's encoder, windowed): log-mel frames -> embeddings.

A clip's frames are cut into windows of `2 * n_window` frames (the last may be
shorter); each window goes through two convolutions (the second of stride 2)
with GELU and gets the sinusoid position table from 0, so a window of w
frames gives (w - 1) // 2 + 1 rows. Pre-norm encoder layers attend within
each window; then every pair of the clip's rows is averaged (an odd last row
is dropped), layer-normed and projected to the language model's hidden size:
((frames - 1) // 2 + 1 - 2) // 2 + 1 rows a clip (prompt_format.py counts
them torch-free). Checkpoint names as transformers' (`audio_tower.*`); the
unused `audio_bos_eos_token` table is not read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epd.encoders.layers.segment_attention import segment_attention


@dataclass(frozen=True)
class AudioConfig:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    n_window: int  # half a window, in frames
    max_source_positions: int
    output_dim: int  # the language model's hidden size

    @classmethod
    def from_hf(cls, ac) -> "AudioConfig":
        if getattr(ac, "activation_function", "gelu") != "gelu":
            raise ValueError(f"audio activation {ac.activation_function!r} is not supported (gelu is)")
        if getattr(ac, "scale_embedding", False):
            raise ValueError("an audio tower with scale_embedding=true is not supported")
        return cls(num_mel_bins=ac.num_mel_bins, d_model=ac.d_model, num_layers=ac.encoder_layers,
                   num_heads=ac.encoder_attention_heads, ffn_dim=ac.encoder_ffn_dim, n_window=ac.n_window,
                   max_source_positions=ac.max_source_positions, output_dim=ac.output_dim)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] Whisper's position table: sines then cosines (float32)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))  # [n, H, D]
        return self.out_proj(segment_attention(q, k, v, seq_lens).reshape(n, -1))


class AudioLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), seq_lens)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioTower(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.output_dim)
        self.reset_positions(self.conv1.weight.device)

    def reset_positions(self, device) -> None:
        """The sinusoid table: computed, not a weight."""
        self.positions = sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(device)

    def _window(self, frames: torch.Tensor) -> torch.Tensor:
        """[num_mel_bins, w] -> [(w - 1) // 2 + 1, d_model]: the convolutions and the position table."""
        x = F.gelu(self.conv1(frames.unsqueeze(0).to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x))[0].transpose(0, 1)
        return x + self.positions[:x.shape[0]].to(x.dtype)

    @torch.inference_mode()
    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """One [num_mel_bins, num_frames] log-mel per clip -> one [num_tokens, output_dim] each."""
        step = 2 * self.cfg.n_window
        rows, window_lens, clip_rows = [], [], []
        for mel in features:
            n = 0
            for start in range(0, mel.shape[1], step):
                x = self._window(mel[:, start:start + step])
                rows.append(x)
                window_lens.append(x.shape[0])
                n += x.shape[0]
            clip_rows.append(n)
        x = torch.cat(rows)  # [sum of rows, d_model]
        for layer in self.layers:
            x = layer(x, window_lens)
        out = []
        for h in x.split(clip_rows):
            pairs = (h.shape[0] - 2) // 2 + 1
            pooled = (h[0:2 * pairs:2] + h[1:2 * pairs:2]) / 2  # [pairs, d_model]: the stride-2 average pool
            out.append(self.proj(self.ln_post(pooled)))
        return out
