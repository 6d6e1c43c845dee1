"""Qwen2.5-Omni's TMRoPE as a position rule (engine/models/positions.py's `PositionRule`).

Without a video, the thinker's `get_rope_index` places an image as Qwen2.5-VL's
M-RoPE does (its t row `group x position_id_per_seconds`: 0 for an image's one
group) and an audio clip's tokens like text, one position each on all three
rows; the text after either resumes at the largest position + 1. So this rule
is Qwen's M-RoPE with audio spans read as text. A video's own sound track
interleaved by time (`use_audio_in_video`) is not taken yet: Qwen2.5-Omni
videos are refused by name (prompt_format.py).
"""
from __future__ import annotations

import torch

from epd.families.qwen_omni.prompt_format import AUDIO_FRAMES, audio_tokens_of_frames
from epd.families.qwen_vl.positions import MRopePositions


def audio_span_meta(num_frames: int) -> dict:
    return {AUDIO_FRAMES: num_frames}


class OmniPositions(MRopePositions):
    """Three rows: images on their merged grid, audio and text one position per token."""

    def prompt_positions(self, num_tokens: int, spans=()) -> tuple[torch.Tensor, int]:
        return super().prompt_positions(num_tokens, [s for s in spans if AUDIO_FRAMES not in s.meta])

    def check_spans(self, spans) -> None:
        """An audio span's frames give its length; every other span is an image's (MRopePositions')."""
        for span in spans:
            if AUDIO_FRAMES in span.meta:
                frames = span.meta[AUDIO_FRAMES]
                if not (type(frames) is int and frames > 0 and audio_tokens_of_frames(frames) == span.length):
                    raise ValueError(f"span at {span.offset}: audio_frames {frames!r:.40} does not give its "
                                     f"{span.length} tokens")
        super().check_spans([s for s in spans if AUDIO_FRAMES not in s.meta])
