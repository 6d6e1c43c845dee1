"""Gemma 3's prompt format and image geometry, torch-free: `GEMMA3_FORMAT`, a
`PromptFormat` (transport/media/prompt_format.py), `Gemma3Geometry` and
`PanAndScan`.

The chat template writes one `<start_of_image>` (the tokenizer's `boi_token`)
per image; Gemma3Processor replaces it with
"\\n\\n<start_of_image>" + `<image_soft_token>` x image_seq_length + "<end_of_image>\\n\\n",
and each soft token takes one of the projector's embeddings. Every crop is
resized to the tower's square input, so it takes the config's
`mm_tokens_per_image` tokens whatever its size, and costs the tower's patches.

Pan-and-scan (`do_pan_and_scan`, off in the releases): Gemma3ImageProcessor
cuts an image whose sides differ by at least `pan_and_scan_min_ratio_to_activate`
into 2 to `pan_and_scan_max_num_crops` crops along its long side (`PanAndScan.num_crops`,
from its width and height alone), and Gemma3Processor writes it as "Here is the
original image", the full image sequence, "and here are some crops to help you
see better", and one full sequence per crop: 1 + num_crops runs of soft tokens
with text between them (`expand_image_runs`), one item with one content key
whose embeddings are the runs' rows in order. Gemma 3 takes no video.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.video_geometry import VideoPlan

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"
PAN_AND_SCAN = "do_pan_and_scan"
MIN_CROP_SIZE = "pan_and_scan_min_crop_size"
MAX_NUM_CROPS = "pan_and_scan_max_num_crops"
MIN_RATIO = "pan_and_scan_min_ratio_to_activate"
# --mm-processor-kwargs keys Gemma 3 takes: pan-and-scan's
PROCESSOR_KWARGS = (PAN_AND_SCAN, MIN_CROP_SIZE, MAX_NUM_CROPS, MIN_RATIO)


@dataclass(frozen=True)
class PanAndScan:
    """Gemma3ImageProcessor's pan-and-scan settings (Gemma3Processor's defaults where unset)."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    @classmethod
    def from_settings(cls, settings: dict) -> "PanAndScan":
        """From the processor's keys (a missing or null one: the default); ValueError for a bad value."""
        values = {MIN_CROP_SIZE: cls.min_crop_size, MAX_NUM_CROPS: cls.max_num_crops,
                  MIN_RATIO: cls.min_ratio_to_activate}
        values.update({k: settings[k] for k in values if settings.get(k) is not None})
        for key in (MIN_CROP_SIZE, MAX_NUM_CROPS):
            if type(values[key]) is not int or values[key] < 1:
                raise ValueError(f"{key} {values[key]!r}: a positive integer")
        ratio = values[MIN_RATIO]
        if type(ratio) not in (int, float) or not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"{MIN_RATIO} {ratio!r}: a positive number")
        return cls(values[MIN_CROP_SIZE], values[MAX_NUM_CROPS], float(ratio))

    def num_crops(self, width: int, height: int) -> int:
        """The crops Gemma3ImageProcessor's pan_and_scan (pan_and_scan_batched in its torchvision
        backend) cuts an image into (0: none, the image is its original alone), its arithmetic
        step for step."""
        long_side, short_side = max(width, height), min(width, height)
        if long_side / short_side < self.min_ratio_to_activate:
            return 0
        num = int(math.floor(long_side / short_side + 0.5))  # half rounds up
        num = min(int(math.floor(long_side / self.min_crop_size)), num)
        num = min(self.max_num_crops, max(2, num))
        crop_long = int(math.ceil(long_side / num))
        if min(crop_long, short_side) < self.min_crop_size:
            return 0
        return num


def check_processor_kwargs(kwargs: dict) -> None:
    """ValueError for a key Gemma 3's processor does not take here, or a bad value."""
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"--mm-processor-kwargs {', '.join(unknown)}: Gemma 3 takes only "
                         f"{', '.join(PROCESSOR_KWARGS)}")
    if kwargs.get(PAN_AND_SCAN) is not None and type(kwargs[PAN_AND_SCAN]) is not bool:
        raise ValueError(f"{PAN_AND_SCAN} {kwargs[PAN_AND_SCAN]!r}: true or false")
    PanAndScan.from_settings(kwargs)


def expand_image(num_tokens: int) -> str:
    """The template's `<start_of_image>` -> the processor's full image sequence (Gemma3Processor
    `full_image_sequence`)."""
    return f"\n\n{BOI_TOKEN}{IMAGE_SOFT_TOKEN * num_tokens}{EOI_TOKEN}\n\n"


def expand_image_runs(runs: tuple[int, ...]) -> str:
    """An image's runs (the original's, then each crop's) -> Gemma3Processor's text for it
    (`replace_image_token`): one run is the full image sequence alone."""
    original, *crops = (expand_image(n) for n in runs)
    if not crops:
        return original
    return (f"Here is the original image {original} and here are some crops to help you see better "
            + " ".join(crops))


def expand_video(plan: VideoPlan, placeholder: str) -> str:
    raise ValueError("Gemma 3 takes no video")


@dataclass(frozen=True)
class Gemma3Geometry:
    """Every crop: the tower's square `image_size` input, `mm_tokens_per_image` tokens. An image
    is its original alone, or with `pan_and_scan` on the original and its crops."""

    mm_tokens_per_image: int
    image_size: int
    patch_size: int
    pan_and_scan: PanAndScan | None = None  # None: do_pan_and_scan off

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> "Gemma3Geometry":
        """From config.json (token count, tower input) and preprocessor_config.json, under
        `processor_kwargs` (--mm-processor-kwargs); ValueError for a processor kwarg Gemma 3
        does not take or a bad pan-and-scan setting, in either."""
        model_dir = Path(model_dir)
        kwargs = dict(processor_kwargs or {})
        check_processor_kwargs(kwargs)
        pre_path = model_dir / "preprocessor_config.json"
        pre = json.loads(pre_path.read_text()) if pre_path.exists() else {}
        settings = {k: pre.get(k) for k in PROCESSOR_KWARGS} | {k: v for k, v in kwargs.items() if v is not None}
        try:
            check_processor_kwargs(settings)
        except ValueError as exc:
            raise ValueError(f"preprocessor_config.json: {exc}") from None
        pan_and_scan = PanAndScan.from_settings(settings) if settings[PAN_AND_SCAN] else None
        cfg = json.loads((model_dir / "config.json").read_text())
        vision = cfg.get("vision_config") or {}
        tokens = int(cfg.get("mm_tokens_per_image", 256))
        geometry = cls(tokens, int(vision.get("image_size", 224)), int(vision.get("patch_size", 16)), pan_and_scan)
        size = pre.get("size") or {}
        if size and (size.get("height"), size.get("width")) != (geometry.image_size, geometry.image_size):
            raise ValueError(f"preprocessor_config.json size {size} is not the tower's {geometry.image_size}²")
        side = geometry.image_size // geometry.patch_size
        per_side = round(tokens ** 0.5)
        if per_side ** 2 != tokens or side % per_side:
            raise ValueError(f"mm_tokens_per_image {tokens} does not pool the tower's {side}x{side} patches")
        return geometry

    def num_crops(self, width: int, height: int) -> int:
        """The image's pan-and-scan crops besides its original (0: none, or pan-and-scan off)."""
        return 0 if self.pan_and_scan is None else self.pan_and_scan.num_crops(width, height)

    def image_runs(self, width: int, height: int) -> tuple[int, ...]:
        """Its runs of soft tokens in prompt order: the original's, then each crop's."""
        return (self.mm_tokens_per_image,) * (1 + self.num_crops(width, height))

    def num_image_tokens(self, width: int, height: int) -> int:
        """The soft tokens an image takes: `mm_tokens_per_image` for the original and for each crop."""
        return self.mm_tokens_per_image * (1 + self.num_crops(width, height))

    def patches(self, width: int, height: int) -> int:
        """The tower's patches for one image, its original and crops: its cost for batching."""
        return (self.image_size // self.patch_size) ** 2 * (1 + self.num_crops(width, height))

    def span_meta(self, width: int, height: int) -> dict:
        """Its crop count when it has crops (on each of its runs' spans; the entry holds it too);
        positions need none: an image's tokens sit at their indices (1-D RoPE)."""
        num_crops = self.num_crops(width, height)
        return {"num_crops": num_crops} if num_crops else {}


GEMMA3_FORMAT = PromptFormat(
    image_placeholder=BOI_TOKEN,
    video_placeholders=(),
    image_token=IMAGE_SOFT_TOKEN,
    video_token="",
    expand_image=expand_image,
    expand_image_runs=expand_image_runs,
    expand_video=expand_video,
    image_geometry=Gemma3Geometry.from_pretrained,
    image_kwargs=PROCESSOR_KWARGS,
    check_image_kwargs=check_processor_kwargs,
)
