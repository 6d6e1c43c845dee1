"""OpenAI response objects of the completions endpoints (/v1/chat/completions, /v1/completions):
chat.completion(.chunk), text_completion, usage, SSE framing. (The Responses API: responses_*.py.)

A format object (`ChatFormat`, `CompletionFormat`) knows one HTTP request's
id, model, whether logprobs were asked and vLLM's extras (`Extras`: token ids,
usage in every chunk, echo, choices per prompt), and builds every JSON object
the request answers with, streamed or not; `epd.api.server` only moves Deltas.
Every choice carries vLLM's `stop_reason`; the non-streamed answers carry its
`prompt_logprobs` (null unless asked) and, asked for, `prompt_token_ids` /
`token_ids`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.api.errors import error_body
from epd.requests import Delta, RequestError
from epd.api.tool_calls import DEFAULT_TOOL_PARSER, ParsedDelta, ToolCallParser, ToolChoice
from epd.transport.wire.sampling import TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
_TEXT_SLOT = "@@epd-text@@"  # stands for the text in a cached event template
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


def sse(obj: dict) -> bytes:
    """One server-sent event, as OpenAI frames them."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Extras:
    """vLLM's additions to an answer that a request asked for."""

    n: int = 1  # choices per prompt: choice i answers prompt i // n
    return_token_ids: bool = False  # prompt_token_ids (once per choice) and token_ids
    continuous_usage: bool = False  # usage (this choice's) in every streamed chunk
    echo: tuple[str, ...] = ()  # per prompt: the text its answers start with
    role: str = "assistant"  # chat: the answer's role
    echo_only: bool = False  # completions, echo with max_tokens 0: the prompt alone (vLLM)
    echo_logprobs: bool = False  # completions, echo: the prompt's logprobs lead the answer's (even with no text)

    @property
    def is_plain(self) -> bool:
        return not (self.return_token_ids or self.continuous_usage or any(self.echo) or self.echo_only)

    def echo_of(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""


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
    token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.token_ids += delta.token_ids
        self.stop_reason = delta.stop_reason if delta.finish_reason is not None else self.stop_reason
        self.prompt_token_ids = delta.prompt_token_ids or self.prompt_token_ids
        self.prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else self.prompt_logprobs
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def usage(outputs: list[SequenceOutput], n: int = 1) -> dict:
    """Each prompt counts once whatever `n` is (as OpenAI and vLLM count it); a batch's prompts add up."""
    prompts = outputs[::n]
    prompt_tokens = sum(o.num_prompt_tokens for o in prompts)
    completion_tokens = sum(o.num_tokens for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in prompts)}}


def choice_usage(output: SequenceOutput) -> dict:
    """vLLM's continuous usage: this choice's prompt and its tokens so far."""
    return {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": output.num_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_tokens}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_json(output: SequenceOutput, decode_token: Callable[[int], str]) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} for the token itself and the top k."""
    if output.prompt_logprobs is None:
        return None
    steps: list[dict | None] = [None]
    for e in output.prompt_logprobs:
        step = {str(e.token_id): {"logprob": _logprob(e.logprob), "rank": e.rank,
                                  "decoded_token": decode_token(e.token_id)}}
        for rank, (token_id, logprob) in enumerate(e.top, start=1):
            step.setdefault(str(token_id), {"logprob": _logprob(logprob), "rank": rank,
                                            "decoded_token": decode_token(token_id)})
        steps.append(step)
    return steps


class _Format:
    def __init__(self, request_id: str, model: str, created: int, decode_token: Callable[[int], str],
                 want_logprobs: bool, extras: Extras = Extras()):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.decode_token = decode_token
        self.want_logprobs = want_logprobs
        self.extras = extras
        self._templates: dict[int, tuple[bytes, bytes]] = {}  # index -> the text event around its text
        self._started: set[int] = set()  # choices whose first chunk (echo, prompt_token_ids) went out

    def delta_event(self, index: int, delta: Delta, output: SequenceOutput | None = None) -> bytes | None:
        """`sse(delta_chunk(...))`, or None when there is nothing to send. A plain
        text delta (no logprobs, no tool calls, no extras, not the last) is the same
        bytes from a template made once per choice, with only the text encoded.
        `output`: the choice so far, for continuous usage."""
        if delta.text and delta.finish_reason is None and self.extras.is_plain and self._is_plain_text():
            template = self._templates.get(index)
            if template is None:
                prefix, suffix = sse(self._text_chunk(index, _TEXT_SLOT)).split(json.dumps(_TEXT_SLOT).encode())
                template = self._templates[index] = (prefix, suffix)
            return template[0] + json.dumps(delta.text, ensure_ascii=False).encode() + template[1]
        chunk = self.delta_chunk(index, delta)
        if chunk is not None and output is not None and self.extras.continuous_usage:
            chunk["usage"] = choice_usage(output)
        return sse(chunk) if chunk is not None else None

    def error_event(self, error: RequestError) -> bytes:
        """An error after the stream began (its status is sent): reported in-band, as vLLM does."""
        return sse(error_body(error))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _token_ids(self, output: SequenceOutput) -> dict:
        return {"token_ids": output.token_ids if self.extras.return_token_ids else None}


class ChatFormat(_Format):
    """`tool_choice` (auto, required, a named function) turns the text into tool calls
    (epd/api/tool_calls.py; auto in the `tool_parser` format), streamed as OpenAI's tool-call deltas."""

    def __init__(self, *args, tool_choice: ToolChoice | None = None, tools: list[dict] | None = None,
                 tool_parser: str = DEFAULT_TOOL_PARSER, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_choice = tool_choice if tool_choice is not None and tool_choice.mode != "none" else None
        self.tools = tools  # the request's (a format may read a value by its parameter's type)
        self.tool_parser = tool_parser  # auto's format: --tool-call-parser
        self._parsers: dict[int, ToolCallParser] = {}  # streamed: one per choice

    def opening_chunks(self, index: int, first: Delta) -> list[dict]:
        """Sent for every choice with its first Delta, before its content: the role (with
        vLLM's `prompt_token_ids` when asked), then what `echo` repeats; continuous usage
        asked, each carries the prompt's usage (nothing generated yet), as in vLLM."""
        role = self._chunk(index, {"role": self.extras.role, "content": ""}, None, None)
        if self.extras.return_token_ids:  # vLLM: on the first chunk
            self._started.add(index)
            role["prompt_token_ids"] = first.prompt_token_ids
        chunks = [role]
        if self.extras.echo_of(index):
            chunks.append(self._chunk(index, {"content": self.extras.echo_of(index)}, None, None))
        if self.extras.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": 0,
                                  "total_tokens": first.num_prompt_tokens}
        return chunks

    def delta_chunk(self, index: int, delta: Delta) -> dict | None:
        logprobs = self.logprobs(delta.logprobs or []) if self.want_logprobs and delta.logprobs else None
        if self.tool_choice is not None:
            chunk = self._tool_delta_chunk(index, delta, logprobs)
        elif not delta.text and delta.finish_reason is None and logprobs is None \
                and not (self.extras.return_token_ids and delta.token_ids):
            return None  # nothing to say yet (e.g. text held back while a stop string may match)
        else:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            chunk = self._chunk(index, content, delta.finish_reason, logprobs, delta)
        if chunk is not None and self.extras.return_token_ids and index not in self._started:
            self._started.add(index)
            chunk["prompt_token_ids"] = delta.prompt_token_ids  # vLLM: on the first chunk
        return chunk

    def _is_plain_text(self) -> bool:
        return self.tool_choice is None and not self.want_logprobs

    def _text_chunk(self, index: int, text: str) -> dict:
        return self._chunk(index, {"content": text}, None, None)

    def _tool_delta_chunk(self, index: int, delta: Delta, logprobs: dict | None) -> dict | None:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._new_parser()
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
        return self._chunk(index, body, _finish_reason(parser, delta.finish_reason), logprobs, delta)

    def _new_parser(self) -> ToolCallParser:
        return ToolCallParser(self.tool_choice, self.tools, self.tool_parser)

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage(outputs, self.extras.n)}

    def response(self, outputs: list[SequenceOutput]) -> dict:
        choices = []
        for o in outputs:
            text = self.extras.echo_of(o.index) + o.text
            message: dict = {"role": self.extras.role, "content": text}
            finish_reason = o.finish_reason
            if self.tool_choice is not None:  # the same parser as streaming, fed the whole text
                parser = self._new_parser()
                content = parser.feed(text).content + parser.finish().content
                message["content"] = content or (None if parser.calls else "")
                if parser.calls:
                    message["tool_calls"] = parser.calls
                finish_reason = _finish_reason(parser, o.finish_reason)
            choices.append({"index": o.index, "message": message,
                            "logprobs": self.logprobs(o.logprobs) if self.want_logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": o.stop_reason, **self._token_ids(o)})
        prompt_token_ids = outputs[0].prompt_token_ids if self.extras.return_token_ids else None
        return {**self._envelope("chat.completion", choices), "usage": usage(outputs, self.extras.n),
                "prompt_logprobs": prompt_logprobs_json(outputs[0], self.decode_token),
                "prompt_token_ids": prompt_token_ids}

    def logprobs(self, entries: list[TokenLogprobs]) -> dict:
        """OpenAI chat form: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        return {"content": [{**self._token(e.token_id, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e in entries]}

    def _token(self, token_id: int, logprob: float) -> dict:
        token = self.decode_token(token_id)
        return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}

    def _chunk(self, index: int, delta: dict, finish_reason: str | None, logprobs: dict | None,
               source: Delta | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:  # vLLM: on the last chunk only
            choice["stop_reason"] = source.stop_reason if source is not None else None
        if self.extras.return_token_ids:
            choice["token_ids"] = source.token_ids if source is not None else []
        return self._envelope("chat.completion.chunk", [choice])


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

    def opening_chunks(self, index: int, first: Delta) -> list[dict]:
        return []

    def delta_chunk(self, index: int, delta: Delta) -> dict | None:
        """The choice's first chunk starts with the echoed prompt and (return_token_ids) names the prompt's ids.
        Echo with max_tokens 0: the generated token is not shown (vLLM)."""
        first = index not in self._started
        generated = "" if self.extras.echo_only else delta.text
        text = self.extras.echo_of(index) + generated if first else generated
        logprobs = None
        if self.want_logprobs:
            prompt = delta.prompt_logprobs if first and self.extras.echo_logprobs else None
            entries = [] if self.extras.echo_only else delta.logprobs or []
            logprobs = self._logprobs_from(index, entries, prompt, delta.prompt_token_ids)
        if not text and delta.finish_reason is None and not delta.logprobs \
                and not (self.extras.return_token_ids and delta.token_ids):
            return None
        self._started.add(index)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        if self.extras.return_token_ids:
            choice["prompt_token_ids"] = delta.prompt_token_ids if first else None
            choice["token_ids"] = delta.token_ids
        return self._envelope("text_completion", [choice])

    def _is_plain_text(self) -> bool:
        return not self.want_logprobs

    def _text_chunk(self, index: int, text: str) -> dict:
        return self._envelope("text_completion", [
            {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}])

    def usage_chunk(self, outputs: list[SequenceOutput]) -> dict:
        return {**self._envelope("text_completion", []), "usage": usage(outputs, self.extras.n)}

    def response(self, outputs: list[SequenceOutput]) -> dict:
        prompt_token_ids, echo = self.extras.return_token_ids, self.extras.echo_logprobs
        prompt_only = self.extras.echo_only  # echo with max_tokens 0: the prompt alone
        choices = [{"index": o.index, "text": self.extras.echo_of(o.index) + ("" if prompt_only else o.text),
                    "logprobs": self._logprobs_from(o.index, [] if prompt_only else o.logprobs,
                                                    o.prompt_logprobs if echo else None,
                                                    o.prompt_token_ids) if self.want_logprobs else None,
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(o, self.decode_token),
                    "prompt_token_ids": o.prompt_token_ids if prompt_token_ids else None, **self._token_ids(o)}
                   for o in outputs]
        return {**self._envelope("text_completion", choices), "usage": usage(outputs, self.extras.n)}

    def _logprobs_from(self, index: int, entries: list[TokenLogprobs], prompt: list[TokenLogprobs] | None = None,
                       prompt_token_ids: list[int] | None = None) -> dict:
        """Legacy form: tokens, token_logprobs, top_logprobs (the sampled token is always
        in its dict, so up to k + 1 entries, as OpenAI documents), text_offset. `prompt`
        (echo): the prompt's entries go first, its first token with null logprobs (vLLM)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        if prompt is not None and prompt_token_ids:
            token = self.decode_token(prompt_token_ids[0])
            tokens.append(token)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(offset)
            offset += len(token)
            entries = list(prompt) + list(entries)
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
