"""InternVL's prompt format and image geometry, torch-free: `INTERNVL_FORMAT`,
a `PromptFormat` (transport/media/prompt_format.py), and `TileGeometry`.

The release's chat template writes `<IMG_CONTEXT>` once per image; it becomes
`<img>` + `<IMG_CONTEXT>` x (tokens per tile x tiles) + `</img>`, as
transformers' InternVLProcessor writes it. An image is cut into square tiles
(GotOcr2's `crop_to_patches`: the grid of at most `max_patches` and at least
`min_patches` tiles whose aspect is nearest the image's, plus a thumbnail of
the whole image when the grid has more than one tile); `TileGeometry` counts
them from the width and height alone, with the processor's settings
(preprocessor_config.json's size and min/max patches, processor_config.json's
`image_seq_length`; InternVLProcessor crops unless told not to, whatever
the image processor's own file says). A video's `<video>` becomes its frames,
each one tile's tokens inside `<img>`, `</img>` after "Frame{i}: ", a newline
apart (InternVLProcessor); which frames is `InternVLVideoGeometry`
(video_geometry.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from epd.families.internvl.video_geometry import InternVLVideoGeometry
from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.video_geometry import VideoPlan

IMG_CONTEXT = "<IMG_CONTEXT>"
IMG_START = "<img>"
IMG_END = "</img>"
VIDEO = "<video>"
# --mm-processor-kwargs keys the InternVL processor takes and `TileGeometry` models
PROCESSOR_KWARGS = ("crop_to_patches", "min_patches", "max_patches")


@lru_cache(maxsize=16)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) with min_tiles <= columns * rows <= max_tiles, fewest tiles first
    (a stable sort of the columns-major list: GotOcr2's `get_all_supported_aspect_ratios`)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def best_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) whose aspect is nearest the image's; on a tie the later (more tiles) while
    the image covers more than half of the tiles' area (GotOcr2's `get_optimal_tiled_canvas`)."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in tile_grids(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class TileGeometry:
    """An image's tiles and placeholder tokens from its size, as the InternVL processor counts them."""

    tile_size: int  # a tile's side in pixels (preprocessor_config.json size)
    tokens_per_tile: int  # processor_config.json image_seq_length
    crop_to_patches: bool
    min_patches: int
    max_patches: int
    merge_size: int = 2  # patches a side per token: the pixel-unshuffle (1 / config.json downsample_ratio)

    def __post_init__(self):
        side = int(round(self.tokens_per_tile ** 0.5))
        if side * side != self.tokens_per_tile:
            raise ValueError(f"image_seq_length {self.tokens_per_tile} is not a square number of tokens")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_kwargs: dict | None = None) -> "TileGeometry":
        """`processor_kwargs` (--mm-processor-kwargs): crop_to_patches, min/max_patches over the files'."""
        model_dir = Path(model_dir)
        image = json.loads((model_dir / "preprocessor_config.json").read_text())
        path = model_dir / "processor_config.json"
        processor = json.loads(path.read_text()) if path.exists() else {}
        model = json.loads((model_dir / "config.json").read_text())
        kwargs = processor_kwargs or {}
        check_processor_kwargs(kwargs)
        size = image.get("size") or {}
        if size.get("height") != size.get("width") or not size.get("height"):
            raise ValueError(f"{model_dir}: preprocessor_config.json size {size!r} is not a square tile")
        return cls(
            tile_size=int(size["height"]),
            tokens_per_tile=int(processor.get("image_seq_length", 256)),
            crop_to_patches=bool(kwargs.get("crop_to_patches", True)),  # InternVLProcessor's default
            min_patches=int(kwargs.get("min_patches", image.get("min_patches", 1))),
            max_patches=int(kwargs.get("max_patches", image.get("max_patches", 12))),
            merge_size=int(round(1 / float(model.get("downsample_ratio", 0.5)))),
        )

    def num_tiles(self, width: int, height: int) -> int:
        """The image's tiles: its grid's, plus the thumbnail when the grid has more than one."""
        if width < 1 or height < 1:
            raise ValueError(f"image has an empty dimension ({width}x{height})")
        if not self.crop_to_patches or self.max_patches <= 1:
            return 1
        columns, rows = best_grid(width, height, self.tile_size, self.min_patches, self.max_patches)
        return 1 if columns * rows == 1 else columns * rows + 1

    def num_image_tokens(self, width: int, height: int) -> int:
        """The `<IMG_CONTEXT>` tokens the image takes (the `<img>`, `</img>` around them are text)."""
        return self.num_tiles(width, height) * self.tokens_per_tile

    def patches(self, width: int, height: int) -> int:
        """The image's work for the tower: its tiles' patches (CLS excluded), `merge_size`^2 a token."""
        return self.num_image_tokens(width, height) * self.merge_size ** 2

    def span_meta(self, width: int, height: int) -> dict:
        """The image span's metadata: its tiles (the vision side's entry carries the same)."""
        return {"num_tiles": self.num_tiles(width, height)}


def check_processor_kwargs(kwargs: dict) -> None:
    """ValueError for an --mm-processor-kwargs key the InternVL geometry cannot apply, or a bad value."""
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"--mm-processor-kwargs: {', '.join(unknown)} cannot be applied here; the image "
                         f"processor takes {', '.join(PROCESSOR_KWARGS)}")
    if "crop_to_patches" in kwargs and not isinstance(kwargs["crop_to_patches"], bool):
        raise ValueError(f"--mm-processor-kwargs: crop_to_patches must be true or false, "
                         f"got {kwargs['crop_to_patches']!r}")
    for key in ("min_patches", "max_patches"):
        value = kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--mm-processor-kwargs: {key} must be a positive integer, got {value!r}")


def expand_image(num_tokens: int) -> str:
    """The template's one `<IMG_CONTEXT>` -> the image's tokens inside `<img>`, `</img>`."""
    return IMG_START + IMG_CONTEXT * num_tokens + IMG_END


def expand_video(plan: VideoPlan, placeholder: str) -> str:
    """The template's `<video>` -> each frame as one tile's image, labelled, a newline apart
    (InternVLProcessor.replace_video_token)."""
    return "\n".join(f"Frame{i + 1}: {IMG_START}{IMG_CONTEXT * plan.tokens_per_group}{IMG_END}"
                     for i in range(plan.grid_thw[0]))


INTERNVL_FORMAT = PromptFormat(
    image_placeholder=IMG_CONTEXT,
    video_placeholders=(VIDEO,),
    image_token=IMG_CONTEXT,
    video_token=IMG_CONTEXT,  # a video's frames are images (InternVLProcessor)
    expand_image=expand_image,
    expand_video=expand_video,
    image_geometry=TileGeometry.from_pretrained,
    image_kwargs=PROCESSOR_KWARGS,
    check_image_kwargs=check_processor_kwargs,
    video_geometry=InternVLVideoGeometry.from_pretrained,
)
