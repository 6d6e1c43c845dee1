"""A request's videos made ready for the workers from their container headers
alone (the API process decodes no pixel): `VideoInputs`.

    settings      the checkpoint's video rules (its family's: ModelFiles.video_geometry),
                  --mm-processor-kwargs' video keys, then the
                  request's own mm_processor_kwargs (vLLM's), as `VideoOptions`
    plan          header -> sampled frames (--media-io-kwargs video.num_frames first), resized
                  size, tokens                                   epd/inputs/video_header.plan_video
    limits        --max-video-frames (container), --max-image-pixels (a frame),
                  --max-request-video-pixels (what the encoder will decode, all videos together);
                  the request's own kwargs within the video and the server's budget, a temporal
                  group's frame within the image budget (the rules' check_request, plan_video)
    keys          the video's mm_hash over its bytes, the video processor config and the plan's
                  frames and size (the same video sampled otherwise is another entry), and the
                  keys of the entries its spans name: one per temporal group for Qwen3-VL
                                                                  transport/media/video_keys.py
    chunks        --video-chunk-frames: a longer video cut into chunks of whole temporal groups,
                  each its own EncodeRequest (its own encoder)    transport/media/video_chunks.py

Each video's (or chunk's) `VideoPlan` goes to its encoder in the EncodeRequest
(transport/media/video_plan_fields.py), so the encoder decodes what was counted here. The offline LLM
(no media flags: its caller's own files) plans each video as the checkpoint and
the call say, within no limit, and encodes it whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.transport.media.video_chunks import split_plan
from epd.transport.media.prompt_format import VideoRules
from epd.transport.media.video_geometry import VideoMeta, VideoOptions, VideoPlan
from epd.transport.media.video_keys import entry_hashes, video_mm_hash
from epd.inputs.media import MediaConfig
from epd.inputs.media_item import MediaItem
from epd.inputs.model_files import ModelFiles, split_processor_kwargs
from epd.inputs.prompt import VideoRef
from epd.inputs.video_header import VideoError, VideoKwargsRefused, plan_video
from epd.requests import RequestError
from epd.transport.embedding_cache.mm_cache import adapted_mm_hash


@dataclass(frozen=True)
class VideoPiece:
    """What one EncodeRequest of a video encodes: the whole video, or one chunk of it."""

    key: str  # the item's key at the API (cache lookup, router): the video's, or its chunk's first entry's
    plan: VideoPlan  # the whole plan, or the chunk's

    @property
    def num_patches(self) -> int:
        """The encoder's work (its router's cost): frames x patches, t x h x w over its temporal groups."""
        return self.plan.num_patches


@dataclass(frozen=True)
class PlannedVideo:
    """One video part: its content key, the processor's plan and the chunks it is encoded in."""

    mm_hash: str
    plan: VideoPlan
    chunks: tuple[VideoPlan, ...] = ()  # () : encoded whole

    @property
    def ref(self) -> VideoRef:
        """What the prompt needs of it (epd/inputs/prompt.py)."""
        return VideoRef(self.plan, self.mm_hash, self.chunks)

    @property
    def entry_hashes(self) -> list[str]:
        """The keys its spans name (and the encoders write), in order."""
        return self.ref.entry_hashes

    def pieces(self) -> list[VideoPiece]:
        """One per EncodeRequest: the whole video under its own key, or each chunk
        under its first entry's key (distinct per chunk)."""
        if not self.chunks:
            return [VideoPiece(self.mm_hash, self.plan)]
        return [VideoPiece(entry_hashes(self.mm_hash, chunk)[0], chunk) for chunk in self.chunks]

    def piece_entries(self, piece: VideoPiece) -> list[str]:
        """The keys of the entries `piece`'s EncodeRequest writes."""
        return entry_hashes(self.mm_hash, piece.plan)

    def items(self, data: bytes) -> list[MediaItem]:
        """Its EncodeRequests' items: the whole video, or each chunk (--video-chunk-frames)."""
        return [MediaItem(piece.key, data, piece.num_patches, piece.plan.num_tokens, piece.plan, tuple(self.piece_entries(piece)),
                          None if piece.key == self.mm_hash else self.mm_hash) for piece in self.pieces()]


class VideoInputs:
    def __init__(self, files: ModelFiles, media: MediaConfig | None, server_kwargs: dict, fingerprint: str):
        """`media`: the server's media flags (None: the offline LLM's caller's own files: no limit,
        no chunk); `server_kwargs`: --mm-processor-kwargs (its video keys are every video's defaults)."""
        self.files = files
        self.media = media
        self.defaults = split_processor_kwargs(server_kwargs)[1]
        self.server = VideoOptions.from_kwargs(self.defaults)  # checked at start-up (epd/inputs/model_files.py)
        self.fingerprint = fingerprint

    def options(self, request_kwargs: dict | None) -> VideoOptions:
        """The server's video settings under the request's: a request's fps drops the
        server's num_frames and the other way round (they exclude each other)."""
        request_kwargs = request_kwargs or {}
        merged = {**self.defaults, **request_kwargs}
        for key, other in (("fps", "num_frames"), ("num_frames", "fps")):
            if key in request_kwargs and other not in request_kwargs:
                merged.pop(other, None)
        return _request_options(merged)

    def plan(self, raw_videos: list[bytes], request_kwargs: dict | None,
             tower_digest: str | None = None) -> list[PlannedVideo]:
        """Every video part's plan and key (adapted to the tower adapter of `tower_digest`,
        if any), in order; RequestError (400) for a video refused: not a video, settings
        its processor refuses, past a limit."""
        if not raw_videos:
            return []
        geometry = self.files.video_geometry
        if geometry is None:
            raise RequestError(self.files.no_video_reason, param="messages")
        options = self.options(request_kwargs)
        out, num_decoded = [], 0
        for data in raw_videos:
            meta, plan = self._plan(data, geometry, options, request_kwargs)
            num_decoded += (max(plan.frame_indices) + 1) * meta.width * meta.height  # FFmpeg decodes those skipped
            if self.media is not None and num_decoded > self.media.max_request_video_pixels:
                raise RequestError(f"the request's videos decode to more than {self.media.max_request_video_pixels} "
                                   "pixels in all (--max-request-video-pixels)", param="messages")
            key = video_mm_hash(data, self.fingerprint, self.files.video_processor_config or {}, plan)
            chunks = split_plan(plan, geometry.temporal_patch_size, self.media.video_chunk_frames) \
                if self.media is not None else [plan]
            out.append(PlannedVideo(key if tower_digest is None else adapted_mm_hash(key, tower_digest), plan,
                                    tuple(chunks) if len(chunks) > 1 else ()))
        return out

    def _plan(self, data: bytes, geometry: VideoRules, options: VideoOptions,
              request_kwargs: dict | None) -> tuple[VideoMeta, VideoPlan]:
        """One video's header and plan, within the server's limits (none offline)."""
        try:
            if self.media is None:
                return plan_video(data, geometry, options)
            request = _request_options(request_kwargs)  # its own kwargs, without the server's: what is bounded
            image_budget = getattr(self.files.geometry, "max_pixels", None)  # a family's whose images have one
            return plan_video(data, geometry, options, max_frames=self.media.max_video_frames,
                              max_frame_pixels=self.media.max_image_pixels,
                              loader_num_frames=self.media.video_num_frames, request=request,
                              server=self.server, max_group_pixels=image_budget)
        except VideoKwargsRefused as exc:
            raise RequestError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs") from None
        except VideoError as exc:
            raise RequestError(f"video: {exc}", param="messages") from None


def _request_options(kwargs: dict | None) -> VideoOptions:
    """VideoOptions from mm_processor_kwargs; a bad key or value is a 400 naming it."""
    try:
        return VideoOptions.from_kwargs(kwargs)
    except ValueError as exc:
        raise RequestError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs") from None
