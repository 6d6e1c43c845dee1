"""Gemma 3's prompt format and image geometry, torch-free: `GEMMA3_FORMAT`, a
`PromptFormat` (transport/media/prompt_format.py), and `Gemma3Geometry`.

The chat template writes one `<start_of_image>` (the tokenizer's `boi_token`)
per image; Gemma3Processor replaces it with
"\\n\\n<start_of_image>" + `<image_soft_token>` x image_seq_length + "<end_of_image>\\n\\n",
and each soft token takes one of the projector's embeddings. Every image is
resized to the tower's square input, so its token count is the config's
`mm_tokens_per_image` whatever its size, and its cost the tower's patches.

Pan-and-scan (`do_pan_and_scan`: extra crops of a long image, each its own run
of soft tokens between text) is refused by name: an image is one run of
placeholders here. Gemma 3 takes no video.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.video_geometry import VideoPlan

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"
PAN_AND_SCAN = "do_pan_and_scan"
# --mm-processor-kwargs keys Gemma 3 takes: pan-and-scan's, which must stay off
PROCESSOR_KWARGS = (PAN_AND_SCAN,)


def expand_image(num_tokens: int) -> str:
    """The template's `<start_of_image>` -> the processor's full image sequence (Gemma3Processor
    `full_image_sequence`)."""
    return f"\n\n{BOI_TOKEN}{IMAGE_SOFT_TOKEN * num_tokens}{EOI_TOKEN}\n\n"


def expand_video(plan: VideoPlan, placeholder: str) -> str:
    raise ValueError("Gemma 3 takes no video")


@dataclass(frozen=True)
class Gemma3Geometry:
    """Every image: one square crop of `image_size` pixels, `mm_tokens_per_image` tokens."""

    mm_tokens_per_image: int
    image_size: int
    patch_size: int

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> "Gemma3Geometry":
        """From config.json (token count, tower input) and preprocessor_config.json; ValueError
        for pan-and-scan, in either, or for a processor kwarg Gemma 3 does not take."""
        model_dir = Path(model_dir)
        kwargs = dict(processor_kwargs or {})
        unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(f"--mm-processor-kwargs {', '.join(unknown)}: Gemma 3 takes only {PAN_AND_SCAN}")
        pre_path = model_dir / "preprocessor_config.json"
        pre = json.loads(pre_path.read_text()) if pre_path.exists() else {}
        if kwargs.get(PAN_AND_SCAN, pre.get(PAN_AND_SCAN)):
            raise ValueError(f"{PAN_AND_SCAN} (Gemma 3's pan-and-scan crops) is not supported; turn it off")
        cfg = json.loads((model_dir / "config.json").read_text())
        vision = cfg.get("vision_config") or {}
        tokens = int(cfg.get("mm_tokens_per_image", 256))
        geometry = cls(tokens, int(vision.get("image_size", 224)), int(vision.get("patch_size", 16)))
        size = pre.get("size") or {}
        if size and (size.get("height"), size.get("width")) != (geometry.image_size, geometry.image_size):
            raise ValueError(f"preprocessor_config.json size {size} is not the tower's {geometry.image_size}²")
        side = geometry.image_size // geometry.patch_size
        per_side = round(tokens ** 0.5)
        if per_side ** 2 != tokens or side % per_side:
            raise ValueError(f"mm_tokens_per_image {tokens} does not pool the tower's {side}x{side} patches")
        return geometry

    def num_image_tokens(self, width: int, height: int) -> int:
        """The soft tokens an image takes: the same for every size."""
        return self.mm_tokens_per_image

    def patches(self, width: int, height: int) -> int:
        """The tower's patches for one image: its cost for batching."""
        return (self.image_size // self.patch_size) ** 2

    def span_meta(self, width: int, height: int) -> dict:
        """None: an image's tokens sit at their indices (1-D RoPE), whatever its size."""
        return {}


GEMMA3_FORMAT = PromptFormat(
    image_placeholder=BOI_TOKEN,
    video_placeholders=(),
    image_token=IMAGE_SOFT_TOKEN,
    video_token="",
    expand_image=expand_image,
    expand_video=expand_video,
    image_geometry=Gemma3Geometry.from_pretrained,
)
