"""One video's bytes + the API's plan -> the vision embeddings its spans take.

The encoder executes the plan the API made from the header (epd/inputs/
video_header.py): it decodes exactly `plan.frame_indices`
(encoders/video_io.py), resizes and patchifies them as transformers' video
processor (encoders/video_processor.py) and runs the same vision tower as for
images with grid (t, h, w), t temporal groups; it never re-plans.

The plan's rules are the checkpoint family's (`PromptFormat.video_geometry`,
the API's too); the tower's input from the normalised frames is the
patchified groups (Qwen, GLM-4.1V), or what the family's vision side makes of
them (`vision.video_input(frames, plan)`: InternVL's frames as tiles).

Output: `(mm_hash, MMEntry)` pairs in prompt order, keyed as
transport/media/video_keys.py says: one per temporal group for Qwen3-VL,
GLM-4.1V and InternVL (grid (1, h, w), deepstack included), one for the whole
video for Qwen2.5-VL (grid (t, h, w)). Groups are independent tower inputs, so a long video runs
through preprocessing and the tower a few groups at a time
(`max_batch_patches`), which bounds their memory, and gives the same rows
as one pass (encoders/video_processor.py's steps, applied per chunk of groups:
the resize is per frame, the last frame fills only the last group).

Usage (the encoder worker, the offline LLM):

    video = VideoEncoder(model_dir, image_encoder.vision, device)
    for key, entry in video.encode(data, plan, video_hash):
        cache.put(key, entry)
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from epd.families.registry import check_family
from epd.transport.media.prompt_format import VideoRules
from epd.transport.media.video_geometry import VideoPlan
from epd.encoders.video_io import decode_frames
from epd.transport.media.video_keys import entry_hashes
from epd.encoders.video_processor import frame_resizer, normalize_frames, patchify, resize_frames
from epd.transport.embedding_cache.mm_entry import MMEntry

# (frames decoded, decode s, preprocessing s, ViT forward s) of one video
VideoTimer = Callable[[int, float, float, float], None]
DEFAULT_MAX_BATCH_PATCHES = 16384


class VideoEncoder:
    def __init__(self, model_dir: str | Path, vision, device: str = "cpu",
                 max_batch_patches: int = DEFAULT_MAX_BATCH_PATCHES, geometry: VideoRules | None = None):
        """`vision`: the family's vision side, shared with the ImageEncoder
        (`ImageEncoder.vision`); `geometry`: the checkpoint's video rules, else read as its
        family reads them from video_preprocessor_config.json (else preprocessor_config.json,
        as transformers); FileNotFoundError when there is none or the family takes no video."""
        self.geometry = geometry or video_rules(model_dir)
        self.vision = vision
        self.device = device
        self.max_batch_patches = max_batch_patches

    def encode(self, data: bytes, plan: VideoPlan, mm_hash: str,
               on_video: VideoTimer | None = None) -> list[tuple[str, MMEntry]]:
        """The entries of the video `mm_hash` (its key, transport/media/video_keys.video_mm_hash).
        Raises encoders.video_io.VideoError when the bytes do not decode to the plan."""
        start = time.perf_counter()
        # uint8 [num_frames, h, w, 3]: each frame resized to the plan's size as it is decoded
        frames = decode_frames(data, plan.frame_indices, resize=frame_resizer(plan.resized_height, plan.resized_width))
        decoded = time.perf_counter()
        on_done = None
        if on_video is not None:
            def on_done(preprocess_s: float, forward_s: float) -> None:
                on_video(len(plan.frame_indices), decoded - start, preprocess_s, forward_s)
        return self.encode_frames(frames, plan, mm_hash, on_done)

    @torch.inference_mode()
    def encode_frames(self, frames, plan: VideoPlan, mm_hash: str,
                      on_done: Callable[[float, float], None] | None = None) -> list[tuple[str, MMEntry]]:
        """As `encode`, from the plan's frames already decoded (uint8 [T, H, W, 3]).
        Preprocessing and the tower both go a few temporal groups at a time, so
        neither holds a long video's float pixels at once."""
        video = torch.as_tensor(frames)
        if video.ndim != 4 or video.shape[0] != len(plan.frame_indices) or video.shape[-1] != 3:
            raise ValueError(f"expected {len(plan.frame_indices)} RGB frames, got shape {tuple(video.shape)}")
        video = video.permute(0, 3, 1, 2)  # [T, 3, H, W]
        t, h, w = plan.grid_thw
        tps = self.geometry.temporal_patch_size
        groups_per_pass = max(1, self.max_batch_patches // (h * w))
        entries: list[MMEntry] = []
        preprocess_s = forward_s = 0.0
        for first in range(0, t, groups_per_pass):
            n = min(groups_per_pass, t - first)
            start = time.perf_counter()
            part = resize_frames(video[first * tps:(first + n) * tps].contiguous(),
                                 plan.resized_height, plan.resized_width)
            pixels, metas = self._tower_input(normalize_frames(part, self.geometry), n, plan)
            preprocessed = time.perf_counter()
            entries += self.vision.forward(pixels, metas)
            if on_done is not None and str(self.device).startswith("cuda"):
                torch.cuda.synchronize(self.device)  # the forward's time, not its launch's
            preprocess_s += preprocessed - start
            forward_s += time.perf_counter() - preprocessed
        if on_done is not None:
            on_done(preprocess_s, forward_s)
        keys = entry_hashes(mm_hash, plan)
        assert len(entries) == t, (len(entries), plan.grid_thw)
        if len(keys) == t:  # one entry per group
            return list(zip(keys, entries))
        extras = {name: torch.cat([e.extras[name] for e in entries]) for name in entries[0].extras}
        return [(keys[0], MMEntry(torch.cat([e.embeddings for e in entries]), extras, {"grid_thw": (t, h, w)}))]

    def _tower_input(self, frames: torch.Tensor, n: int, plan: VideoPlan) -> tuple[torch.Tensor, list[dict]]:
        """n temporal groups' normalised frames [n * tps, C, H, W] -> the tower's input and one meta per group."""
        video_input = getattr(self.vision, "video_input", None)
        if video_input is not None:  # the family's own layout (InternVL: each frame a tile)
            return video_input(frames, plan)
        t, h, w = plan.grid_thw
        pixels, grid = patchify(frames, self.geometry)  # [n*h*w, C*tps*p*p]
        assert grid == (n, h, w), (grid, plan.grid_thw)
        # one (1, h, w) grid per group: the same rows as (n, h, w), cut at the groups
        return pixels, [{"grid_thw": (1, h, w)} for _ in range(n)]


def video_rules(model_dir: str | Path) -> VideoRules:
    """The checkpoint's video rules as its family reads them; FileNotFoundError when the
    family takes no video or the checkpoint has no video processor config."""
    family = check_family(model_dir)
    if family.prompt_format.video_geometry is None:
        raise FileNotFoundError(f"{family.name} takes no video input")
    return family.prompt_format.video_geometry(model_dir)
