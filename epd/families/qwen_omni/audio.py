"""Qwen2.5-Omni's audio side: samples -> the checkpoint's log-mel features -> the tower's embeddings.

`features` runs the checkpoint's own feature extractor (transformers'
WhisperFeatureExtractor, as Qwen2_5OmniProcessor calls it: padded to 30 s,
then cut to the clip's frames), after resampling to its rate; `forward` is
the tower (audio_tower.py), built and filled from the thinker's
`audio_tower.*` tensors. What the encoders use
(epd/families/model_family.py `ModelFamily.audio`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from epd.families.qwen_omni.audio_tower import AudioConfig, AudioTower
from epd.families.qwen_omni.positions import audio_span_meta
from epd.families.qwen_omni.prompt_format import SAMPLING_RATE, feature_settings, num_audio_frames
from epd.families.qwen_omni.thinker_config import strip_thinker, thinker_config
from epd.transport.media.audio_samples import resample
from epd.transport.weights.checkpoint import load_weights, materialize

_PREFIXES = ("model.audio_tower.", "audio_tower.")


def _audio_rule(name: str):
    name = strip_thinker(name)
    if name is None or name.endswith("audio_bos_eos_token.weight"):  # not used by the thinker
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):], None
    return None


def load_audio_tower(model_dir: str | Path, hf_config, dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> AudioTower:
    cfg = AudioConfig.from_hf(thinker_config(hf_config).audio_config)
    with torch.device("meta"):
        tower = AudioTower(cfg)
    tower = materialize(tower, device, dtype)
    tower.reset_positions(device)
    load_weights(tower, model_dir, _audio_rule, describe=lambda p, s: "thinker.audio_tower." + p)
    return tower.eval()


class OmniAudio:
    """Clips -> log-mel features [num_mel_bins, frames] -> embeddings [num_tokens, hidden] each."""

    def __init__(self, model_dir: str | Path, hf_config, dtype: torch.dtype, device: str = "cpu"):
        from transformers import WhisperFeatureExtractor

        self.extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        if self.extractor.sampling_rate != SAMPLING_RATE or self.extractor.hop_length != 160:
            raise ValueError(f"{model_dir}: a feature extractor at {self.extractor.sampling_rate} Hz, hop "
                             f"{self.extractor.hop_length}, is not Qwen2.5-Omni's (16000 Hz, hop 160)")
        self.tower = load_audio_tower(model_dir, hf_config, dtype, device)
        self.dtype, self.device = dtype, device
        # what the key of a clip's embeddings includes beside its samples: the feature settings
        self.settings = feature_settings(self.extractor)

    def features(self, samples: np.ndarray, sampling_rate: int) -> torch.Tensor:
        """Mono samples -> [num_mel_bins, frames], the features Qwen2_5OmniProcessor gives the thinker."""
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim != 1 or samples.size == 0:
            raise ValueError(f"an audio clip is one channel of samples, got shape {samples.shape}")
        if not np.isfinite(samples).all():
            raise ValueError("an audio clip holds NaN or infinite samples")
        samples = resample(samples, int(sampling_rate), SAMPLING_RATE)  # as the API counts a served clip's
        out = self.extractor(samples, sampling_rate=SAMPLING_RATE, padding="max_length", return_attention_mask=True,
                             return_tensors="np")
        frames = num_audio_frames(len(samples))
        assert int(out["attention_mask"].sum()) == frames, "the processor kept other frames than counted"
        return torch.from_numpy(out["input_features"][0, :, :frames])

    def span_meta(self, features: torch.Tensor) -> dict:
        """The clip's span metadata (MMSpan.meta: what positions.py reads)."""
        return audio_span_meta(features.shape[1])

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """One [num_mel_bins, frames] per clip -> one [num_tokens, hidden] each."""
        return self.tower([f.to(self.device, self.dtype) for f in features])


def load_audio(model_dir, hf_config, dtype, device="cpu") -> OmniAudio:
    return OmniAudio(model_dir, hf_config, dtype, device)
