"""A chat request's messages and media bytes -> prompt token ids, spans and media
items: `InputProcessor` (vLLM's), one for the server's Preparer
(epd/serve/preparer.py) and the offline LLM (epd/llm.py).

    tower adapter  --enable-tower-lora and the request's adapter has tower weights: every key
                   adapted to it (its images never share the base's)   epd/lora_modules.TowerAdapters
    images         header size -> grid and patches, mm_hash            encoders/image_io.py,
                                                                       transport/embedding_cache/mm_cache.py
    videos         header -> plan (frames, size, tokens), mm_hash, chunks   epd/inputs/video_inputs.py
    audio clips    samples counted as the encoder will hold them -> the family's tokens, mm_hash
                                                                       epd/inputs/audio_header.py
    prompt         chat template + the family's placeholder expansion  epd/inputs/prompt.py,
                                                                       epd/families/registry.py (PromptFormat)
    items          one MediaItem per distinct image, video, chunk or clip   epd/inputs/media_item.py

Fetching the bytes stays with each caller (the server fetches asynchronously,
the LLM reads its caller's files), as do the server's pending-bytes budget and
its length check. With `limits` (the server's media flags) images and videos
are held to them; without (the offline LLM: the caller's own files) an image
keeps the default pixel cap, a video is planned as the checkpoint and the call
say and encoded whole. A refused input is a RequestError (400) naming the
request's field; the LLM raises it as a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.encoders.image_io import DEFAULT_MAX_IMAGE_PIXELS, ImageError, read_image_size
from epd.engine.model_info import ModelInfo
from epd.families.registry import get_family
from epd.inputs.audio_header import AudioError, read_audio_samples
from epd.inputs.media import MediaConfig
from epd.inputs.media_item import MediaItem
from epd.inputs.model_files import ModelFiles
from epd.inputs.prompt import AudioRef, ImageRef, PromptBuilder, PromptTooLong, audio_parts, exceeds_tokens
from epd.inputs.video_inputs import VideoInputs
from epd.lora_modules import TowerAdapters
from epd.requests import RequestError
from epd.transport.embedding_cache.mm_cache import adapted_mm_hash, audio_key_config, mm_hash
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.mm_span import MMSpan


@dataclass(frozen=True)
class ProcessedPrompt:
    """A request made ready for the engine: what its attempts send (a completion prompt: its ids alone)."""

    token_ids: list[int]
    mm_spans: list[MMSpan]
    items: list[MediaItem]  # distinct images, videos and video chunks, in prompt order
    tower_lora: LoRARequest | None = None  # the adapter the encoders run (its keys are the items'), or None


class InputProcessor:
    def __init__(self, files: ModelFiles, info: ModelInfo, tower_adapters: TowerAdapters,
                 limits: MediaConfig | None = None, server_kwargs: dict | None = None):
        """`files`: the checkpoint's tokenizer, chat template and processors (epd/inputs/model_files.py);
        `limits`: the server's media flags (None: the offline LLM's, see above); `server_kwargs`:
        --mm-processor-kwargs (its video keys are every video's defaults)."""
        self.files = files
        self.info = info
        self.tower_adapters = tower_adapters
        self.limits = limits
        self.processor_config = files.processor_config or {}
        self.prompts = PromptBuilder(files.tokenizer, files.geometry, info.image_token_id,
                                     files.chat_template and files.chat_template.text,
                                     video_token_id=info.video_token_id if info.video_token_id >= 0 else None,
                                     prompt_format=get_family(info.family).prompt_format)
        self.videos = VideoInputs(files, limits, dict(server_kwargs or {}), info.fingerprint)
        self._audio_key_config: dict | None = None  # a clip's key config, once a clip comes (reads the extractor)

    def process_prompt(self, prompt: str | list[int], add_special_tokens: bool = False,
                       max_prompt_tokens: int | None = None) -> list[int]:
        """A completion prompt's token ids: text tokenized (PromptTooLong when it surely has
        more than `max_prompt_tokens`, before the whole text is tokenized), or ids checked
        against the vocabulary. RequestError for an empty prompt or an id out of range."""
        if isinstance(prompt, str):
            if max_prompt_tokens is not None and exceeds_tokens(self.files.tokenizer, prompt, max_prompt_tokens):
                raise PromptTooLong(f"the prompt has more than {max_prompt_tokens} tokens")
            ids = self.files.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError(status=400, message="a prompt is text or a non-empty list of token ids; it is empty",
                               param="prompt")
        if any(not 0 <= t < self.info.vocab_size for t in ids):
            raise RequestError(status=400, message=f"a prompt takes token ids in [0, {self.info.vocab_size}) only",
                               param="prompt")
        return ids

    def process_chat(self, messages: list[dict], images: list[bytes], videos: list[bytes], *,
                     lora: LoRARequest | None = None, mm_processor_kwargs: dict | None = None,
                     add_generation_prompt: bool = True, tools: list[dict] | None = None,
                     template_kwargs: dict | None = None, continue_final_message: bool = False,
                     max_prompt_tokens: int | None = None, audios: list[AudioRef] = (),
                     audio_bytes: list[bytes] = ()) -> ProcessedPrompt:
        """`images` and `videos`: the raw bytes of the messages' image and video parts, in
        order; their audio clips either as `audios`, counted and keyed (offline: encoded already,
        the caller holds their entries), or as `audio_bytes`, the files' bytes (the server's:
        each becomes an item for an encoder). RequestError for an input refused; PromptTooLong
        past `max_prompt_tokens`."""
        audio_items = []
        if audio_bytes:
            audio_items, audios = self._audios(list(audio_bytes))
        num_parts = len(audio_parts(messages))
        if num_parts != len(audios):  # never dropped silently
            family = get_family(self.info.family)
            raise RequestError(status=400, param="messages", message=f"{family.name} takes no audio"
                               if family.audio is None else f"the messages hold {num_parts} audio parts; "
                               f"{len(audios)} clips were given")
        tower_digest = self._tower_digest(lora) if images or videos else None
        image_items, refs = self._images(images, tower_digest)
        planned = self.videos.plan(list(videos), mm_processor_kwargs, tower_digest)
        try:
            prompt = self.prompts.build(messages, refs, add_generation_prompt, tools, max_tokens=max_prompt_tokens,
                                        continue_final_message=continue_final_message,
                                        template_kwargs=template_kwargs, videos=[v.ref for v in planned],
                                        audios=audios)
        except PromptTooLong:
            raise
        except ValueError as exc:
            raise RequestError(status=400, message=str(exc), param="messages") from None
        items = image_items + [item for video, data in zip(planned, videos) for item in video.items(data)]
        items += audio_items
        return ProcessedPrompt(prompt.token_ids, prompt.mm_spans, list({item.key: item for item in items}.values()),
                               lora if tower_digest else None)

    def _tower_digest(self, lora: LoRARequest | None) -> str | None:
        """The digest of the request's tower adapter (None: the base tower runs its images)."""
        try:
            return self.tower_adapters.digest(lora)
        except ValueError as exc:
            raise RequestError(status=400, message=str(exc), param="model") from None

    def _images(self, raw_images: list[bytes], tower_digest: str | None = None
                ) -> tuple[list[MediaItem], list[ImageRef]]:
        """Each image part's item (keyed by its mm_hash, adapted to the tower adapter of
        `tower_digest`, if any) and its size and hash, from the headers alone;
        RequestError for an image refused."""
        max_image_pixels = DEFAULT_MAX_IMAGE_PIXELS if self.limits is None else self.limits.max_image_pixels
        images, refs, num_pixels = [], [], 0
        for data in raw_images:
            try:
                width, height = read_image_size(data, max_image_pixels)
                patches = self.files.geometry.patches(width, height)  # refuses sizes the processor refuses
                num_tokens = self.files.geometry.num_image_tokens(width, height)
            except (ImageError, ValueError) as exc:
                raise RequestError(status=400, message=str(exc), param="messages") from None
            num_pixels += width * height
            if self.limits is not None and num_pixels > self.limits.max_request_pixels:
                raise RequestError(status=400, message=f"the request's images have more than "
                                   f"{self.limits.max_request_pixels} pixels in all (--max-request-pixels)",
                                   param="messages")
            key = mm_hash(data, self.info.fingerprint, self.processor_config)
            if tower_digest is not None:
                key = adapted_mm_hash(key, tower_digest)
            images.append(MediaItem(key, data, patches, num_tokens))
            refs.append(ImageRef(width, height, key))
        return images, refs

    def _audios(self, raw_audios: list[bytes]) -> tuple[list[MediaItem], list[AudioRef]]:
        """Each clip's item and ref: its samples counted as the encoder will hold them, the family's
        tokens and span metadata, keyed as the encoder's audio side keys it (encoders/audio_encoder.py);
        RequestError for a clip refused."""
        family = get_family(self.info.family)
        fmt = family.prompt_format
        if family.audio is None or fmt.audio_span is None:
            raise RequestError(status=400, message=f"{family.name} takes no audio", param="messages")
        if self._audio_key_config is None:
            self._audio_key_config = audio_key_config(family.model_type, fmt.audio_settings(self.files.model_dir))
        max_seconds = self.limits.max_audio_seconds if self.limits is not None else float("inf")
        items, refs = [], []
        for data in raw_audios:
            try:
                num_tokens, meta = fmt.audio_span(read_audio_samples(data, fmt.audio_sampling_rate, max_seconds))
            except (AudioError, ValueError) as exc:
                raise RequestError(status=400, message=str(exc), param="messages") from None
            key = mm_hash(data, self.info.fingerprint, self._audio_key_config)
            items.append(MediaItem(key, data, num_tokens, num_tokens, is_audio=True))
            refs.append(AudioRef(num_tokens, key, dict(meta)))
        return items, refs
