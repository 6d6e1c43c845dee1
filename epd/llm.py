"""Offline inference: `from epd import LLM, SamplingParams`.

One process runs everything (the aggregated path): the vision tower encodes
each distinct image and video once, the engine schedules all requests together
with continuous batching. A chat's messages and media become its prompt, spans
and media items through the server's own input processor
(epd/inputs/input_processor.py: a video planned from its header as the API
plans it), then each item is decoded and encoded (encoders/encode_items.py,
encoders/video_encoder.py); audio clips are decoded, keyed by content and
encoded once per call (encoders/audio_encoder.py); each sequence's outputs become text, stop strings
and logprobs in the server's own output processor (epd/output_processor.py).
With `enable_tower_lora=True` an adapter's vision tower weights run on its
requests' images and videos (keyed apart, as the server keys them:
epd/lora_modules.TowerAdapters).
"""
from __future__ import annotations

import base64
import itertools
import logging
import operator
from dataclasses import dataclass, field

from epd.encoders.audio_encoder import AudioEncoder
from epd.encoders.encode_items import encode_items
from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.tower_lora import TowerLoRASettings
from epd.encoders.video_encoder import VideoEncoder
from epd.transport.media.video_geometry import VideoOptions
from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.engine.spec.check import check_speculative_model
from epd.engine.structured_output import check_constraint
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs
from epd.families.registry import family_of
from epd.inputs.input_processor import InputProcessor, ProcessedPrompt
from epd.inputs.media import MediaConfig, image_part_source, load_image_bytes
from epd.inputs.media_item import MediaItem
from epd.inputs.model_files import ModelFiles, ModelFilesConfig
from epd.inputs.prompt import AudioRef, audio_parts, image_parts, video_parts
from epd.lora_modules import TowerAdapters
from epd.output_processor import OutputProcessor
from epd.requests import RequestError
from epd.transport.embedding_cache.mm_entry import MMEntry

log = logging.getLogger("epd.llm")
MAX_VIDEO_BYTES = 1 << 30  # offline: the caller's own files, bounded only against a mistake


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or non-EOS stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # vLLM's: with `prompt_logprobs=k`, None for the first prompt token, then each token's logprob
    # under the tokens before it (its rank, the top k)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """`LLM(model, max_num_seqs=8, device="cpu")`: engine settings by their flat
    vLLM names (`EngineConfig.from_flat`), or a whole `EngineConfig`. As vLLM's:
    `chat_template` (a file or the template itself; default the checkpoint's),
    `generation_config` ("auto": the checkpoint's generation_config.json gives the
    sampling defaults of a call that passes no SamplingParams; "vllm"; a directory)
    and `override_generation_config` (a dict on top); `tokenizer` (another directory's)
    and `mm_processor_kwargs` (min_pixels / max_pixels over the image processor's)."""

    def __init__(self, model: str, config: EngineConfig | None = None, *, chat_template: str | None = None,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 tokenizer: str | None = None, mm_processor_kwargs: dict | None = None, **engine_settings):
        if config is not None and engine_settings:
            raise TypeError("pass either an EngineConfig or engine settings, not both")
        self.config = config or EngineConfig.from_flat(**engine_settings)
        if self.config.kv_events_config is not None and self.config.kv_events_config.is_on:  # nobody would take them
            raise ValueError("kv_events_config: KV events are published by a served engine worker (epd serve, "
                             "epd worker); the offline LLM has no publisher")
        # config.json, family, tokenizer, chat template, sampling defaults: CheckpointError (ValueError) names
        # what is wrong; an unsupported family fails here too, with the supported ones named
        self.files = ModelFiles.open(model, ModelFilesConfig(
            chat_template, generation_config, tuple((override_generation_config or {}).items()), tokenizer,
            tuple((mm_processor_kwargs or {}).items())))
        for note in self.files.notes():
            log.log(logging.WARNING if note.startswith("warning:") else logging.INFO, note)
        # an EAGLE-3 head or draft model for another target: refused before the target's weights load
        check_speculative_model(self.config.speculative_config, model, tokenizer, self.files.hf_config)
        self.tokenizer = self.files.tokenizer
        self.engine = EngineCore(model, self.config, hf_config=self.files.hf_config, tokenizer_dir=tokenizer)
        info = self.engine.info
        self.encoder = None if self.files.no_images_reason else ImageEncoder(
            model, self.files.hf_config, self.engine.dtype, self.engine.device, model_fingerprint=info.fingerprint,
            processor_kwargs=mm_processor_kwargs, tower_lora=TowerLoRASettings.of(self.config.lora))
        self.video = None if self.encoder is None or self.files.video_geometry is None else VideoEncoder(
            model, self.encoder.vision, self.engine.device, geometry=self.files.video_geometry)
        self.family = family_of(self.files.hf_config)
        self.audio = None if self.family.audio is None else AudioEncoder(
            model, self.files.hf_config, self.engine.dtype, self.engine.device, model_fingerprint=info.fingerprint)
        # chat messages -> prompt, spans and media items, as the server's (no media flags: the caller's own files)
        self.inputs = InputProcessor(self.files, info, TowerAdapters(self.config.lora.enable_tower_lora))
        # offline: the caller's own files; videos under their own cap, errors naming "video"
        self.media = MediaConfig(allowed_local_media_path="/", max_video_bytes=MAX_VIDEO_BYTES)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams samples with: the generation config's
        defaults (vLLM's `LLM.get_default_sampling_params`), else SamplingParams()."""
        return self.files.sampling_defaults.sampling_params()

    # -- public API ----------------------------------------------------------------

    def chat(self, conversations, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Each conversation is a list of OpenAI-format messages; a single
        conversation may be passed directly. `tools` (OpenAI function tools) are
        rendered by the chat template, and `chat_template_kwargs` are more variables
        for it (as vLLM's LLM.chat takes them); constrain the output with
        `SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`;
        `lora_request` as `generate`'s. Videos: `{"type": "video_url", "video_url":
        {"url": "file://..." or "data:video/..."}}` parts, sampled as the checkpoint's
        video processor says, or as `mm_processor_kwargs` (fps, num_frames,
        do_sample_frames, min/max_pixels, min/max_frames;
        epd/transport/media/video_geometry.VideoOptions) override it. Audio (a family that
        takes it: Qwen2.5-Omni): OpenAI's `{"type": "input_audio", "input_audio": {"data":
        base64, "format": "wav"}}` or vLLM's `{"type": "audio_url", "audio_url": {"url":
        "file://..." or "data:audio/..."}}` parts."""
        VideoOptions.from_kwargs(mm_processor_kwargs)  # a bad key or value: ValueError before any work
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = self._params_list(sampling_params, len(conversations))
        loras = _per_prompt(lora_request, len(conversations))
        requests, audio_entries = [], {}
        for messages, p, lora in zip(conversations, params, loras):
            parts, videos = image_parts(messages), video_parts(messages)
            if (parts or videos) and self.encoder is None:
                raise ValueError(self.files.no_images_reason)
            image_bytes = [load_image_bytes(image_part_source(part), self.media) for part in parts]
            video_bytes = [load_image_bytes(_video_source(part), self.media, modality="video") for part in videos]
            clips = [_audio_bytes(part, self.media) for part in audio_parts(messages)]
            audios = self._encode_audio(clips, audio_entries) if clips else []
            try:  # the server's chat path (epd/inputs/input_processor.py), without its media flags
                prompt = self.inputs.process_chat(messages, image_bytes, video_bytes, audios=audios, lora=lora,
                                                  mm_processor_kwargs=mm_processor_kwargs,
                                                  add_generation_prompt=add_generation_prompt, tools=tools,
                                                  template_kwargs=chat_template_kwargs)
            except RequestError as exc:
                raise ValueError(exc.message) from None
            requests.append((prompt, p, lora))
        return self._run(requests, audio_entries)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Plain text prompts (no chat template) or token ids, in vLLM's forms: a str, a
        list of ids, `{"prompt": str}` (TextPrompt) or `{"prompt_token_ids": [...]}`
        (TokensPrompt), one or a list of them; audio as vLLM's: `{"prompt": str,
        "multi_modal_data": {"audio": [clip, ...]}}`, a clip the bytes of an audio file or
        (samples, sampling_rate), each written in the prompt as the family's placeholder
        (Qwen2.5-Omni: `<|audio_bos|><|AUDIO|><|audio_eos|>`). `lora_request` (vLLM's): one adapter for
        every prompt, or one per prompt (None: the base model); needs `enable_lora=True`."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        requests = []
        audio_entries: dict[str, MMEntry] = {}
        for prompt, p, lora in zip(prompts, params, _per_prompt(lora_request, len(prompts))):
            if isinstance(prompt, dict) and "multi_modal_data" in prompt:
                requests.append((self._audio_prompt(prompt, audio_entries), p, lora))
                continue
            requests.append((ProcessedPrompt(self._prompt_ids(prompt), [], []), p, lora))
        return self._run(requests, audio_entries)

    def stats(self) -> dict[str, int | float]:
        return self.engine.stats()

    # -- internals -------------------------------------------------------------------

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)

    def _prompt_ids(self, prompt) -> list[int]:
        """One `generate` prompt's token ids; ValueError naming what is wrong with it."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or not prompt:
                raise ValueError(f"a dict prompt holds 'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt, "
                                 f"TokensPrompt); got keys {sorted(prompt)}")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if not isinstance(prompt, str):
            try:  # ints, numpy or torch integers alike; a str inside is the usual mistake
                ids = [operator.index(t) for t in prompt if not isinstance(t, bool)]
            except TypeError:
                ids = None
            if ids is None or len(ids) != len(prompt):
                raise ValueError(f"a prompt is text or a non-empty list of token ids, got {str(prompt)[:80]}")
            prompt = ids
        try:  # the server's own check and tokenization (epd/inputs/input_processor.py)
            return self.inputs.process_prompt(prompt)
        except RequestError as exc:
            raise ValueError(f"{exc.message}, got {str(prompt)[:80]}") from None

    def _audio_prompt(self, prompt: dict, known: dict[str, MMEntry]) -> ProcessedPrompt:
        """A text prompt with audio placeholders and its clips -> its ids and spans (the clips' entries
        added to `known`)."""
        data, text = prompt["multi_modal_data"], prompt.get("prompt")
        if not isinstance(data, dict) or set(data) != {"audio"}:
            raise ValueError("generate's multi_modal_data takes \"audio\"; pass images and videos to LLM.chat")
        if not isinstance(text, str) or set(prompt) - {"prompt", "multi_modal_data"}:
            raise ValueError("a prompt with multi_modal_data holds its text in 'prompt'")
        refs = self._encode_audio(data["audio"] if isinstance(data["audio"], list) else [data["audio"]], known)
        built = self.inputs.prompts.expand(text, [], [], refs)  # the chat path's expansion and spans
        return ProcessedPrompt(built.token_ids, built.mm_spans, [])

    def _encode_audio(self, given: list, known: dict[str, MMEntry]) -> list[AudioRef]:
        """Clips (file bytes, or (samples, sampling_rate)) -> each one's ref; the entries of those not
        in `known` (the call's, by key) encoded in one pass and added to it."""
        if self.audio is None:
            raise ValueError(f"{self.family.name} takes no audio")
        clips = [self.audio.clip(a) for a in given]
        known.update(self.audio.encode([c for c in clips if c.mm_hash not in known]))
        return [AudioRef(known[c.mm_hash].embeddings.shape[0], c.mm_hash, dict(known[c.mm_hash].meta)) for c in clips]

    def _encode_videos(self, wanted: dict[str, tuple[MediaItem, LoRARequest | None]]) -> dict[str, MMEntry]:
        """Each video's entries (a Qwen3-VL video: one per temporal group), by the keys its spans name."""
        out: dict[str, MMEntry] = {}
        for item, tower_lora in wanted.values():
            with self.encoder.adapted(tower_lora):
                out.update(self.video.encode(item.data, item.video, item.mm_hash))
        return out

    def _encode_images(self, wanted: dict[str, tuple[MediaItem, LoRARequest | None]]) -> dict[str, MMEntry]:
        """Each image's entry by its key: one tower pass per tower adapter (None: the base tower,
        encoders/encode_items.py); the first image that fails raises its error."""
        entries = encode_items(self.encoder, [item.data for item, _ in wanted.values()],
                               [tower_lora for _, tower_lora in wanted.values()])
        for entry in entries:
            if isinstance(entry, ValueError):
                raise entry
        return dict(zip(wanted, entries))

    def _run(self, requests: list[tuple[ProcessedPrompt, SamplingParams, LoRARequest | None]],
             audio_entries: dict[str, MMEntry] | None = None) -> list[RequestOutput]:
        """Each (prompt, its sampling params, its language-model adapter) run to the end, as vLLM's LLM does;
        `audio_entries`: the clips' entries, encoded already, by key."""
        for _, params, _ in requests:  # a schema xgrammar refuses: ValueError before any work
            if params.structured_outputs is not None:
                check_constraint(params.structured_outputs)
        for lora in dict.fromkeys(lora for *_, lora in requests if lora is not None):  # a bad adapter: before any work
            self.engine.load_lora(lora)
        images: dict[str, tuple[MediaItem, LoRARequest | None]] = {}  # distinct items over the call, by key
        videos: dict[str, tuple[MediaItem, LoRARequest | None]] = {}
        for prompt, _, _ in requests:
            for item in prompt.items:
                (images if item.video is None else videos)[item.key] = (item, prompt.tower_lora)
        embeddings = self._encode_images(images)
        embeddings.update(self._encode_videos(videos))
        embeddings.update(audio_entries or {})

        outputs: list[RequestOutput] = []
        pending: dict[str, OutputProcessor] = {}  # every sequence of the call, by its engine request id
        for prompt, params, lora in requests:
            token_ids, spans = prompt.token_ids, prompt.mm_spans
            rid = str(next(self._ids))
            out = RequestOutput(request_id=rid, prompt_token_ids=list(token_ids))
            outputs.append(out)
            for index in range(params.n):
                sub_params = params
                if params.n > 1 and params.seed is not None:  # distinct but reproducible samples
                    sub_params = SamplingParams(**{**params.__dict__, "seed": params.seed + index, "n": 1})
                request = Request(request_id=f"{rid}-{index}", prompt_token_ids=list(token_ids),
                                  sampling_params=sub_params, mm_spans=list(spans), lora_request=lora)
                self.engine.add_request(request, {s.mm_hash: embeddings[s.mm_hash] for s in spans})
                pending[request.request_id] = OutputProcessor(self.tokenizer, token_ids, params)

        while self.engine.has_unfinished():
            result = self.engine.step()
            for request_id in result.failed:  # its grammar failed to compile in the engine
                pending[request_id].finish("error")
            stopped = []
            for update in result.updates:
                step = pending[update.request_id].take(update.new_token_ids, result.logprobs.get(update.request_id),
                                                       update.finish_reason,
                                                       result.prompt_logprobs.get(update.request_id))
                if step.finish_reason is not None and update.finish_reason is None:
                    stopped.append(update.request_id)  # a stop string ended it; the engine would go on
            if stopped:
                self.engine.abort(stopped)

        for out in outputs:
            for index in itertools.count():
                seq = pending.get(f"{out.request_id}-{index}")
                if seq is None:
                    break
                out.outputs.append(CompletionOutput(index, seq.text, seq.token_ids, seq.finish_reason, seq.logprobs,
                                                    seq.stop_reason))
                if seq.prompt_logprobs is not None and out.prompt_logprobs is None:
                    out.prompt_logprobs = [None, *seq.prompt_logprobs]
        return outputs


def _per_prompt(lora_request, n: int) -> list[LoRARequest | None]:
    """vLLM's forms: None, one LoRARequest for all, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"{len(lora_request)} lora requests for {n} prompts")
    return list(lora_request)


def _video_source(part: dict) -> str:
    """The URL a video content part points to (OpenAI's `video_url`, transformers' `video`)."""
    value = part.get("video_url") if part.get("type") == "video_url" else part.get("video")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError("a video part needs a non-empty URL (data: or file://)")
    return url


def _audio_bytes(part: dict, media: MediaConfig) -> bytes:
    """The bytes of an audio part's file: OpenAI's `input_audio` (base64 data), vLLM's `audio_url`."""
    if part.get("type") == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data:
            raise ValueError("an input_audio part needs base64 'data'")
        try:
            return base64.b64decode(data, validate=True)
        except ValueError:
            raise ValueError("input_audio data is not base64") from None
    value = part.get("audio_url") if part.get("type") == "audio_url" else part.get("audio")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError("an audio part needs a non-empty URL (data: or file://)")
    return load_image_bytes(url, media, modality="audio")
