"""One image, video, video chunk or audio clip of a request, from its preparation to its
encoder: `MediaItem`.

The preparer makes one per distinct item (epd/serve/preparer.py), placement
looks its entries up in the cache, routes it by its patches and sends it in
one EncodeRequest (epd/serve/placement.py). Torch-free: the API process holds it.
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.transport.media.video_geometry import VideoPlan


@dataclass(frozen=True)
class MediaItem:
    """What one EncodeRequest encodes: an image, a whole video, one chunk of a
    video (`--video-chunk-frames`), or an audio clip (its file's bytes)."""

    key: str  # at the API (cache lookup, router): an image's or video's mm_hash, a chunk's first entry's
    data: bytes  # the raw bytes, never pixels
    num_patches: int  # the encoder's work (its router's cost): an image's patches, a video's over its groups
    num_tokens: int  # its embeddings' rows in the prompt: what a cache hit saves the prefill
    video: VideoPlan | None = None  # a video's or chunk's plan: the frames to decode and their size (None: an image)
    entry_keys: tuple[str, ...] = ()  # a video's or chunk's: the keys of the entries it writes, in prompt order
    video_hash: str | None = None  # a chunk's: its video's mm_hash, which its EncodeRequest carries
    is_audio: bool = False  # an audio clip (its cost and tokens: its placeholder count)

    @property
    def kind(self) -> str:
        """"image", "video", "video chunk" or "audio"."""
        if self.is_audio:
            return "audio"
        if self.video is None:
            return "image"
        return "video" if self.video_hash is None else "video chunk"

    @property
    def mm_hash(self) -> str:
        """The key its EncodeRequest carries (the encoder keys a chunk's entries from its video's)."""
        return self.key if self.video_hash is None else self.video_hash

    @property
    def entries(self) -> tuple[str, ...]:
        """The keys of the cache entries it writes: all there, it needs no encoder."""
        return self.entry_keys or (self.key,)
