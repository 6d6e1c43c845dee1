"""OpenAI response objects: chat.completion(.chunk), text_completion, usage, SSE framing.

A format object (`ChatFormat`, `CompletionFormat`) knows one HTTP request's
id, model and whether logprobs were asked, and builds every JSON object the
request answers with, streamed or not; `epd.api.server` only moves Deltas.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.api.protocol import Delta
from epd.transport.sampling import TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
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

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}


class ChatFormat(_Format):
    def opening_chunks(self, index: int) -> list[dict]:
        """Sent for every choice before its first content: the role."""
        return [self._chunk(index, {"role": "assistant", "content": ""}, None, None)]

    def delta_chunk(self, index: int, delta: Delta) -> dict | None:
        logprobs = self.logprobs(delta.logprobs or []) if self.want_logprobs and delta.logprobs else None
        if not delta.text and delta.finish_reason is None and logprobs is None:
            return None  # nothing to say yet (e.g. text held back while a stop string may match)
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return self._chunk(index, content, delta.finish_reason, logprobs)

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage(outputs)}

    def response(self, outputs: list[SequenceOutput]) -> dict:
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                    "logprobs": self.logprobs(o.logprobs) if self.want_logprobs else None,
                    "finish_reason": o.finish_reason} for o in outputs]
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
