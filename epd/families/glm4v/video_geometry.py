"""GLM-4.1V's video plan from the container's header alone, torch-free: which
frames Glm4vVideoProcessor samples, the size it resizes them to, the grid and
tokens they take and the time its processor writes after each temporal group.

    frames      `fps` a second (2 by default) over the video's duration, each
                index rounded up; past `max_duration` (300 s) that many
                seconds' worth spread over the whole video; repeats dropped,
                the last frame repeated to an even count
    size        `smart_resize` with the frames' count (the pixel bounds cover
                every sampled frame: size.shortest_edge / longest_edge of
                video_preprocessor_config.json; Glm4vImageProcessor's rule too,
                with a still image's two frames: prompt_format.py)
    groups      two frames each; a group's time is its first frame's
                (Glm4vProcessor: `timestamps[::2]`), written in whole seconds
                by prompt_format.expand_video

Of a request's video keys only `fps` and `do_sample_frames` apply: the
processor ignores `num_frames` (its sample_frames takes fps only) and does not
know min / max_pixels or min / max_frames (it logs them as unused). The encoder
resizes, normalises and patchifies the planned frames as for Qwen2-VL
(encoders/video_processor.py: the same operations and patch order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epd.transport.media.video_geometry import (VideoMeta, VideoOptions, VideoPlan, VideoPlanError,
                                                fit_frames, frame_indices, load_video_config)

MAX_ASPECT_RATIO = 200  # the processor refuses anything longer
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD: the processor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                 min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Glm4vImageProcessor's `smart_resize`: (height, width) as multiples of
    `factor`, num_frames x height x width within [min_pixels, max_pixels], the
    aspect kept as near as may be. ValueError for an aspect ratio over 200."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
    return fit_frames(num_frames, height, width, temporal_factor, factor, min_pixels, max_pixels)


# Glm4vVideoProcessor's class defaults, where the checkpoint's config is silent
DEFAULTS = dict(patch_size=14, merge_size=2, temporal_patch_size=2, fps=2, max_duration=300,
                do_sample_frames=True, size={"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
                image_mean=CLIP_MEAN, image_std=CLIP_STD, rescale_factor=1 / 255)


@dataclass(frozen=True)
class Glm4vVideoGeometry:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size.shortest_edge, over all sampled frames
    max_pixels: int  # size.longest_edge
    fps: float
    max_duration: int  # seconds sampled at `fps`; a longer video gets that many frames, spread
    do_sample_frames: bool
    image_mean: tuple[float, float, float] = CLIP_MEAN  # the encoder's normalisation of a frame
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Glm4vVideoGeometry":
        """From video_preprocessor_config.json, else preprocessor_config.json, as transformers reads them."""
        return cls.from_config(load_video_config(model_dir))

    @classmethod
    def from_config(cls, cfg: dict) -> "Glm4vVideoGeometry":
        get = lambda key: cfg.get(key, DEFAULTS[key])  # noqa: E731
        size = {**DEFAULTS["size"], **(cfg.get("size") or {})}
        return cls(patch_size=int(get("patch_size")), merge_size=int(get("merge_size")),
                   temporal_patch_size=int(get("temporal_patch_size")), min_pixels=int(size["shortest_edge"]),
                   max_pixels=int(size["longest_edge"]), fps=float(get("fps")),
                   max_duration=int(get("max_duration")), do_sample_frames=bool(get("do_sample_frames")),
                   image_mean=tuple(get("image_mean")), image_std=tuple(get("image_std")),
                   rescale_factor=float(get("rescale_factor")))

    def check_request(self, meta: VideoMeta, request: VideoOptions, server: VideoOptions = VideoOptions()) -> None:
        """Nothing to bound: of a request's keys only `fps` and `do_sample_frames` apply, and
        the frames sampled never pass the container's (repeats are dropped)."""

    def sample_frames(self, meta: VideoMeta, fps: float | None = None) -> list[int]:
        """Glm4vVideoProcessor.sample_frames: the frame indices, an even count."""
        if not meta.fps:
            raise VideoPlanError("sampling by fps needs the video's frame rate, which its header lacks")
        fps = self.fps if fps is None else fps
        last = meta.num_frames - 1
        duration = meta.duration_s or round(last / meta.fps) + 1
        if duration <= self.max_duration:
            count = max(int(math.floor(duration * fps)), 1)
            indices = [min(last, int(math.ceil(i * meta.fps / fps))) for i in range(count)]
        elif int(self.max_duration * fps) >= meta.num_frames:
            indices = list(range(meta.num_frames))
        else:
            seconds = np.linspace(0, duration, int(self.max_duration * fps), endpoint=True)
            indices = [min(last, int(math.ceil(s * meta.fps))) for s in seconds]
        indices = list(dict.fromkeys(indices))  # repeats dropped, order kept
        if len(indices) % 2:
            indices.append(indices[-1])
        return indices

    def plan(self, meta: VideoMeta, options: VideoOptions = VideoOptions(),
             loaded: list[int] | None = None) -> VideoPlan:
        """The sampled frames, their resized size, grid, tokens and group times;
        VideoPlanError where transformers' processor would raise. `options`: its
        fps and do_sample_frames. `loaded`: frames a loader took before the
        processor, used as they are."""
        indices = frame_indices(meta, options, loaded, self.do_sample_frames,
                                lambda: self.sample_frames(meta, options.fps))
        tps = self.temporal_patch_size
        if len(indices) < tps:
            raise VideoPlanError(f"{len(indices)} frame(s); the model needs at least {tps}")
        try:
            height, width = smart_resize(len(indices), meta.height, meta.width, tps,
                                         self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise VideoPlanError(str(exc).replace("image", "video")) from None
        t = -(-len(indices) // tps)  # the last frame repeats to fill a group
        grid = (t, height // self.patch_size, width // self.patch_size)
        per_group = grid[1] * grid[2] // self.merge_size ** 2
        padded = indices + [indices[-1]] * (t * tps - len(indices))
        times = tuple(i / (meta.fps or 24) for i in padded[::tps])  # Glm4vProcessor: 24 fps without a rate
        return VideoPlan(tuple(indices), height, width, grid, t * per_group, per_group, times)
