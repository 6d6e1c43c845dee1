"""Values of `epd serve` flags written as vLLM writes them: JSON objects and lists, and
`--limit-mm-per-prompt` in vLLM's JSON form or EPD's image=N. Each refusal is a
ValueError naming the flag (the CLI prints it and exits 2)."""
from __future__ import annotations

import json

from epd.config import field_default
from epd.inputs.media import MediaConfig
from epd.transport.wire.flag_json import json_object as read_json_object

MODALITIES = ("image", "video", "audio")  # --limit-mm-per-prompt keys
VIDEO_IO_KEYS = ("num_frames",)  # --media-io-kwargs' video keys EPD applies (vLLM's loader)


def limit_mm_per_prompt(value: str | None) -> dict[str, int]:
    """--limit-mm-per-prompt as vLLM writes it, '{"image": 4, "video": 0}', or EPD's
    image=N[,video=M][,audio=K] -> {"image": ..., "video": ..., "audio": ...} (a modality left out: its default)."""
    limits = {"image": field_default(MediaConfig, "limit_images_per_prompt"),
              "video": field_default(MediaConfig, "limit_videos_per_prompt"),
              "audio": field_default(MediaConfig, "limit_audios_per_prompt")}
    if value is None:
        return limits
    if value.lstrip().startswith("{"):
        given = json_object("--limit-mm-per-prompt", value)
    else:
        given = {}
        for item in value.split(","):
            key, _, num = item.strip().partition("=")
            if not num.isdigit():
                raise ValueError(f"--limit-mm-per-prompt takes '{{\"image\": N, \"video\": M}}' or image=N, "
                                 f"got {value!r}")
            given[key] = int(num)
    unknown = sorted(set(given) - set(MODALITIES))
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: EPD serves {', '.join(MODALITIES)}, not {', '.join(unknown)}")
    for key, num in given.items():
        if isinstance(num, bool) or not isinstance(num, int) or num < 0:
            raise ValueError(f"--limit-mm-per-prompt: {key} must be a count (>= 0), got {num!r}")
    return {**limits, **given}


def media_io_kwargs(value: str | None) -> dict[str, int]:
    """--media-io-kwargs as vLLM writes it, '{"video": {"num_frames": 32}}' -> {"video_num_frames": 32}
    (MediaConfig's fields); -1 (the default) takes every frame and lets the processor sample."""
    given = json_object("--media-io-kwargs", value)
    unknown = sorted(set(given) - {"video"})
    if unknown:
        raise ValueError(f"--media-io-kwargs: EPD applies only video loading arguments, not {', '.join(unknown)}")
    video = given.get("video", {})
    if not isinstance(video, dict):
        raise ValueError(f"--media-io-kwargs: video takes a JSON object, got {video!r}")
    unknown = sorted(set(video) - set(VIDEO_IO_KEYS))
    if unknown:
        raise ValueError(f"--media-io-kwargs: video.{', video.'.join(unknown)} cannot be applied; EPD's video "
                         f"loader takes {', '.join(VIDEO_IO_KEYS)}")
    num_frames = video.get("num_frames", -1)
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or not (num_frames == -1 or num_frames > 0):
        raise ValueError(f"--media-io-kwargs: video.num_frames must be -1 (all) or positive, got {num_frames!r}")
    return {"video_num_frames": num_frames}


def json_object(flag: str, value: str | None) -> dict:
    """A flag's JSON object ({} when the flag is absent); ValueError naming the flag."""
    return {} if value is None else dict(read_json_object(flag, value))


def string_list(flag: str, value: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's JSON list ('["http://a.com"]'), or items separated by commas."""
    if value is None:
        return default
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not a valid JSON list: {exc}") from None
        if not all(isinstance(item, str) for item in items):
            raise ValueError(f"{flag} must be a list of strings, got {value!r}")
        return tuple(items)
    return tuple(item.strip() for item in value.split(",") if item.strip())
