"""The Qwen-VL families' prompt format (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL):
`QWEN_VL_FORMAT`, a `PromptFormat` (transport/media/prompt_format.py).

The chat template writes one `<|image_pad|>` per image (inside
`<|vision_start|>...<|vision_end|>`); it becomes one pad per placeholder
token, counted by Qwen2-VL's `smart_resize` (`ImageGeometry`,
transport/media/image_geometry.py), as transformers' processor does after
decoding. A video's `<|video_pad|>` (the release templates: inside the same
wrapper) is expanded from its `VideoPlan` as transformers' processors write
it: a plan with timestamps (Qwen3-VL) replaces the template's whole wrapper
with `<{t:.1f} seconds>` + `<|vision_start|>` + the group's pads +
`<|vision_end|>` per temporal group (Qwen3VLProcessor and vLLM drop the outer
pair); one without (Qwen2.5-VL) keeps the wrapper around one run of pads.
The plan is `VideoGeometry`'s (transport/media/video_geometry.py).
"""
from __future__ import annotations

from epd.transport.media.image_geometry import PROCESSOR_KWARGS, ImageGeometry, check_processor_kwargs
from epd.transport.media.prompt_format import PromptFormat
from epd.transport.media.video_geometry import VideoGeometry, VideoPlan

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
WRAPPED_VIDEO_PAD = VISION_START + VIDEO_PAD + VISION_END  # what the release templates write for a video


def expand_image(num_tokens: int) -> str:
    """The template's one pad -> one pad per placeholder token (the wrapper is the template's)."""
    return IMAGE_PAD * num_tokens


def expand_video(plan: VideoPlan, placeholder: str) -> str:
    """The text that replaces a video's `placeholder` (the bare pad, or the template's wrapper
    around it): Qwen3-VL's groups each in their own wrapper, in place of the template's
    (Qwen3VLProcessor.get_text_with_replacements); Qwen2.5-VL's pads inside the template's."""
    if plan.group_timestamps_s:  # Qwen3VLProcessor.replace_video_token
        return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * plan.tokens_per_group}{VISION_END}"
                       for t in plan.group_timestamps_s)
    pads = VIDEO_PAD * plan.num_tokens
    return f"{VISION_START}{pads}{VISION_END}" if placeholder == WRAPPED_VIDEO_PAD else pads


QWEN_VL_FORMAT = PromptFormat(
    image_placeholder=IMAGE_PAD,
    video_placeholders=(WRAPPED_VIDEO_PAD, VIDEO_PAD),
    image_token=IMAGE_PAD,
    video_token=VIDEO_PAD,
    expand_image=expand_image,
    expand_video=expand_video,
    image_geometry=ImageGeometry.from_pretrained,
    image_kwargs=PROCESSOR_KWARGS,
    check_image_kwargs=check_processor_kwargs,
    video_geometry=VideoGeometry.from_pretrained,  # Qwen3-VL's or Qwen2-VL's video processor, as its config says
)
