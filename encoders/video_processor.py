"""Decoded video frames -> the vision tower's input (`pixel_values_videos`,
`video_grid_thw`), with the operations of transformers' Qwen3-VL / Qwen2-VL
video processors, so the output is bitwise theirs on the same frames.

transformers' video processors run on torchvision's tensor transforms, which
cannot be installed into this venv (they turn `AutoImageProcessor` onto its
torchvision path and change image pixels), so the three steps are written here
in torch, as torchvision 0.28 does them:
  resize: bicubic with antialias; on CPU torch's native uint8 kernel, elsewhere
          float32 then clamp, round, back to uint8;
  rescale + normalize fused: (x - mean * 255) / (std * 255) in float32;
  patchify: the last frame repeated to fill a temporal group, then the
          processor's patch order [t, h/m, w/m, m, m, C, tps, p, p].
tests/unit/encoders/test_video_processor.py checks `torch.equal` against them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from epd.transport.media.video_geometry import VideoGeometry, VideoPlan


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [T, C, H, W] -> uint8 [T, C, height, width] (torchvision's resize_image, bicubic)."""
    if frames.shape[-2:] == (height, width):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def frame_resizer(height: int, width: int):
    """One decoded frame, uint8 numpy [H, W, 3] -> [height, width, 3], as `resize_frames`
    does it to a batch (the kernel works frame by frame: the same bytes); for
    encoders/video_io.decode_frames, which then holds frames at the planned size."""
    def resize(frame):
        chw = torch.from_numpy(frame).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W]
        return resize_frames(chw, height, width)[0].permute(1, 2, 0).numpy()
    return resize


def normalize_frames(frames: torch.Tensor, geometry: VideoGeometry) -> torch.Tensor:
    """uint8 [T, C, H, W] -> float32, rescale and normalize fused as transformers does."""
    mean = torch.tensor(geometry.image_mean, device=frames.device) * (1.0 / geometry.rescale_factor)
    std = torch.tensor(geometry.image_std, device=frames.device) * (1.0 / geometry.rescale_factor)
    return frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def patchify(frames: torch.Tensor, geometry: VideoGeometry) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """float32 [T, C, H, W] -> ([t*h*w, C*tps*p*p], (t, h, w))."""
    p, m, tps = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    if pad := -frames.shape[0] % tps:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
    num_frames, channels, height, width = frames.shape
    t, h, w = num_frames // tps, height // p, width // p
    patches = frames.view(t, tps, channels, h // m, m, p, w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * tps * p * p), (t, h, w)


class VideoPreprocessor:
    """The planned frames of one video -> (pixel_values_videos, grid_thw)."""

    def __init__(self, geometry: VideoGeometry):
        self.geometry = geometry

    def __call__(self, frames, plan: VideoPlan) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """`frames`: uint8 [T, H, W, 3] (numpy or torch), the plan's frames in its order."""
        video = torch.as_tensor(frames)
        if video.ndim != 4 or video.shape[0] != len(plan.frame_indices) or video.shape[-1] != 3:
            raise ValueError(f"expected {len(plan.frame_indices)} RGB frames, got shape {tuple(video.shape)}")
        video = video.permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W]
        video = resize_frames(video, plan.resized_height, plan.resized_width)
        pixels, grid = patchify(normalize_frames(video, self.geometry), self.geometry)
        assert grid == plan.grid_thw, (grid, plan.grid_thw)
        return pixels, grid
