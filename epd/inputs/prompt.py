"""Chat messages -> prompt token ids and image spans, without decoding pixels.

The chat template renders one `<|image_pad|>` per image; each is expanded to
the number of placeholder tokens the image will take, computed from its width
and height alone (`ImageGeometry`), exactly as transformers' Qwen3-VL
processor does after decoding. Image parts are recognised in the OpenAI form
(`image_url`) and in transformers' (`image`, `image_pil`).
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.encoders.image_processor import ImageGeometry
from epd.transport.mm_span import MMSpan

IMAGE_PART_TYPES = ("image_url", "image", "image_pil", "input_image")
IMAGE_PAD = "<|image_pad|>"
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
    return [part for msg in messages if isinstance(msg.get("content"), list)
            for part in msg["content"] if part.get("type") in IMAGE_PART_TYPES]


class PromptBuilder:
    def __init__(self, tokenizer, geometry: ImageGeometry | None, image_token_id: int,
                 chat_template: str | None = None):
        """`geometry` None: a text-only checkpoint. `chat_template`: the template's text
        (epd/inputs/model_files.py resolves it); None: the tokenizer's own."""
        self.tokenizer = tokenizer
        self.geometry = geometry
        self.image_token_id = image_token_id
        self.chat_template = chat_template

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
              continue_final_message: bool = False, template_kwargs: dict | None = None) -> Prompt:
        """`images` in the order their parts appear in `messages`. `max_tokens`: a rendered
        prompt surely longer is refused (PromptTooLong) before it is tokenized whole."""
        text = self.render(messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
        if max_tokens is not None and exceeds_tokens(self.tokenizer, text, max_tokens):  # image pads only add
            raise PromptTooLong(f"the prompt has more than {max_tokens} tokens")
        pieces = text.split(IMAGE_PAD)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the chat template rendered {len(pieces) - 1} images, {len(images)} were given")
        expanded = [pieces[0]]
        for img, piece in zip(images, pieces[1:]):
            expanded.append(IMAGE_PAD * self.geometry.num_image_tokens(img.width, img.height))
            expanded.append(piece)
        token_ids = self.tokenizer.encode("".join(expanded), add_special_tokens=False)
        return Prompt(token_ids=token_ids, mm_spans=self.spans(token_ids, images))

    def spans(self, token_ids: list[int], images: list[ImageRef]) -> list[MMSpan]:
        spans = []
        i, n = 0, len(token_ids)
        it = iter(images)
        while i < n:
            if token_ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < n and token_ids[j] == self.image_token_id:
                j += 1
            img = next(it, None)
            if img is None:
                raise ValueError("the prompt holds more image placeholders than images")
            grid = self.geometry.grid_thw(img.width, img.height)
            spans.append(MMSpan(offset=i, length=j - i, mm_hash=img.mm_hash, grid_thw=grid))
            i = j
        if next(it, None) is not None:
            raise ValueError("fewer image placeholders in the prompt than images")
        for span in spans:
            t, h, w = span.grid_thw
            expected = t * h * w // self.geometry.merge_size ** 2
            if span.length != expected:
                raise ValueError(f"image placeholder run of {span.length} tokens, expected {expected}")
        return spans
