"""OpenAI response objects: chat.completion(.chunk), text_completion, usage, SSE framing.

A format object (`ChatFormat`, `CompletionFormat`) knows one HTTP request's
id, model and whether logprobs were asked, and builds every JSON object the
request answers with, streamed or not; `epd.api.server` only moves Deltas.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.api.errors import error_body
from epd.requests import Delta, RequestError
from epd.api.tool_calls import ParsedDelta, ToolCallParser, ToolChoice
from epd.transport.sampling import TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
_TEXT_SLOT = "@@epd-text@@"  # stands for the text in a cached event template
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


def sse(obj: dict) -> bytes:
    """One server-sent event, as OpenAI frames them."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class SequenceOutput:
    """Everything one sequence produced so far, accumulated from its Deltas."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(outputs: list[SequenceOutput]) -> dict:
    """The prompt counts once whatever `n` is (as OpenAI and vLLM count it)."""
    prompt_tokens = outputs[0].num_prompt_tokens
    completion_tokens = sum(o.num_tokens for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outputs[0].num_cached_tokens}}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class _Format:
    def __init__(self, request_id: str, model: str, created: int, decode_token: Callable[[int], str],
                 want_logprobs: bool):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.decode_token = decode_token
        self.want_logprobs = want_logprobs
        self._templates: dict[int, tuple[bytes, bytes]] = {}  # index -> the text event around its text

    def delta_event(self, index: int, delta: Delta) -> bytes | None:
        """`sse(delta_chunk(...))`, or None when there is nothing to send. A plain
        text delta (no logprobs, no tool calls, not the last) is the same bytes
        from a template made once per choice, with only the text encoded."""
        if delta.text and delta.finish_reason is None and self._is_plain_text():
            template = self._templates.get(index)
            if template is None:
                prefix, suffix = sse(self._text_chunk(index, _TEXT_SLOT)).split(json.dumps(_TEXT_SLOT).encode())
                template = self._templates[index] = (prefix, suffix)
            return template[0] + json.dumps(delta.text, ensure_ascii=False).encode() + template[1]
        chunk = self.delta_chunk(index, delta)
        return sse(chunk) if chunk is not None else None

    def error_event(self, error: RequestError) -> bytes:
        """An error after the stream began (its status is sent): reported in-band, as vLLM does."""
        return sse(error_body(error))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}


class ChatFormat(_Format):
    """`tool_choice` (auto, required, a named function) turns the text into tool calls
    (epd/api/tool_calls.py), streamed as OpenAI's tool-call deltas."""

    def __init__(self, *args, tool_choice: ToolChoice | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_choice = tool_choice if tool_choice is not None and tool_choice.mode != "none" else None
        self._parsers: dict[int, ToolCallParser] = {}  # streamed: one per choice

    def opening_chunks(self, index: int) -> list[dict]:
        """Sent for every choice before its first content: the role."""
        return [self._chunk(index, {"role": "assistant", "content": ""}, None, None)]

    def delta_chunk(self, index: int, delta: Delta) -> dict | None:
        logprobs = self.logprobs(delta.logprobs or []) if self.want_logprobs and delta.logprobs else None
        if self.tool_choice is not None:
            return self._tool_delta_chunk(index, delta, logprobs)
        if not delta.text and delta.finish_reason is None and logprobs is None:
            return None  # nothing to say yet (e.g. text held back while a stop string may match)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return self._chunk(index, content, delta.finish_reason, logprobs)

    def _is_plain_text(self) -> bool:
        return self.tool_choice is None and not self.want_logprobs

    def _text_chunk(self, index: int, text: str) -> dict:
        return self._chunk(index, {"content": text}, None, None)

    def _tool_delta_chunk(self, index: int, delta: Delta, logprobs: dict | None) -> dict | None:
        parser = self._parsers.setdefault(index, ToolCallParser(self.tool_choice))
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            end = parser.finish()
            parsed = ParsedDelta(parsed.content + end.content, parsed.tool_calls + end.tool_calls)
        if not parsed.content and not parsed.tool_calls and delta.finish_reason is None and logprobs is None:
            return None
        body: dict = {}
        if parsed.content:
            body["content"] = parsed.content
        if parsed.tool_calls:
            body["tool_calls"] = parsed.tool_calls
        return self._chunk(index, body, _finish_reason(parser, delta.finish_reason), logprobs)

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage(outputs)}

    def response(self, outputs: list[SequenceOutput]) -> dict:
        choices = []
        for o in outputs:
            message: dict = {"role": "assistant", "content": o.text}
            finish_reason = o.finish_reason
            if self.tool_choice is not None:  # the same parser as streaming, fed the whole text
                parser = ToolCallParser(self.tool_choice)
                content = parser.feed(o.text).content + parser.finish().content
                message["content"] = content or (None if parser.calls else "")
                if parser.calls:
                    message["tool_calls"] = parser.calls
                finish_reason = _finish_reason(parser, o.finish_reason)
            choices.append({"index": o.index, "message": message,
                            "logprobs": self.logprobs(o.logprobs) if self.want_logprobs else None,
                            "finish_reason": finish_reason})
        return {**self._envelope("chat.completion", choices), "usage": usage(outputs)}

    def logprobs(self, entries: list[TokenLogprobs]) -> dict:
        """OpenAI chat form: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        return {"content": [{**self._token(e.token_id, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        token = self.decode_token(token_id)
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}

    def _chunk(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return self._envelope("chat.completion.chunk", [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])


def _finish_reason(parser: ToolCallParser, finish_reason: str | None) -> str | None:
    """"tool_calls" when the model stopped after calling (auto, required); a named
    function keeps "stop", as in vLLM."""
    if finish_reason == "stop" and parser.calls and parser.choice.mode in ("auto", "required"):
        return "tool_calls"
    return finish_reason


class CompletionFormat(_Format):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # index -> characters of logprob tokens streamed so far

    def opening_chunks(self, index: int) -> list[dict]:
        return []

    def delta_chunk(self, index: int, delta: Delta) -> dict | None:
        logprobs = self._logprobs_from(index, delta.logprobs or []) if self.want_logprobs else None
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return None
        return self._envelope("text_completion", [
            {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}])

    def _is_plain_text(self) -> bool:
        return not self.want_logprobs

    def _text_chunk(self, index: int, text: str) -> dict:
        return self._envelope("text_completion", [
            {"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        return {**self._envelope("text_completion", []), "usage": usage(outputs)}

    def response(self, outputs: list[SequenceOutput]) -> dict:
        choices = [{"index": o.index, "text": o.text,
                    "logprobs": self._logprobs_from(o.index, o.logprobs) if self.want_logprobs else None,
                    "finish_reason": o.finish_reason} for o in outputs]
        return {**self._envelope("text_completion", choices), "usage": usage(outputs)}

    def _logprobs_from(self, index: int, entries: list[TokenLogprobs]) -> dict:
        """Legacy form: tokens, token_logprobs, top_logprobs (the sampled token is always
        in its dict, so up to k + 1 entries, as OpenAI documents), text_offset."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for e in entries:
            token = self.decode_token(e.token_id)
            tokens.append(token)
            token_logprobs.append(_logprob(e.logprob))
            step = {self.decode_token(t): _logprob(lp) for t, lp in e.top}
            step.setdefault(token, _logprob(e.logprob))
            top.append(step)
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
