"""A request's media and prompt made ready for the workers: `Preparer`.

    load media        image, video and audio parts -> raw bytes (never pixels), fetched concurrently
                                                                          epd/inputs/media.py
    admit their bytes  --max-pending-image-mb: refused with 503 beyond it, released once prefilled
    prepare           in a thread unless the prompt is token ids
      chat            the input processor shared with the offline LLM, under the server's media
                      flags: tower adapter, images, videos, audio clips, prompt, media items
                                                                          epd/inputs/input_processor.py
      completion      the prompt's text or ids, through the same input processor (a text past
                      max_model_len refused after tokenizing one piece past it)
                                                                          epd/inputs/input_processor.py
      truncation      truncate_prompt_tokens, never through an image
    check length      the max_tokens to use within max_model_len

The `Prepared` holds the prompt, its spans and its items (epd/inputs/media_item.py:
an image, a video, a video chunk or an audio clip, each with its bytes, key,
patches and, a video's, the `VideoPlan` its EncodeRequest carries).
"""
from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, replace

from epd.config import ServeConfig
from epd.engine.model_info import ModelInfo
from epd.inputs.input_processor import InputProcessor
from epd.inputs.media import MediaError, MediaFetcher, image_part_source
from epd.inputs.media_item import MediaItem
from epd.inputs.media_uuids import ImagesByUuid
from epd.inputs.model_files import ModelFiles
from epd.inputs.prompt import PromptTooLong, audio_parts, image_parts, video_parts
from epd.lora_modules import TowerAdapters
from epd.requests import GenerateRequest, RequestError
from epd.serve.worker_metrics import WorkerMetrics
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.mm_span import MMSpan


@dataclass
class Prepared:
    """What every attempt of a request sends (its prompt and media) and may generate."""

    token_ids: list[int]
    mm_spans: list[MMSpan]
    items: list[MediaItem]  # distinct images, videos and video chunks, one EncodeRequest each when missing
    max_tokens: int = 0  # tokens to generate, over all attempts
    held_image_bytes: int = 0  # counted in --max-pending-image-mb until prefilled (`Preparer.release`)
    tower_lora: LoRARequest | None = None  # the adapter the encoders run (--enable-tower-lora); keys are its

    @property
    def has_video(self) -> bool:
        return any(item.video is not None for item in self.items)


class Preparer:
    """Media -> raw bytes -> tokens, image spans, mm_hashes and patches, for one
    model; and the budget of image bytes waiting to be prefilled."""

    def __init__(self, config: ServeConfig, info: ModelInfo, files: ModelFiles, max_model_len: int,
                 metrics: WorkerMetrics):
        """`files`: the checkpoint's tokenizer, chat template and image processor (epd/inputs/model_files.py)."""
        self.config = config
        self.info = info
        self.files = files
        self.tokenizer = files.tokenizer
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.media = MediaFetcher(config.media)
        self.images_by_uuid = ImagesByUuid()  # vLLM's media uuid: the latest image sent under each
        # the chat path shared with the offline LLM, under the server's media flags
        self.inputs = InputProcessor(files, info, TowerAdapters(config.engine.lora.enable_tower_lora), config.media,
                                     dict(config.files.mm_processor_kwargs))
        self.pending_image_bytes = 0  # raw image bytes of requests not yet prefilled

    async def prepare(self, req: GenerateRequest) -> Prepared:
        """Everything a request's attempts send; RequestError for bad input (400) or
        too many image bytes waiting (503). Holds the request's image bytes until
        `release` (the caller's, once prefilled or done)."""
        raw_images, raw_videos, raw_audios = await self._load_media(req)
        held_image_bytes = self._admit_image_bytes(sum(map(len, raw_images + raw_videos + raw_audios)))
        try:
            if req.messages is None and not isinstance(req.prompt, str):
                prep = self._prepare(req, raw_images)  # token ids: nothing to tokenize, no thread hop
            else:
                prep = await asyncio.to_thread(self._prepare, req, raw_images, raw_videos, raw_audios=raw_audios)
            prep.max_tokens = self._check_length(req, len(prep.token_ids))
        except BaseException:
            self._release_image_bytes(held_image_bytes)
            raise
        prep.held_image_bytes = held_image_bytes
        return prep

    async def prompt_token_ids(self, req: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        """The prompt `prepare(req)` would build (its images fetched for their sizes and hashes,
        each one's placeholders counted), without holding its images or sizing max_tokens:
        what /tokenize answers. `add_special_tokens`: a text prompt's, as the tokenizer adds them."""
        raw_images, raw_videos, raw_audios = await self._load_media(req)
        held_image_bytes = self._admit_image_bytes(sum(map(len, raw_images + raw_videos + raw_audios)))
        try:
            return (await asyncio.to_thread(self._prepare, req, raw_images, raw_videos, add_special_tokens,
                                            raw_audios)).token_ids
        finally:
            self._release_image_bytes(held_image_bytes)

    def release(self, prep: Prepared) -> None:
        """The request's images are no longer needed (prefilled, or the request ended); once only."""
        self._release_image_bytes(prep.held_image_bytes)
        prep.held_image_bytes = 0

    async def aclose(self) -> None:
        await self.media.aclose()

    # ------------------------------------------------------------- media

    async def _load_media(self, req: GenerateRequest) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """Raw bytes of every image, video and audio part, in order, fetched concurrently;
        RequestError for a refused one (the others are cancelled). The per-prompt limits
        were checked by the API layer (protocol.validate_messages) before any fetch."""
        if req.messages is None:
            return [], [], []
        parts, videos, audios = image_parts(req.messages), video_parts(req.messages), audio_parts(req.messages)
        if parts and self.files.no_images_reason:  # a text-only checkpoint: nothing fetched
            raise RequestError(status=400, message=self.files.no_images_reason, param="messages")
        if videos and self.files.no_video_reason:
            raise RequestError(status=400, message=self.files.no_video_reason, param="messages")
        loads = [asyncio.ensure_future(self._load_image(part)) for part in parts]
        loads += [asyncio.ensure_future(self.media.load(image_part_source(part), "video")) for part in videos]
        loads += [asyncio.ensure_future(self._load_audio(part)) for part in audios]
        try:
            loaded = list(await asyncio.gather(*loads))
            first_audio = len(parts) + len(videos)
            return loaded[:len(parts)], loaded[len(parts):first_audio], loaded[first_audio:]
        except MediaError as exc:
            raise RequestError(status=400, message=str(exc), param="messages") from None
        finally:
            for load in loads:
                load.cancel()
            await asyncio.gather(*loads, return_exceptions=True)

    async def _load_image(self, part: dict) -> bytes:
        """One image part's bytes: its url's, or (a uuid without url) those sent under its uuid."""
        uuid = part.get("uuid")
        if uuid is not None and image_part_source(part) is None:
            data = self.images_by_uuid.get(uuid)
            if data is None:
                raise MediaError(f"no image was sent under uuid {uuid!r} (or it is no longer kept): send its url")
            return data
        data = await self.media.load(image_part_source(part))
        if uuid is not None:
            self.images_by_uuid.put(uuid, data)
        return data

    async def _load_audio(self, part: dict) -> bytes:
        """One audio part's file bytes: OpenAI's `input_audio` (base64 data, checked by the API
        layer) or vLLM's `audio_url` (data:, file:// or http(s), under the media policy)."""
        if part["type"] == "input_audio":
            data = base64.b64decode(part["input_audio"]["data"])
            if len(data) > self.config.media.max_bytes("audio"):
                raise MediaError(f"audio of {len(data)} bytes exceeds the limit of "
                                 f"{self.config.media.max_bytes('audio')} bytes")
            return data
        return await self.media.load(part["audio_url"]["url"], "audio")

    def _admit_image_bytes(self, num_bytes: int) -> int:
        limit = self.config.limits.max_pending_image_bytes
        if num_bytes and self.pending_image_bytes + num_bytes > limit:
            self.metrics.requests_refused["image_bytes"] += 1
            raise RequestError(status=503, message=f"the server is busy: {self.pending_image_bytes} image bytes are "
                               f"waiting to be encoded (--max-pending-image-mb)", type="service_unavailable",
                               retry_after_s=1)
        self.pending_image_bytes += num_bytes
        return num_bytes

    def _release_image_bytes(self, num_bytes: int) -> None:
        self.pending_image_bytes -= num_bytes

    # ------------------------------------------------------------ prompt

    def _prepare(self, req: GenerateRequest, raw_images: list[bytes], raw_videos: list[bytes] = (),
                 add_special_tokens: bool = False, raw_audios: list[bytes] = ()) -> Prepared:
        """Tokens, image and video spans and distinct media; RequestError for bad input."""
        # one token at least is left to generate; a prompt to be truncated is tokenized whole
        max_prompt_tokens = self.max_model_len - 1 if req.truncate_prompt_tokens is None else None
        if req.messages is None:
            try:
                ids = self.inputs.process_prompt(req.prompt, add_special_tokens or req.add_special_tokens,
                                                 max_prompt_tokens)
            except PromptTooLong as exc:
                raise self._too_long(exc, "prompt") from None
            return self._truncated(req, Prepared(ids, [], []))
        try:
            processed = self.inputs.process_chat(
                req.messages, raw_images, list(raw_videos), lora=req.lora, mm_processor_kwargs=req.mm_processor_kwargs,
                add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                template_kwargs=req.chat_template_kwargs, continue_final_message=req.continue_final_message,
                max_prompt_tokens=max_prompt_tokens, audio_bytes=list(raw_audios))
        except PromptTooLong as exc:
            raise self._too_long(exc, "messages") from None
        return self._truncated(req, Prepared(processed.token_ids, processed.mm_spans, processed.items,
                                             tower_lora=processed.tower_lora))

    def _truncated(self, req: GenerateRequest, prep: Prepared) -> Prepared:
        """vLLM's truncate_prompt_tokens: keep k tokens (-1: as many as the model takes
        beside max_tokens), the last ones (truncation_side left) or the first (right).
        A cut through an image's placeholders is refused: an image is whole or absent."""
        k = req.truncate_prompt_tokens
        if k is not None and k < 0:
            k = self.max_model_len - (req.sampling.max_tokens or 0)
        ids = prep.token_ids
        if k is None or k >= len(ids):
            return prep
        start = len(ids) - k if req.truncation_side == "left" else 0
        if any(span.offset < start or span.offset + span.length > start + k for span in prep.mm_spans):
            raise RequestError(status=400, message=f"truncate_prompt_tokens: keeping {k} of the prompt's {len(ids)} "
                               "tokens would cut an image", param="truncate_prompt_tokens")
        if k == 0:
            raise RequestError(status=400, message="truncate_prompt_tokens: 0 leaves an empty prompt",
                               param="truncate_prompt_tokens")
        spans = [replace(span, offset=span.offset - start) for span in prep.mm_spans]
        return replace(prep, token_ids=ids[start:start + k], mm_spans=spans)

    def _too_long(self, exc: PromptTooLong, param: str) -> RequestError:
        return RequestError(status=400, message=f"This model's maximum context length is {self.max_model_len} "
                            f"tokens; {exc}, leaving none to generate", param=param)

    def _check_length(self, req: GenerateRequest, num_prompt_tokens: int) -> int:
        """The max_tokens to use: what the request asked (None: the generation config's
        default) after the generation config's cap, cut to the room beside the prompt, as
        vLLM 0.32 does (`get_max_tokens`; asking past max_model_len itself is refused at the
        API, `protocol.check_max_tokens`). RequestError when the prompt leaves no room."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise RequestError(status=400, message=f"This model's maximum context length is {self.max_model_len} "
                               f"tokens. However, your prompt contains {num_prompt_tokens} input tokens, which "
                               "leaves no room for output tokens. Please reduce the length of the input prompt.",
                               param="prompt" if req.messages is None else "messages")
        max_tokens = self.files.sampling_defaults.max_tokens_for(req.sampling.max_tokens)
        return room if max_tokens is None else min(max_tokens, room)
