"""Qwen2.5-Omni's prompt format (torch-free): `QWEN_OMNI_FORMAT`, a `PromptFormat`
(transport/media/prompt_format.py), and an audio clip's token count.

The chat template writes `<|vision_bos|><|IMAGE|><|vision_eos|>` for an image
and `<|audio_bos|><|AUDIO|><|audio_eos|>` for a clip; each pad becomes one per
placeholder token (Qwen2_5OmniProcessor.replace_image_token /
replace_audio_token). An image's count is Qwen2-VL's `smart_resize` geometry,
as Qwen2.5-VL's. A clip's count comes from its number of samples alone (what
a wav header's duration gives): the processor pads every clip to 30 s and
keeps ceil(samples / hop) log-mel frames, at most 3000 (a longer clip is cut
at 30 s, as transformers cuts it); the tower's first convolution halves the
frames and its pooling halves them again. Videos are not taken yet (refused
by name: no video rules).
"""
from __future__ import annotations

from epd.transport.media.image_geometry import PROCESSOR_KWARGS, ImageGeometry, check_processor_kwargs
from epd.transport.media.prompt_format import PromptFormat

IMAGE_PAD = "<|IMAGE|>"
VIDEO_PAD = "<|VIDEO|>"
AUDIO_PAD = "<|AUDIO|>"
VISION_BOS = "<|vision_bos|>"
VISION_EOS = "<|vision_eos|>"
AUDIO_BOS = "<|audio_bos|>"
AUDIO_EOS = "<|audio_eos|>"

SAMPLING_RATE = 16_000  # the feature extractor's; other rates are resampled to it
HOP_LENGTH = 160  # samples per log-mel frame
MAX_FRAMES = 3000  # 30 s: the processor's padding, and its cut
AUDIO_FRAMES = "audio_frames"  # an audio span's meta: the clip's log-mel frames (positions.py)


def num_audio_frames(num_samples: int) -> int:
    """The log-mel frames the processor keeps of a clip of `num_samples` samples at 16 kHz."""
    if num_samples <= 0:
        raise ValueError(f"an audio clip needs samples, got {num_samples}")
    return min(-(-num_samples // HOP_LENGTH), MAX_FRAMES)


def audio_tokens_of_frames(num_frames: int) -> int:
    """The tower's output rows (= placeholder tokens) for `num_frames` log-mel frames."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def num_audio_tokens(num_samples: int) -> int:
    """The placeholder tokens of a clip of `num_samples` samples at 16 kHz
    (Qwen2_5OmniProcessor._get_num_audio_tokens)."""
    return audio_tokens_of_frames(num_audio_frames(num_samples))


def audio_span(num_samples: int) -> tuple[int, dict]:
    """A clip of `num_samples` samples at 16 kHz -> (its placeholder tokens, its span metadata)."""
    num_frames = num_audio_frames(num_samples)
    return audio_tokens_of_frames(num_frames), {AUDIO_FRAMES: num_frames}


def feature_settings(extractor) -> dict:
    """What a clip's key includes beside its bytes: the feature extractor's settings."""
    return {k: v for k, v in extractor.to_dict().items() if k != "mel_filters"}


def checkpoint_feature_settings(model_dir: str) -> dict:
    """`feature_settings` of a checkpoint's own feature extractor (transformers', torch-free)."""
    from transformers import WhisperFeatureExtractor

    return feature_settings(WhisperFeatureExtractor.from_pretrained(str(model_dir)))


def expand_image(num_tokens: int) -> str:
    return IMAGE_PAD * num_tokens


def expand_audio(num_tokens: int) -> str:
    """The template's one audio pad -> one pad per placeholder token (the bos / eos are the template's)."""
    return AUDIO_PAD * num_tokens


def refuse_video(plan, placeholder: str) -> str:
    raise ValueError("Qwen2.5-Omni videos are not served yet")


QWEN_OMNI_FORMAT = PromptFormat(
    image_placeholder=IMAGE_PAD,
    video_placeholders=(VIDEO_PAD,),
    image_token=IMAGE_PAD,
    video_token=VIDEO_PAD,
    expand_image=expand_image,
    expand_video=refuse_video,  # never asked: without video rules a video is refused before
    image_geometry=ImageGeometry.from_pretrained,
    image_kwargs=PROCESSOR_KWARGS,
    check_image_kwargs=check_processor_kwargs,
    audio_placeholder=AUDIO_PAD,
    audio_token=AUDIO_PAD,
    expand_audio=expand_audio,
    audio_sampling_rate=SAMPLING_RATE,
    audio_span=audio_span,
    audio_settings=checkpoint_feature_settings,
)
