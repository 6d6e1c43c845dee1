"""transformers' own video processor (Qwen3-VL / Qwen2-VL) as the reference for
the video tests, run in a child process.

Those processors need torchvision's transforms; installed into the venv,
torchvision would move `AutoImageProcessor` onto its torchvision path and
change image pixels for every other test, so scripts/env.sh installs it with
--no-deps into .venv/reference-torchvision and only this child puts it on
sys.path (with `torchvision._meta_registrations` stubbed: its fake-tensor
registrations need a matching torch build and nothing here uses them).

The child gets every decoded frame with the header's metadata and samples,
resizes and patchifies by itself, as transformers does for a user's video.
`hf_processor_inputs` runs the whole processor on the whole chat text, so the
prompt's token ids are transformers' own (Qwen3-VL's processor replaces the
template's `<|vision_start|><|video_pad|><|vision_end|>` wrapper whole).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

TORCHVISION_DIR = Path(__file__).resolve().parents[2] / ".venv" / "reference-torchvision"


def reference_available() -> bool:
    return (TORCHVISION_DIR / "torchvision").is_dir()


def hf_video_outputs(model_dir: str, videos: list[tuple[np.ndarray, object, list[dict]]],
                     work: Path) -> list[list[dict]]:
    """transformers' AutoVideoProcessor, in one child process, on each video's
    frames (all of them, uint8 [N, H, W, 3]) with its header `meta` (VideoMeta),
    once per kwargs of its calls. Each result has pixel_values_videos,
    video_grid_thw, frames_indices, the Qwen3-VL group timestamps and the
    sampled fps (InternVL's: no grid, no timestamps), or `error` (the message
    transformers raised)."""
    work.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, (frames, meta, calls) in enumerate(videos):
        np.save(work / f"frames{i}.npy", frames)
        jobs.append({"frames": str(work / f"frames{i}.npy"), "calls": calls,
                     "meta": {"total_num_frames": meta.num_frames, "fps": meta.fps, "width": meta.width,
                              "height": meta.height, "duration": meta.duration_s}})
    (work / "job.json").write_text(json.dumps({"model_dir": model_dir, "out": str(work / "out.pt"), "videos": jobs}))
    proc = subprocess.run([sys.executable, __file__, str(work / "job.json")], capture_output=True, text=True,
                          timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"reference process failed:\n{proc.stderr[-4000:]}")
    return torch.load(work / "out.pt")


@dataclass(frozen=True)
class VideoClips:
    """Videos for transformers' whole processor: each one's frames (all of them,
    uint8 [N, H, W, 3]) with its header `meta` (VideoMeta), the call's kwargs
    (mm_processor_kwargs as transformers takes them) and a folder to work in."""

    videos: list[tuple[np.ndarray, object]]
    kwargs: dict
    work: Path


def hf_processor_inputs(model_dir: str, text: str, clips: VideoClips, images: list[bytes] = ()) -> dict:
    """transformers' whole processor (AutoProcessor: Qwen3VLProcessor or
    Qwen2_5_VLProcessor), in one child process, on the WHOLE chat text with the
    videos (and the images, for their placeholders), as a user runs it:
    `input_ids` [1, L], `pixel_values_videos`, `video_grid_thw`,
    `second_per_grid_ts` (Qwen2.5-VL; else None), `image_grid_thw` (or None),
    `pixel_values` (InternVL: its images' tiles and its videos' frames in prompt order; else
    the images' or None) and `mm_token_type_ids` (GLM-4.1V's: 1 image, 2 video; or None)."""
    return hf_processor_inputs_many(model_dir, [(text, clips, images)])[0]


def hf_processor_inputs_many(model_dir: str, calls: list[tuple[str, VideoClips, list[bytes]]]) -> list[dict]:
    """`hf_processor_inputs` of several (text, clips, images) calls, in one child process."""
    jobs = []
    for text, clips, images in calls:
        work = clips.work
        work.mkdir(parents=True, exist_ok=True)
        videos = []
        for i, (frames, meta) in enumerate(clips.videos):
            np.save(work / f"frames{i}.npy", frames)
            videos.append({"frames": str(work / f"frames{i}.npy"), "meta": _meta(meta)})
        image_paths = []
        for i, data in enumerate(images):
            (work / f"image{i}").write_bytes(data)
            image_paths.append(str(work / f"image{i}"))
        jobs.append({"out": str(work / "out.pt"), "text": text, "videos": videos, "kwargs": clips.kwargs,
                     "images": image_paths})
    job_path = calls[0][1].work / "job.json"
    job_path.write_text(json.dumps({"model_dir": model_dir, "calls": jobs, "processor": True}))
    proc = subprocess.run([sys.executable, __file__, str(job_path)], capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"reference process failed:\n{proc.stderr[-4000:]}")
    return [torch.load(job["out"]) for job in jobs]


def _meta(meta) -> dict:
    return {"total_num_frames": meta.num_frames, "fps": meta.fps, "width": meta.width,
            "height": meta.height, "duration": meta.duration_s}


def _processor_main(job: dict) -> None:
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    processor = AutoProcessor.from_pretrained(job["model_dir"])
    for call in job["calls"]:
        images = [Image.open(path).convert("RGB") for path in call["images"]] or None
        videos = [np.load(video["frames"]) for video in call["videos"]] or None
        metadata = [VideoMetadata(**video["meta"]) for video in call["videos"]] or None
        out = processor(text=[call["text"]], images=images, videos=videos, video_metadata=metadata,
                        return_tensors="pt", **call["kwargs"])
        spgt = out.get("second_per_grid_ts")
        grids = out.get("image_grid_thw")
        types = out.get("mm_token_type_ids")
        torch.save({"input_ids": out["input_ids"], "pixel_values_videos": out.get("pixel_values_videos"),
                    "video_grid_thw": out.get("video_grid_thw"), "pixel_values": out.get("pixel_values"),
                    "mm_token_type_ids": None if types is None else torch.as_tensor(types),
                    "second_per_grid_ts": None if spgt is None else torch.as_tensor(spgt),
                    "image_grid_thw": None if grids is None else torch.as_tensor(grids)}, call["out"])


def _main(job_path: str) -> None:
    sys.path.insert(0, str(TORCHVISION_DIR))
    import types
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    from transformers import AutoVideoProcessor
    from transformers.video_utils import VideoMetadata

    job = json.loads(Path(job_path).read_text())
    if job.get("processor"):
        return _processor_main(job)
    processor = AutoVideoProcessor.from_pretrained(job["model_dir"])
    results = []
    for video in job["videos"]:
        frames = np.load(video["frames"])
        results.append([])
        for kwargs in video["calls"]:
            try:
                out = processor(videos=[frames], video_metadata=[VideoMetadata(**video["meta"])],
                                return_metadata=True, return_tensors="pt", **kwargs)
            except Exception as exc:  # the refusal is the reference answer
                results[-1].append({"error": f"{exc.__class__.__name__}: {exc}"})
                continue
            results[-1].append(_result(processor, frames, out))
    torch.save(results, job["out"])


def _result(processor, frames, out) -> dict:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    metadata = out["video_metadata"][0]
    indices = (list(range(len(frames))) if metadata.frames_indices is None
               else [int(i) for i in metadata.frames_indices])
    tps = getattr(processor, "temporal_patch_size", None)  # None: frames, no groups (InternVL)
    timestamps = [] if tps is None else Qwen3VLProcessor._calculate_timestamps(None, list(indices), metadata.fps,
                                                                               tps)
    grid = out.get("video_grid_thw")
    return {"pixel_values_videos": out["pixel_values_videos"],
            "video_grid_thw": None if grid is None else [int(v) for v in grid[0]],
            "frames_indices": indices, "timestamps": [float(t) for t in timestamps],
            "sampled_fps": float(metadata.sampled_fps), "merge_size": getattr(processor, "merge_size", None),
            "processor_class": type(processor).__name__}


if __name__ == "__main__":
    _main(sys.argv[1])
