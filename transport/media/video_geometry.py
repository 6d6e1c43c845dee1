"""Which frames of a video are sampled, what size they are resized to and how
many placeholder tokens they take, from the container's header alone: the rules
of transformers' Qwen3-VL and Qwen2-VL video processors (Qwen2.5-VL uses the
latter), read from the checkpoint's video_preprocessor_config.json: the Qwen
families' `VideoRules` (transport/media/prompt_format.py; another family's are
in its package, e.g. epd/families/glm4v/video_geometry.py). The plan and the
errors here are every family's.

Torch-free: the API process plans a video here from its header (epd/inputs/
video_header.py) and never decodes a pixel; the encoder decodes exactly the
planned frames (encoders/video_io.py) and resizes them to the planned size
(encoders/video_processor.py).

Where transformers 5.x has quirks, they are kept, so counts stay exact:
Qwen3-VL's frame sampling uses the checkpoint's min/max_frames, never a
request's; Qwen2-VL's `do_sample_frames` is off unless the config turns it on
(every frame is then used), and without a video config it reads the image
processor's preprocessor_config.json, as transformers does.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epd.transport.media.image_geometry import smart_resize

VIDEO_CONFIG = "video_preprocessor_config.json"
IMAGE_CONFIG = "preprocessor_config.json"  # transformers' fallback when a checkpoint has no video config
MAX_ASPECT_RATIO = 200
# per-request keys (vLLM's mm_processor_kwargs for Qwen video) that change the plan
REQUEST_KEYS = ("fps", "num_frames", "do_sample_frames", "min_pixels", "max_pixels", "min_frames", "max_frames")


def load_video_config(model_dir: str | Path) -> dict:
    """The checkpoint's video processor settings as transformers reads them:
    video_preprocessor_config.json, else preprocessor_config.json
    (FileNotFoundError when neither is there). Part of every video's mm_hash."""
    directory = Path(model_dir)
    path = directory / VIDEO_CONFIG
    if not path.exists():
        path = directory / IMAGE_CONFIG
    return json.loads(path.read_text())


class VideoPlanError(ValueError):
    """The video cannot be processed with these settings (the message is fit for a client)."""


class VideoKwargsError(VideoPlanError):
    """A request's own mm_processor_kwargs would cost more than the server allows."""


@dataclass(frozen=True)
class VideoMeta:
    """What the container's header says of its first video stream."""

    num_frames: int
    fps: float  # the stream's average rate
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps if self.fps else 0.0


@dataclass(frozen=True)
class VideoOptions:
    """Per-request overrides; None keeps the checkpoint's value. `fps` and
    `num_frames` exclude each other; asking for `num_frames` alone turns the
    default fps off (transformers needs `fps=None` passed beside it)."""

    fps: float | None = None
    num_frames: int | None = None
    do_sample_frames: bool | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict | None) -> "VideoOptions":
        """From mm_processor_kwargs; ValueError names a key we cannot apply or a bad value."""
        kwargs = dict(kwargs or {})
        unknown = sorted(set(kwargs) - set(REQUEST_KEYS))
        if unknown:
            raise ValueError(f"video processor kwargs {', '.join(unknown)} cannot be applied; "
                             f"the video processor takes {', '.join(REQUEST_KEYS)}")
        for key, value in kwargs.items():
            if key == "do_sample_frames":
                if not isinstance(value, bool):
                    raise ValueError(f"do_sample_frames must be true or false, got {value!r}")
            elif key == "fps":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"fps must be a positive number, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if "fps" in kwargs and "num_frames" in kwargs:
            raise ValueError("fps and num_frames exclude each other; give one")
        return cls(**kwargs)


@dataclass(frozen=True)
class VideoPlan:
    """The processor's decisions for one video."""

    frame_indices: tuple[int, ...]  # into the decoded stream, in order
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]  # in patches; t counts temporal groups
    num_tokens: int  # placeholder tokens in all (t * h * w / merge**2)
    tokens_per_group: int  # placeholder tokens of one temporal group
    # each temporal group's time (s), where the family's prompt parts its groups with text (one span and
    # entry per group: transport/media/video_keys.py): Qwen3-VL's written before each group, GLM-4.1V's
    # after it, InternVL's frames' times (its prompt labels the frames instead); () : one run of pads
    group_timestamps_s: tuple[float, ...] = field(default=())
    # Qwen2.5-VL: seconds one temporal group spans (its temporal M-RoPE step)
    second_per_grid_t: float = 0.0
    # a chunk of a longer video's plan (transport/media/video_chunks.py): its first temporal group in the
    # video and the video's groups; 0 and 0: the plan is the whole video
    first_group: int = 0
    total_groups: int = 0

    @property
    def is_chunk(self) -> bool:
        return self.total_groups > 0

    @property
    def num_patches(self) -> int:
        """The tower's work: patches over every temporal group."""
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class VideoGeometry:
    """The checkpoint's video processor settings (one of two families)."""

    family: str  # "qwen3_vl" or "qwen2_vl"
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size.shortest_edge
    max_pixels: int  # size.longest_edge
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float
    fps: float | None
    num_frames: int | None
    do_sample_frames: bool
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "VideoGeometry":
        """FileNotFoundError when the checkpoint has neither config."""
        return cls.from_config(load_video_config(model_dir))

    @classmethod
    def from_config(cls, cfg: dict) -> "VideoGeometry":
        qwen3 = cfg.get("video_processor_type") == "Qwen3VLVideoProcessor" or (
            "video_processor_type" not in cfg and cfg.get("processor_class") == "Qwen3VLProcessor")
        d = _QWEN3_DEFAULTS if qwen3 else _QWEN2_DEFAULTS
        size = cfg.get("size") or {}
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or d["min_pixels"]
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or d["max_pixels"]
        get = lambda key: cfg.get(key, d[key])  # noqa: E731
        return cls(
            family="qwen3_vl" if qwen3 else "qwen2_vl",
            patch_size=int(get("patch_size")), merge_size=int(get("merge_size")),
            temporal_patch_size=int(get("temporal_patch_size")),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            image_mean=tuple(get("image_mean")), image_std=tuple(get("image_std")),
            rescale_factor=float(get("rescale_factor")), fps=get("fps"), num_frames=get("num_frames"),
            do_sample_frames=bool(get("do_sample_frames")), min_frames=int(get("min_frames")),
            max_frames=int(get("max_frames")), cap_pixels_per_frame=bool(get("cap_pixels_per_frame")),
            max_video_tokens=int(get("max_video_tokens")),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def check_request(self, meta: VideoMeta, request: VideoOptions, server: VideoOptions = VideoOptions()) -> None:
        """VideoKwargsError (a 400) naming the first of a request's own keys whose value
        would cost more than the server's settings allow: `min_pixels` / `max_pixels`
        above the server's pixel budget (--mm-processor-kwargs' max_pixels, else the
        checkpoint's), `num_frames` above the frames the video holds (the checkpoint's
        min_frames at least: a short clip's frames repeat, as transformers') or the
        checkpoint's max_frames. `fps`, `min_frames` and `max_frames` need no bound:
        the sampled count never passes the container's frames."""
        budget = self.max_pixels if server.max_pixels is None else server.max_pixels
        for key in ("min_pixels", "max_pixels"):
            value = getattr(request, key)
            if value is not None and value > budget:
                raise VideoKwargsError(f"{key}={value} exceeds this server's video pixel budget: "
                                     f"allowed 1..{budget}")
        if request.num_frames is not None:
            most = min(max(meta.num_frames, self.min_frames), self.max_frames)
            if request.num_frames > most:
                raise VideoKwargsError(f"num_frames={request.num_frames} exceeds what this video "
                                     f"of {meta.num_frames} frames allows: 1..{most}")

    def plan(self, meta: VideoMeta, options: VideoOptions = VideoOptions(),
             loaded: list[int] | None = None) -> VideoPlan:
        """The sampled frames, their resized size and their tokens; VideoPlanError
        where transformers' processor would raise. `loaded`: the frames a loader
        took before the processor (vLLM's --media-io-kwargs video.num_frames),
        which the processor then uses as they are, sampling none."""
        indices = frame_indices(meta, options, loaded, self.do_sample_frames,
                                lambda: self.sample_frames(meta, options))
        height, width = self.resized_size(len(indices), meta.height, meta.width, options)
        t = -(-len(indices) // self.temporal_patch_size)  # the last frame repeats to fill a group
        grid = (t, height // self.patch_size, width // self.patch_size)
        per_group = grid[1] * grid[2] // self.merge_size ** 2
        timestamps: tuple[float, ...] = ()
        second_per_grid_t = 0.0
        if self.family == "qwen3_vl":
            timestamps = _group_timestamps(indices, meta.fps or 24, self.temporal_patch_size)
        else:  # Qwen2_5_VLProcessor: temporal_patch_size / the sampled fps (metadata.sampled_fps)
            sampled_fps = len(indices) / meta.num_frames * meta.fps if meta.fps else 24
            second_per_grid_t = self.temporal_patch_size / sampled_fps
        return VideoPlan(tuple(indices), height, width, grid, t * per_group, per_group,
                         timestamps, second_per_grid_t)

    def sample_frames(self, meta: VideoMeta, options: VideoOptions) -> list[int]:
        fps = self.fps if options.fps is None else options.fps
        num_frames = self.num_frames if options.num_frames is None else options.num_frames
        if options.num_frames is not None and options.fps is None:
            fps = None  # num_frames alone: the count, not the default rate
        if fps is not None and num_frames is not None:
            raise VideoPlanError("fps and num_frames exclude each other; give one")
        if self.family == "qwen3_vl":
            return self._sample_qwen3(meta, fps, num_frames)
        return self._sample_qwen2(meta, fps, num_frames, options)

    def _sample_qwen3(self, meta: VideoMeta, fps: float | None, num_frames: int | None) -> list[int]:
        total = meta.num_frames
        if num_frames is None and fps is not None:
            # capped before int(): the same count once clamped to `total` below, and never int(inf)
            num_frames = int(min(total / (meta.fps or 24) * fps, total + 1))
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        if num_frames > max(total, self.min_frames, self.max_frames):  # linspace never gets an uncapped count
            raise VideoPlanError(f"cannot sample {num_frames} frames from a video of {total}")
        return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()

    def _sample_qwen2(self, meta: VideoMeta, fps: float | None, num_frames: int | None,
                      options: VideoOptions) -> list[int]:
        total, tps = meta.num_frames, self.temporal_patch_size
        min_frames = self.min_frames if options.min_frames is None else options.min_frames
        max_frames = self.max_frames if options.max_frames is None else options.max_frames
        if num_frames is not None:
            num_frames = round(num_frames / tps) * tps
        elif fps is not None:
            if not meta.fps:
                raise VideoPlanError("sampling by fps needs the video's frame rate, which its header lacks")
            max_frames = math.floor(min(max_frames, total) / tps) * tps
            wanted = min(max(total / meta.fps * fps, min_frames), max_frames, total)
            num_frames = math.floor(wanted / tps) * tps
        if num_frames is None:
            return list(range(total))
        if num_frames > total:
            raise VideoPlanError(f"cannot sample {num_frames} frames from a video of {total}")
        if num_frames < 1:
            raise VideoPlanError(f"sampling leaves no frame of a video of {total}")
        return _torch_arange_int(total, total / num_frames)

    def resized_size(self, num_frames: int, height: int, width: int,
                     options: VideoOptions = VideoOptions()) -> tuple[int, int]:
        """(height, width) of every frame after the processor's resize."""
        min_pixels = self.min_pixels if options.min_pixels is None else options.min_pixels
        max_pixels = self.max_pixels if options.max_pixels is None else options.max_pixels
        f, tps = self.factor, self.temporal_patch_size
        if self.family == "qwen3_vl":
            if self.cap_pixels_per_frame:
                per_frame = max(min(self.max_video_tokens * f * f, max_pixels // num_frames), int(min_pixels * 1.05))
                max_pixels = per_frame * num_frames
            return _smart_resize_qwen3(num_frames, height, width, tps, f, min_pixels, max_pixels)
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * f * f * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * tps // num_frames), int(min_pixels * 1.05))
        return _smart_resize_qwen2(height, width, f, min_pixels, max_pixels)


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoPlanError(f"video aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")


def _smart_resize_qwen3(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    if num_frames < temporal_factor:
        raise VideoPlanError(f"{num_frames} sampled frame(s); the model needs at least {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    return fit_frames(num_frames, height, width, temporal_factor, factor, min_pixels, max_pixels)


def fit_frames(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
               min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) as multiples of `factor` with num_frames x height x width within
    [min_pixels, max_pixels], the aspect kept as near as may be: the rule Qwen3-VL's video
    processor and GLM-4.1V's `smart_resize` share past their own checks."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_indices(meta: VideoMeta, options: VideoOptions, loaded: list[int] | None, do_sample_frames: bool,
                  sample: Callable[[], list[int]]) -> list[int]:
    """The frames a plan takes, every family's rule: VideoPlanError for a video with no frames or
    an empty dimension; `loaded` (frames a loader took before the processor) as they are; else
    `sample()` where sampling is on (the request's do_sample_frames, else the processor's
    `do_sample_frames`); else every frame."""
    if meta.num_frames < 1:
        raise VideoPlanError("the video has no frames")
    if meta.width < 1 or meta.height < 1:
        raise VideoPlanError(f"the video has an empty dimension ({meta.width}x{meta.height})")
    if loaded is not None:
        return list(loaded)
    do_sample = do_sample_frames if options.do_sample_frames is None else options.do_sample_frames
    return sample() if do_sample else list(range(meta.num_frames))


def _smart_resize_qwen2(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    _check_aspect(height, width)
    return smart_resize(height, width, factor, min_pixels, max_pixels)


def _torch_arange_int(end: int, step: float) -> list[int]:
    """`torch.arange(0, end, step).int()` without torch: the length is
    ceil(end / step), each value start + i * step computed in double, stored
    as float32 (torch's default dtype), then truncated."""
    count = math.ceil(end / step)
    return np.trunc((np.arange(count, dtype=np.float64) * step).astype(np.float32)).astype(int).tolist()


def _group_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Qwen3VLProcessor._calculate_timestamps: the mean time of each group's first and last frame."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / video_fps for i in padded]
    return tuple((times[i] + times[i + temporal_patch_size - 1]) / 2
                 for i in range(0, len(times), temporal_patch_size))


_COMMON = dict(merge_size=2, temporal_patch_size=2, rescale_factor=1 / 255, num_frames=None,
               min_frames=4, max_frames=768, cap_pixels_per_frame=False)
# Class defaults of transformers' Qwen3VLVideoProcessor and Qwen2VLVideoProcessor
_QWEN3_DEFAULTS = dict(_COMMON, patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                       image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), fps=2, do_sample_frames=True,
                       max_video_tokens=768)
_QWEN2_DEFAULTS = dict(_COMMON, patch_size=14, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768,
                       image_mean=(0.48145466, 0.4578275, 0.40821073),
                       image_std=(0.26862954, 0.26130258, 0.27577711), fps=None, do_sample_frames=False,
                       max_video_tokens=128000)
