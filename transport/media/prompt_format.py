"""How a model family writes its images and videos into a prompt, torch-free:
`PromptFormat`, the interface the API process and the offline LLM ask
(epd/inputs/prompt.py `PromptBuilder`, epd/inputs/input_processor.py). A family
registers one (epd/families/registry.py `ModelFamily.prompt_format`); the
generic code names no placeholder of its own.

    placeholders   what the chat template writes for one image or video (`image_placeholder`,
                   `video_placeholders`), found in the rendered text
    expansion      the text that replaces one of them, given the item's token count or video plan
                   (`expand_image`, `expand_video`); an image written as several runs of placeholders
                   with text between them (Gemma 3's pan-and-scan crops), given its runs' lengths
                   (`expand_image_runs`)
    tokens         the token each of an item's placeholder positions holds (`image_token`,
                   `video_token`: config.json's image / video token id when it has one)
    geometry       how an image's size gives its token count, from the checkpoint's processor files
                   (`image_geometry`: an `ItemGeometry`), and a video's plan from its header
                   (`video_geometry`: `VideoRules`; None: the family takes no video)
    audio          a clip's placeholder, its token and its expansion (`audio_placeholder`, `audio_token`,
                   `expand_audio`; None: the family takes no audio)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from epd.transport.media.video_geometry import VideoMeta, VideoOptions, VideoPlan


class ItemGeometry(Protocol):
    """What an image's width and height alone give (no pixels decoded), exactly as the
    family's processor; each call raises ValueError for a size the processor refuses."""

    def num_image_tokens(self, width: int, height: int) -> int:
        """The placeholder tokens the image takes in the prompt."""
        ...

    def patches(self, width: int, height: int) -> int:
        """The image's work for the tower (its patches): what encoder batches and routing count."""
        ...

    def span_meta(self, width: int, height: int) -> dict:
        """The family's metadata of the image's span (MMSpan.meta: what its position rule reads)."""
        ...

    def image_runs(self, width: int, height: int) -> tuple[int, ...]:
        """The lengths of the image's runs of placeholders, in prompt order, summing to its
        `num_image_tokens`; asked only of a format with `expand_image_runs` (one run otherwise)."""
        ...


class VideoRules(Protocol):
    """A family's video processor rules, read from the checkpoint's files: a video's plan from
    its header alone (sampled frames, their size, temporal groups, tokens), exactly as the
    family's processor does after decoding. Its `VideoPlan` is what the encoder executes."""

    temporal_patch_size: int  # frames a temporal group holds (a chunk is whole groups)
    image_mean: tuple[float, float, float]  # the encoder's normalisation of a frame
    image_std: tuple[float, float, float]
    rescale_factor: float

    def check_request(self, meta: VideoMeta, request: VideoOptions, server: VideoOptions) -> None:
        """VideoKwargsError naming a request's own key whose value would cost more than the server allows."""
        ...

    def plan(self, meta: VideoMeta, options: VideoOptions, loaded: list[int] | None = None) -> VideoPlan:
        """The plan; VideoPlanError where the processor would refuse. `loaded`: frames a loader
        took before the processor (vLLM's --media-io-kwargs video.num_frames), used as they are."""
        ...


@dataclass(frozen=True)
class PromptFormat:
    """One family's placeholders, their expansion and its image geometry."""

    image_placeholder: str  # what the chat template writes once per image
    video_placeholders: tuple[str, ...]  # what it may write once per video, the longest first
    image_token: str  # the token of every placeholder position of an image
    video_token: str  # ... of a video
    expand_image: Callable[[int], str]  # number of tokens -> the text replacing `image_placeholder`
    expand_video: Callable[[VideoPlan, str], str]  # plan, the placeholder found -> the text replacing it
    # the checkpoint's directory, --mm-processor-kwargs' image keys -> its geometry (ValueError: a bad value)
    image_geometry: Callable[[str | Path, dict | None], ItemGeometry]
    image_kwargs: tuple[str, ...] = ()  # the --mm-processor-kwargs keys its image processor and geometry take
    check_image_kwargs: Callable[[dict], None] = lambda kwargs: None  # ValueError: a key or value refused
    # an image's runs' lengths -> the text replacing `image_placeholder` (None: every image is one run)
    expand_image_runs: Callable[[tuple[int, ...]], str] | None = None
    # the checkpoint's directory -> its video rules (FileNotFoundError: no video processor config; ValueError,
    # TypeError, KeyError: one it cannot read); None: the family takes no video, a request with one is refused
    video_geometry: Callable[[str | Path], VideoRules] | None = None
    # audio (a family with an audio side): what the template writes once per clip, the token of each of a clip's
    # placeholder positions, and its number of tokens -> the text replacing the placeholder; None: no audio
    audio_placeholder: str | None = None
    audio_token: str | None = None
    expand_audio: Callable[[int], str] | None = None
    # a served clip: the rate its samples are counted at, their count -> (tokens, span meta), and the checkpoint
    # dir -> its feature extractor's settings (in the clip's key, as the encoder's audio side keys it)
    audio_sampling_rate: int = 0
    audio_span: Callable[[int], tuple[int, dict]] | None = None
    audio_settings: Callable[[str], dict] | None = None

    @property
    def placeholders(self) -> tuple[str, ...]:
        """Every placeholder a rendered prompt may hold, a longer one before any it starts with."""
        audio = (self.audio_placeholder,) if self.audio_placeholder else ()
        return tuple(sorted((*self.video_placeholders, self.image_placeholder, *audio), key=len, reverse=True))
