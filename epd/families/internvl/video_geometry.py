"""InternVL's video plan from the container's header alone, torch-free: which
frames InternVLVideoProcessor takes and the tokens InternVLProcessor writes
for them (a video is frames, each one tile).

    frames      every frame, unless sampling is on (`do_sample_frames`: the
                config's, or a request's): `num_frames` of them, else `fps` a
                second (int(frames / rate x fps)), at
                arange(shift, frames, frames / n) truncated, where the
                `initial_shift` true (the default) starts half a step in
    size        each frame resized whole to the processor's `size` (height x
                width, the tower's tile: no dynamic tiling, no thumbnail)
    tokens      per frame `image_seq_length` (processor_config.json), written
                "Frame{i}: <img>" + the tokens + "</img>", frames joined by a
                newline (prompt_format.expand_video)

A frame is a temporal group of one: one span and one entry each (the plan's
`group_timestamps_s` are the frames' times, index / the stream's rate, which
the prompt does not write; transport/media/video_keys.py keys an entry per
group where a plan has them). Of a request's video keys `num_frames`, `fps`
and `do_sample_frames` apply; the processor knows no pixel or frame bounds.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epd.transport.media.video_geometry import (VideoKwargsError, VideoMeta, VideoOptions, VideoPlan,
                                                VideoPlanError, frame_indices, load_video_config)

# InternVLVideoProcessor's class defaults, where the checkpoint's config is silent (OPENAI_CLIP_MEAN / _STD)
DEFAULTS = dict(size={"height": 384, "width": 384}, image_mean=(0.48145466, 0.4578275, 0.40821073),
                image_std=(0.26862954, 0.26130258, 0.27577711), rescale_factor=1 / 255, do_sample_frames=False,
                num_frames=None, fps=None, initial_shift=True)


@dataclass(frozen=True)
class InternVLVideoGeometry:
    height: int  # every frame's size after the resize (size.height, size.width)
    width: int
    tokens_per_frame: int  # processor_config.json image_seq_length
    merge_size: int  # patches a side per token (1 / config.json downsample_ratio)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    do_sample_frames: bool
    num_frames: int | None
    fps: float | None
    initial_shift: bool | float  # True: half a sampling step
    temporal_patch_size: int = 1  # a frame is a group

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "InternVLVideoGeometry":
        """From video_preprocessor_config.json (else preprocessor_config.json, as transformers reads
        them), processor_config.json's image_seq_length and config.json's downsample_ratio."""
        model_dir = Path(model_dir)
        path = model_dir / "processor_config.json"
        processor = json.loads(path.read_text()) if path.exists() else {}
        model = json.loads((model_dir / "config.json").read_text())
        return cls.from_config(load_video_config(model_dir), int(processor.get("image_seq_length", 256)),
                               int(round(1 / float(model.get("downsample_ratio", 0.5)))))

    @classmethod
    def from_config(cls, cfg: dict, tokens_per_frame: int, merge_size: int = 2) -> "InternVLVideoGeometry":
        get = lambda key: DEFAULTS[key] if cfg.get(key) is None else cfg[key]  # noqa: E731
        size = get("size")
        if not size.get("height") or not size.get("width"):
            raise ValueError(f"size {size!r} is not a height and a width")
        side = int(round(tokens_per_frame ** 0.5))
        if side * side != tokens_per_frame:
            raise ValueError(f"image_seq_length {tokens_per_frame} is not a square number of tokens")
        shift = get("initial_shift")
        return cls(height=int(size["height"]), width=int(size["width"]), tokens_per_frame=tokens_per_frame,
                   merge_size=merge_size, image_mean=tuple(get("image_mean")), image_std=tuple(get("image_std")),
                   rescale_factor=float(get("rescale_factor")), do_sample_frames=bool(get("do_sample_frames")),
                   num_frames=None if cfg.get("num_frames") is None else int(cfg["num_frames"]),
                   fps=None if cfg.get("fps") is None else float(cfg["fps"]),
                   initial_shift=shift if isinstance(shift, bool) else float(shift))

    def check_request(self, meta: VideoMeta, request: VideoOptions, server: VideoOptions = VideoOptions()) -> None:
        """VideoKwargsError for a request's `num_frames` above the frames the video holds."""
        if request.num_frames is not None and request.num_frames > meta.num_frames:
            raise VideoKwargsError(f"num_frames={request.num_frames} exceeds what this video of "
                                   f"{meta.num_frames} frames allows: 1..{meta.num_frames}")

    def sample_frames(self, meta: VideoMeta, options: VideoOptions = VideoOptions()) -> list[int]:
        """InternVLVideoProcessor.sample_frames: the frame indices."""
        total = meta.num_frames
        num_frames = self.num_frames if options.num_frames is None else options.num_frames
        fps = self.fps if options.fps is None else options.fps
        if num_frames is None and fps is not None:
            if not meta.fps:
                raise VideoPlanError("sampling by fps needs the video's frame rate, which its header lacks")
            num_frames = int(total / meta.fps * fps)
        if num_frames is None:
            raise VideoPlanError("sampling frames needs num_frames or fps")
        if num_frames < 1:
            raise VideoPlanError(f"sampling leaves no frame of a video of {total}")
        if num_frames > total:
            raise VideoPlanError(f"cannot sample {num_frames} frames from a video of {total}")
        shift = total / num_frames / 2 if self.initial_shift is True else float(self.initial_shift)
        if shift >= total:
            raise VideoPlanError(f"initial_shift {shift} is past the video's {total} frames")
        return torch_arange_int(shift, total, total / num_frames)

    def plan(self, meta: VideoMeta, options: VideoOptions = VideoOptions(),
             loaded: list[int] | None = None) -> VideoPlan:
        """The frames, their size and tokens; VideoPlanError where transformers' processor would
        raise. `loaded`: frames a loader took before the processor, used as they are."""
        indices = frame_indices(meta, options, loaded, self.do_sample_frames,
                                lambda: self.sample_frames(meta, options))
        side = self.merge_size * int(round(self.tokens_per_frame ** 0.5))  # a frame's patches a side
        times = tuple(i / (meta.fps or 24) for i in indices)
        return VideoPlan(tuple(indices), self.height, self.width, (len(indices), side, side),
                         len(indices) * self.tokens_per_frame, self.tokens_per_frame, times)


def torch_arange_int(start: float, end: int, step: float) -> list[int]:
    """`torch.arange(start, end, step).int()` without torch: ceil((end - start) / step)
    values, each start + i * step in double, stored as float32 (torch's default dtype),
    then truncated."""
    count = math.ceil((end - start) / step)
    values = start + np.arange(count, dtype=np.float64) * step
    return np.trunc(values.astype(np.float32)).astype(int).tolist()
