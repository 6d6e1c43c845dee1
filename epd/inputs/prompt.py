"""Chat messages -> prompt token ids and image / video spans, without decoding pixels.

The chat template renders one placeholder per image and per video; what they
are, and the text each becomes, is the model family's `PromptFormat`
(transport/media/prompt_format.py, registered in epd/families/registry.py):
an image's from the number of tokens its width and height give
(`ItemGeometry`), exactly as transformers' processor does after decoding; a
video's from its `VideoPlan` (made from the header,
transport/media/video_geometry.py). Image parts are recognised in the OpenAI
form (`image_url`) and in transformers' (`image`, `image_pil`), video parts as
`video_url` and `video`. Spans: one per image, one per run of a video's pads
(a temporal group between timestamps or frame labels, or a video or chunk of
one run; `VideoRef.chunks`). Where a video's positions hold the image token
(GLM-4.1V, InternVL), the placeholders' order says which runs are whose.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from epd.transport.media.prompt_format import ItemGeometry, PromptFormat
from epd.transport.media.video_geometry import VideoPlan
from epd.transport.media.video_keys import entry_hashes
from epd.transport.wire.mm_span import MMSpan

IMAGE_PART_TYPES = ("image_url", "image", "image_pil", "input_image")
VIDEO_PART_TYPES = ("video_url", "video")
AUDIO_PART_TYPES = ("input_audio", "audio_url", "audio")
PIECE_CHARS = 1 << 16  # `exceeds_tokens` tokenizes a long text this many characters at a time
BOUNDARY_SLACK_TOKENS = 16  # tokens a cut between two pieces may add, at most
NO_CHAT_TEMPLATE = ("this model has no chat template (no chat_template.json, chat_template.jinja or "
                    "tokenizer_config.json chat_template): start it with --chat-template FILE, or use /v1/completions")


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model can take (found before tokenizing all of it)."""


def exceeds_tokens(tokenizer, text: str, max_tokens: int, piece_chars: int = PIECE_CHARS) -> bool:
    """Whether `text` surely has more than `max_tokens` tokens, found without
    tokenizing more of it than that: a long text is tokenized piece by piece
    (cut before a space, where byte-level BPE's pre-tokenizer splits anyway) and
    the count stops once it passes `max_tokens` plus a slack for every cut. The
    tokenizer's memory grows with what it is given (~200 bytes a character), so
    a prompt of megabytes costs one piece, not the whole text. False means "not
    surely": the caller tokenizes the whole text and checks the exact count."""
    if len(text) <= piece_chars:
        return False
    count, start, num_cuts = 0, 0, 0
    while start < len(text):
        end = min(len(text), start + piece_chars)
        if end < len(text):
            cut = text.rfind(" ", start + piece_chars // 2, end)
            end = cut if cut > start else end
            num_cuts += 1
        count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if count > max_tokens + BOUNDARY_SLACK_TOKENS * num_cuts:
            return True
        start = end
    return False


@dataclass(frozen=True)
class ImageRef:
    """What the prompt needs to know of one image: size and content key."""

    width: int
    height: int
    mm_hash: str


@dataclass(frozen=True)
class VideoRef:
    """What the prompt needs to know of one video: the plan made from its
    header and its content key (transport/media/video_keys.video_mm_hash), and the
    chunks it is encoded in (transport/media/video_chunks.py; none: one piece)."""

    plan: VideoPlan
    mm_hash: str
    chunks: tuple[VideoPlan, ...] = field(default=())

    @property
    def pieces(self) -> tuple[VideoPlan, ...]:
        """The plans it is encoded in: its chunks, or the whole plan."""
        return self.chunks or (self.plan,)

    @property
    def entry_hashes(self) -> list[str]:
        """The keys its spans name, in order (one per temporal group for Qwen3-VL,
        one per chunk for a Qwen2.5-VL video cut into chunks)."""
        return [key for piece in self.pieces for key in entry_hashes(self.mm_hash, piece)]


@dataclass(frozen=True)
class AudioRef:
    """What the prompt needs to know of one audio clip: its placeholder tokens, content key
    and span metadata (the family's: what its position rule reads)."""

    num_tokens: int
    mm_hash: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    mm_spans: list[MMSpan]


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages with content as a string or a list of {"type": "text"|"image"} parts,
    the form the chat template reads. Image payloads are dropped: the template
    only needs their position. `tool_calls` (assistant) and `tool_call_id` (tool)
    pass through."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind in IMAGE_PART_TYPES:
                    parts.append({"type": "image"})
                elif kind in VIDEO_PART_TYPES:
                    parts.append({"type": "video"})
                elif kind in AUDIO_PART_TYPES:
                    parts.append({"type": "audio"})
                elif kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                else:
                    raise ValueError(f"unsupported content part type {kind!r}")
            content = parts
        clean = {"role": msg["role"], "content": content}
        for key in ("tool_calls", "tool_call_id"):
            if key in msg:
                clean[key] = msg[key]
        out.append(clean)
    return out


def image_parts(messages: list[dict]) -> list[dict]:
    """The image content parts of `messages`, in prompt order."""
    return _parts(messages, IMAGE_PART_TYPES)


def audio_parts(messages: list[dict]) -> list[dict]:
    """The audio content parts of `messages` (`input_audio`, `audio_url`), in prompt order."""
    return _parts(messages, AUDIO_PART_TYPES)


def video_parts(messages: list[dict]) -> list[dict]:
    """The video content parts of `messages`, in prompt order."""
    return _parts(messages, VIDEO_PART_TYPES)


def _parts(messages: list[dict], kinds: tuple[str, ...]) -> list[dict]:
    return [part for msg in messages if isinstance(msg.get("content"), list)
            for part in msg["content"] if part.get("type") in kinds]


def token_id(tokenizer, token: str) -> int:
    """`token`'s id in the tokenizer's vocabulary, -1 when it has none."""
    found = tokenizer.convert_tokens_to_ids(token)
    return -1 if found is None or found == getattr(tokenizer, "unk_token_id", None) else found


class PromptBuilder:
    def __init__(self, tokenizer, geometry: ItemGeometry | None, image_token_id: int,
                 chat_template: str | None = None, video_token_id: int | None = None, *,
                 prompt_format: PromptFormat):
        """`geometry` None: a text-only checkpoint. `chat_template`: the template's text
        (epd/inputs/model_files.py resolves it); None: the tokenizer's own.
        `video_token_id` (config.json's): None, the tokenizer's video token (-1: it has none).
        `prompt_format`: the checkpoint family's (epd/families/registry.py)."""
        self.tokenizer = tokenizer
        self.geometry = geometry
        self.image_token_id = image_token_id
        self.format = prompt_format
        self._placeholders = re.compile("(" + "|".join(re.escape(p) for p in self.format.placeholders) + ")")
        self.video_token_id = token_id(tokenizer, self.format.video_token) if video_token_id is None \
            else video_token_id
        if self.format.video_token == self.format.image_token:  # GLM-4.1V, InternVL: a video's positions
            self.video_token_id = image_token_id  # hold the image token, whatever config.json names
        self.chat_template = chat_template
        self.audio_token_id = token_id(tokenizer, self.format.audio_token) if self.format.audio_token else -1

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, continue_final_message: bool = False,
               template_kwargs: dict | None = None) -> str:
        """The chat template's text; `tools` (OpenAI function tools) are rendered by the template;
        `continue_final_message`: the last message left open, for the model to go on with it;
        `template_kwargs`: more variables for the template (vLLM's chat_template_kwargs)."""
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(NO_CHAT_TEMPLATE)
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                normalize_messages(messages), tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=self.chat_template,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except TemplateError as exc:  # the template refused these messages (its raise_exception)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def build(self, messages: list[dict], images: list[ImageRef], add_generation_prompt: bool = True,
              tools: list[dict] | None = None, max_tokens: int | None = None,
              continue_final_message: bool = False, template_kwargs: dict | None = None,
              videos: list[VideoRef] = (), audios: list[AudioRef] = ()) -> Prompt:
        """`images`, `videos` and `audios` each in the order their parts appear in `messages`.
        `max_tokens`: a rendered prompt surely longer is refused (PromptTooLong) before
        it is tokenized whole."""
        text = self.render(messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
        if max_tokens is not None:
            self.check_length(text, images, videos, max_tokens, audios)
        return self.expand(text, images, videos, audios)

    def check_length(self, text: str, images: list[ImageRef], videos: list[VideoRef], max_tokens: int,
                     audios: list[AudioRef] = ()) -> None:
        """PromptTooLong when `text` (one placeholder per image and video) surely expands past
        `max_tokens`, counted from the plans' arithmetic, before any expansion: each pad
        becomes at least its media's placeholder tokens (a video's `plan.num_tokens`)."""
        num_media = sum(self.geometry.num_image_tokens(img.width, img.height) for img in images) \
            + sum(video.plan.num_tokens for video in videos) + sum(audio.num_tokens for audio in audios)
        if num_media > max_tokens:
            media = "images, videos and audio clips" if audios else "images and videos"
            raise PromptTooLong(f"the prompt has more than {max_tokens} tokens (its {media} take {num_media})")
        if exceeds_tokens(self.tokenizer, text, max_tokens - num_media + len(images) + len(videos) + len(audios)):
            raise PromptTooLong(f"the prompt has more than {max_tokens} tokens")

    def expand(self, text: str, images: list[ImageRef], videos: list[VideoRef] = (),
               audios: list[AudioRef] = ()) -> Prompt:
        """A rendered prompt's one placeholder per image, video and audio clip expanded, tokenized,
        its spans found."""
        fmt = self.format
        pieces = self._placeholders.split(text)  # text, placeholder, text, placeholder, ..., text
        pads = pieces[1::2]
        counts = {"images": (pads.count(fmt.image_placeholder), images),
                  "videos": (sum(pads.count(p) for p in fmt.video_placeholders), videos),
                  "audio clips": (pads.count(fmt.audio_placeholder) if fmt.audio_placeholder else 0, audios)}
        for name, (count, given) in counts.items():
            if count != len(given):
                raise ValueError(f"the chat template rendered {count} {name}, {len(given)} were given")
        image_it, video_it, audio_it = iter(images), iter(videos), iter(audios)
        expanded = [pieces[0]]
        for pad, piece in zip(pads, pieces[2::2]):
            if pad == fmt.audio_placeholder:
                expanded.append(fmt.expand_audio(next(audio_it).num_tokens))
            elif pad == fmt.image_placeholder:
                img = next(image_it)
                runs = self._runs(img)
                expanded.append(fmt.expand_image(runs[0]) if fmt.expand_image_runs is None
                                else fmt.expand_image_runs(runs))
            else:
                expanded.append(fmt.expand_video(next(video_it).plan, pad))
            expanded.append(piece)
        token_ids = self.tokenizer.encode("".join(expanded), add_special_tokens=False)
        kinds = ["image" if pad == fmt.image_placeholder else "video" for pad in pads if pad != fmt.audio_placeholder]
        return Prompt(token_ids=token_ids, mm_spans=self.spans(token_ids, images, videos, kinds, audios))

    def _runs(self, img: ImageRef) -> tuple[int, ...]:
        """The lengths of an image's runs of pads: one run unless the format writes several."""
        if self.format.expand_image_runs is None:
            return (self.geometry.num_image_tokens(img.width, img.height),)
        return self.geometry.image_runs(img.width, img.height)

    def _image_runs(self, images: list[ImageRef]):
        """(image, its entry's first row, length) of each run of image pads, in prompt order."""
        for img in images:
            row = 0
            for length in self._runs(img):
                yield img, row, length
                row += length

    def spans(self, token_ids: list[int], images: list[ImageRef], videos: list[VideoRef] = (),
              kinds: list[str] | None = None, audios: list[AudioRef] = ()) -> list[MMSpan]:
        """One span per run of image pads (one image, or one of its runs: a Gemma 3 pan-and-scan
        crop's) and per run of video pads (a temporal group between text, or a whole Qwen2.5-VL
        video), in prompt order. `kinds`: "image" or "video" per placeholder, in prompt order;
        what tells the runs apart where a video's positions hold the image token (GLM-4.1V,
        InternVL; their images are one run each). An audio clip is one span, of its own token."""
        spans = []
        i, n = 0, len(token_ids)
        image_it, video_runs, audio_it = self._image_runs(images), iter(_video_runs(videos)), iter(audios)
        shared = self.video_token_id == self.image_token_id
        if shared and kinds is None:
            raise ValueError("images and videos share a token here: their order must be given")
        run_kinds = iter(_run_kinds(kinds, videos)) if shared else None
        while i < n:
            token = token_ids[i]
            if token == self.audio_token_id:
                i = _audio_span(token_ids, i, next(audio_it, None), spans)
                continue
            if token != self.image_token_id and token != self.video_token_id:
                i += 1
                continue
            j = i
            while j < n and token_ids[j] == token:
                j += 1
            if token == self.image_token_id and (run_kinds is None or next(run_kinds, "image") == "image"):
                spans.append(self._image_span(i, j - i, next(image_it, None)))
            else:
                spans += _video_spans(i, j - i, video_runs)
            i = j
        if next(image_it, None) is not None:
            raise ValueError("fewer image placeholders in the prompt than images")
        if next(video_runs, None) is not None:
            raise ValueError("fewer video placeholders in the prompt than the videos take")
        if next(audio_it, None) is not None:
            raise ValueError("fewer audio placeholders in the prompt than audio clips")
        return spans

    def _image_span(self, offset: int, length: int, run: tuple[ImageRef, int, int] | None) -> MMSpan:
        if run is None:
            raise ValueError("the prompt holds more image placeholders than images")
        img, first_row, expected = run
        if length != expected:
            raise ValueError(f"image placeholder run of {length} tokens, expected {expected}")
        return MMSpan(offset=offset, length=length, mm_hash=img.mm_hash,
                      meta=self.geometry.span_meta(img.width, img.height), first_row=first_row)


def _audio_span(token_ids: list[int], offset: int, audio: AudioRef | None, spans: list[MMSpan]) -> int:
    """The clip's span at `offset` appended to `spans` (its tokens all the audio token); its end."""
    if audio is None:
        raise ValueError("the prompt holds more audio placeholders than audio clips")
    end = offset + audio.num_tokens
    if token_ids[offset:end] != [token_ids[offset]] * audio.num_tokens:
        raise ValueError(f"audio placeholder run shorter than the clip's {audio.num_tokens} tokens")
    spans.append(MMSpan(offset, audio.num_tokens, audio.mm_hash, audio.meta))
    return end


def span_meta(grid_thw: tuple[int, int, int], second_per_grid_t: float = 0.0, first_group: int = 0) -> dict:
    """A Qwen span's metadata (MMSpan.meta, read by epd/families/qwen_vl/mrope.py): its grid in
    patches, and a Qwen2.5-VL video's seconds per temporal group and a chunk's first
    group, each only when set."""
    meta: dict = {"grid_thw": tuple(grid_thw)}
    if second_per_grid_t:
        meta["second_per_grid_t"] = second_per_grid_t
    if first_group:
        meta["first_group"] = first_group
    return meta


def _video_spans(offset: int, length: int, video_runs) -> list[MMSpan]:
    """The spans of one run of video pads: a Qwen3-VL group's, a Qwen2.5-VL video's, or
    the consecutive spans of a Qwen2.5-VL video's chunks, which fill the run together."""
    spans, end = [], offset + length
    while offset < end:
        span = next(video_runs, None)
        if span is None:
            raise ValueError("the prompt holds more video placeholders than the videos take")
        if span.length > end - offset or (span.length < end - offset and not span.continues):
            raise ValueError(f"video placeholder run of {length} tokens does not fit the video's")
        spans.append(MMSpan(offset, span.length, span.mm_hash,
                            span_meta(span.grid_thw, span.second_per_grid_t, span.first_group)))
        offset += span.length
    if span.continues:
        raise ValueError(f"video placeholder run of {length} tokens is shorter than the video's")
    return spans


def _run_kinds(kinds: list[str], videos: list[VideoRef]):
    """"image" or "video" for each run of placeholder tokens, in order: an image is one run, a
    video one per temporal group where text parts its groups (timestamps, frame labels), else one."""
    video_it = iter(videos)
    for kind in kinds:
        if kind == "image":
            yield "image"
            continue
        plan = next(video_it).plan
        yield from ["video"] * (plan.grid_thw[0] if plan.group_timestamps_s else 1)


@dataclass(frozen=True)
class _Run:
    """One video span to place: its key, grid, tokens, Qwen2.5-VL time step and first group."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    length: int
    second_per_grid_t: float = 0.0
    first_group: int = 0
    continues: bool = False  # another chunk's span of the same run of pads follows


def _video_runs(videos: list[VideoRef]):
    """Each video span the videos write (a `_Run`), in order."""
    for video in videos:
        plan = video.plan
        t, h, w = plan.grid_thw
        if plan.group_timestamps_s:  # Qwen3-VL: a (1, h, w) span per group
            yield from (_Run(key, (1, h, w), plan.tokens_per_group) for key in video.entry_hashes)
            continue
        pieces = video.pieces  # Qwen2.5-VL: the temporal step of its M-RoPE positions rides on each span
        for k, (piece, key) in enumerate(zip(pieces, video.entry_hashes)):
            yield _Run(key, piece.grid_thw, piece.num_tokens, plan.second_per_grid_t, piece.first_group,
                       continues=k + 1 < len(pieces))
