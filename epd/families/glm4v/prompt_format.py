"""GLM-4.1V's prompt format and image geometry, torch-free: `GLM4V_FORMAT`, a
`PromptFormat` (transport/media/prompt_format.py), and `Glm4vImageGeometry`.

The chat template writes `<|begin_of_image|><|image|><|end_of_image|>` for an
image; Glm4vProcessor repeats the `<|image|>` once per placeholder token
(t * h * w / merge^2 of the image's grid), inside the template's pair. A
video's `<|video|>` (inside `<|begin_of_video|>...<|end_of_video|>`) becomes,
per temporal group, `<|begin_of_image|>` + the group's `<|image|>` tokens +
`<|end_of_image|>` + the group's first frame's time in whole seconds: a
video's placeholder positions hold the image token too.

The geometry is Glm4vImageProcessor's `smart_resize` (its own: the pixel
bounds count both frames of a temporal patch, and a side shorter than one
merged patch is first scaled up; video_geometry.py holds it, the video
processor's rule too), from the checkpoint's preprocessor_config.json
(`size`: shortest_edge / longest_edge, in pixels); the encoder resizes by the
same rule (image_processor.py checks it). A video's plan is
`Glm4vVideoGeometry` (video_geometry.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.glm4v.video_geometry import Glm4vVideoGeometry, smart_resize
from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.video_geometry import VideoPlan

IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"
BEGIN_IMAGE = "<|begin_of_image|>"
END_IMAGE = "<|end_of_image|>"
# the processor's defaults (Glm4vImageProcessor), where preprocessor_config.json is silent
DEFAULT_SIZE = {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}
# --mm-processor-kwargs keys the image processor takes and the geometry models
PROCESSOR_KWARGS = ("size",)


def check_processor_kwargs(kwargs: dict) -> None:
    """ValueError for an --mm-processor-kwargs key we cannot apply, or a bad value."""
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"--mm-processor-kwargs: {', '.join(unknown)} cannot be applied here; the image "
                         f"processor takes {', '.join(PROCESSOR_KWARGS)}")
    size = kwargs.get("size", {})
    if not isinstance(size, dict) or set(size) - set(DEFAULT_SIZE):
        raise ValueError(f"--mm-processor-kwargs: size must be a map of {' and '.join(DEFAULT_SIZE)}, got {size!r}")
    for key, value in size.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--mm-processor-kwargs: size.{key} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Glm4vImageGeometry:
    """The resize rule of the checkpoint's Glm4vImageProcessor: an image's grid
    and token count from its width and height alone."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size.shortest_edge
    max_pixels: int  # size.longest_edge

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> "Glm4vImageGeometry":
        """`processor_kwargs` (--mm-processor-kwargs): its `size` keys over the file's
        (ValueError for another key or a bad value)."""
        check_processor_kwargs(processor_kwargs or {})
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        size = {**DEFAULT_SIZE, **(cfg.get("size") or {}), **(processor_kwargs or {}).get("size", {})}
        return cls(patch_size=int(cfg.get("patch_size", 14)), merge_size=int(cfg.get("merge_size", 2)),
                   temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
                   min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]))

    @property
    def size(self) -> dict[str, int]:
        """The processor's `size` setting this geometry models."""
        return {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the processor's resize (a still image is one
        temporal patch: `temporal_patch_size` copies of itself)."""
        if width < 1 or height < 1:
            raise ValueError(f"image has an empty dimension ({width}x{height})")
        t = self.temporal_patch_size
        h_bar, w_bar = smart_resize(t, height, width, t, self.patch_size * self.merge_size,
                                    self.min_pixels, self.max_pixels)
        return w_bar, h_bar

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """Vision grid in patches (t, h, w) of a still image."""
        w, h = self.resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the image takes in the prompt (merged patches)."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w // self.merge_size ** 2

    def patches(self, width: int, height: int) -> int:
        """The tower's patches (t x h x w)."""
        t, h, w = self.grid_thw(width, height)
        return t * h * w

    def span_meta(self, width: int, height: int) -> dict:
        """{"grid_thw": (t, h, w)}: what the 3-D positions place the image's tokens by."""
        return {"grid_thw": self.grid_thw(width, height)}


def expand_image(num_tokens: int) -> str:
    """The template's one `<|image|>` -> one per placeholder token (the begin / end pair is the template's)."""
    return IMAGE_TOKEN * num_tokens


def expand_video(plan: VideoPlan, placeholder: str) -> str:
    """A video's `<|video|>` -> each temporal group as an image followed by its time in
    whole seconds (Glm4vProcessor.replace_video_token; `group_timestamps_s`: each group's
    first frame's time)."""
    return "".join(f"{BEGIN_IMAGE}{IMAGE_TOKEN * plan.tokens_per_group}{END_IMAGE}{int(t)}"
                   for t in plan.group_timestamps_s)


GLM4V_FORMAT = PromptFormat(
    image_placeholder=IMAGE_TOKEN,
    video_placeholders=(VIDEO_TOKEN,),
    image_token=IMAGE_TOKEN,
    video_token=IMAGE_TOKEN,  # a video's positions hold the image token (Glm4vProcessor)
    expand_image=expand_image,
    expand_video=expand_video,
    image_geometry=Glm4vImageGeometry.from_pretrained,
    image_kwargs=PROCESSOR_KWARGS,
    check_image_kwargs=check_processor_kwargs,
    video_geometry=Glm4vVideoGeometry.from_pretrained,
)
