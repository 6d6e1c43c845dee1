"""Audio clips -> one embedding entry each, through the family's audio side (offline, aggregated).

A clip arrives as raw bytes of an audio file (wav, mp3, flac...: decoded and
made mono here with PyAV, like a video) or as (samples, sampling_rate), as
vLLM's `multi_modal_data={"audio": [...]}` takes it. Its key is its content's:
the bytes (or the float32 samples and their rate) hashed with the model's
fingerprint, the family and the feature extractor's settings, so a clip
repeated across requests is encoded once and two feature settings never share
an entry (docs/decisions/audio-items.md). The family's audio side
(`ModelFamily.audio`) gives the features, their span metadata and the tower.
"""
from __future__ import annotations

import numpy as np
import torch

from epd.families.registry import family_of
from epd.transport.media.audio_samples import decode_audio
from epd.transport.embedding_cache.mm_cache import audio_key_config, mm_hash
from epd.transport.embedding_cache.mm_entry import MMEntry

MAX_AUDIO_BYTES = 1 << 30  # offline: the caller's own files, bounded only against a mistake


class AudioClip:
    """One clip, decoded: its samples, their rate and its content key."""

    def __init__(self, samples: np.ndarray, sampling_rate: int, mm_hash: str):
        self.samples, self.sampling_rate, self.mm_hash = samples, sampling_rate, mm_hash


class AudioEncoder:
    def __init__(self, model_dir: str, hf_config, dtype: torch.dtype, device: str = "cpu", *,
                 model_fingerprint: str):
        family = family_of(hf_config)
        self.audio = family.load_audio(model_dir, hf_config, dtype, device)
        self._key_config = audio_key_config(family.model_type, self.audio.settings)
        self.model_fingerprint = model_fingerprint

    def clip(self, audio) -> AudioClip:
        """Raw bytes of an audio file, or (samples, sampling_rate) -> the decoded clip and its key."""
        if isinstance(audio, (bytes, bytearray, memoryview)):
            data = bytes(audio)
            if len(data) > MAX_AUDIO_BYTES:
                raise ValueError(f"an audio file of {len(data)} bytes is over {MAX_AUDIO_BYTES}")
            samples, rate = decode_audio(data)
            return AudioClip(samples, rate, mm_hash(data, self.model_fingerprint, self._key_config))
        if not (isinstance(audio, tuple) and len(audio) == 2):
            raise ValueError("an audio item is the bytes of an audio file or (samples, sampling_rate), got "
                             f"{type(audio).__name__}")
        samples, rate = audio
        samples = np.asarray(samples, dtype=np.float32)
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise ValueError(f"an audio clip's sampling rate is a positive int, got {rate!r}")
        key = mm_hash(samples.tobytes(), self.model_fingerprint, {**self._key_config, "sampling_rate": int(rate),
                                                                   "shape": list(samples.shape)})
        return AudioClip(samples, int(rate), key)

    def encode_served(self, data: bytes, key: str, num_tokens: int) -> MMEntry:
        """A served clip (an EncodeRequest's file bytes) -> its entry, checked against what the API
        counted and keyed (epd/inputs/audio_header.py); ValueError naming a mismatch or a bad file."""
        clip = self.clip(data)
        if clip.mm_hash != key:
            raise ValueError("the API keyed this audio clip under other feature settings than this encoder's")
        entry = self.encode([clip])[key]
        if entry.embeddings.shape[0] != num_tokens:
            raise ValueError(f"the audio clip gives {entry.embeddings.shape[0]} embeddings; the API counted "
                             f"{num_tokens} placeholder tokens")
        return entry

    def encode(self, clips: list[AudioClip]) -> dict[str, MMEntry]:
        """Each distinct clip's entry by its key: features, then one tower pass over them all."""
        distinct = {c.mm_hash: c for c in clips}
        features = [self.audio.features(c.samples, c.sampling_rate) for c in distinct.values()]
        if not features:
            return {}
        embeds = self.audio.forward(features)
        return {key: MMEntry(e, {}, self.audio.span_meta(f)) for key, e, f in zip(distinct, embeds, features)}
