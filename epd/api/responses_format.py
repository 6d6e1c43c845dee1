"""The Responses API's answer: one `response` object, or the events of its stream.

`ResponsesFormat` speaks the format interface of epd/api/completions_format.py's
`ChatFormat` (`opening_chunks`, `delta_event`, `response`), so the chat path's
`GenerateRoute` moves its Deltas unchanged. The stream is what the official
client's `responses.stream(...)` folds into its final response, each event
framed `event: <type>` / `data: <json>` and numbered by `sequence_number`:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added                          (with the first Delta)
    response.output_text.delta ...                       (one per Delta with text)
    response.output_text.done, response.content_part.done,
    response.output_item.done, response.completed        (with the last Delta)

Like vLLM, the stream ends with `response.completed`, whose response says
`"status": "incomplete"` (reason `max_output_tokens`) when the length ran out,
and no `data: [DONE]` follows (epd/api/responses_route.py drops it). An error
after the stream began ends it with OpenAI's `error` and `response.failed`.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from epd.api.completions_format import ChatFormat, SequenceOutput
from epd.requests import Delta, RequestError
from epd.transport.wire.sampling import TokenLogprobs

_STATUS = {"stop": "completed", "length": "incomplete"}  # any other finish ("abort"): failed


def response_usage(output: SequenceOutput) -> dict:
    details = {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": output.num_prompt_tokens, "input_tokens_details": details,
            "output_tokens": output.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": output.num_prompt_tokens + output.num_tokens}


class ResponsesFormat:
    """One request's `response` object and stream events. `echo`: the request's fields a
    response repeats (instructions, max_output_tokens, temperature, text, ...)."""

    def __init__(self, request_id: str, model: str, created: int, decode_token: Callable[[int], str],
                 want_logprobs: bool, echo: dict):
        self.request_id = request_id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self._head = {"id": request_id, "object": "response", "created_at": created, "model": model, **echo}
        self._chat = ChatFormat(request_id, model, created, decode_token, want_logprobs)  # its logprob entries
        self.want_logprobs = want_logprobs
        self._streamed = SequenceOutput(0)  # what the stream sent so far
        self._sequence_number = 0

    # -- not streamed --------------------------------------------------------------------------

    def response(self, outputs: list[SequenceOutput]) -> dict:
        return self._final(outputs[0])

    def _final(self, output: SequenceOutput) -> dict:
        status = _STATUS.get(output.finish_reason, "failed")
        aborted = {"code": "server_error", "message": "generation was aborted"}
        return self._response(output, status, aborted if status == "failed" else None)

    def _response(self, output: SequenceOutput, status: str, error: dict | None = None) -> dict:
        started = status == "in_progress"
        return {**self._head, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": [] if started else [self._message(output, "incomplete" if error else status)],
                "usage": None if started else response_usage(output)}

    def _message(self, output: SequenceOutput, status: str) -> dict:
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status,
                "content": [self._text_part(output.text, output.logprobs)]}

    def _text_part(self, text: str, logprobs: list[TokenLogprobs]) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": self._logprobs(logprobs)}

    def _logprobs(self, entries: list[TokenLogprobs]) -> list[dict]:
        return self._chat.logprobs(entries)["content"] if self.want_logprobs and entries else []

    # -- streamed ------------------------------------------------------------------------------

    def opening_chunks(self, index: int, first: Delta) -> list[dict]:
        return []  # the opening events go out with the first Delta (`delta_event`)

    def delta_event(self, index: int, delta: Delta, output: SequenceOutput | None = None) -> bytes | None:
        """`output` (the chat formats' continuous usage) is not read: the stream keeps its own."""
        events = self._opening_events()
        self._streamed.add(delta)
        if delta.text or delta.logprobs:
            events.append(self._event("response.output_text.delta", **self._where(), delta=delta.text,
                                      logprobs=self._logprobs(delta.logprobs or [])))
        if delta.finish_reason is not None:
            events += self._closing_events(self._streamed)
        return b"".join(events) or None

    def error_event(self, error: RequestError) -> bytes:
        """An error after the stream began: OpenAI's `error` event, then `response.failed`
        with what was generated so far."""
        failed = self._response(self._streamed, "failed", {"code": "server_error" if error.status >= 500
                                                           else "invalid_prompt", "message": error.message})
        return b"".join([*self._opening_events(),
                         self._event("error", code=error.code or error.type, message=error.message, param=error.param),
                         self._event("response.failed", response=failed)])

    def _opening_events(self) -> list[bytes]:
        """The four events that open the stream, once (an empty list after)."""
        if self._sequence_number:
            return []
        started = self._response(self._streamed, "in_progress")
        item = {"id": self.item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._where(), part=self._text_part("", []))]

    def _closing_events(self, output: SequenceOutput) -> list[bytes]:
        final = self._final(output)
        message = final["output"][0]
        part = message["content"][0]
        return [self._event("response.output_text.done", **self._where(), text=part["text"],
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", **self._where(), part=part),
                self._event("response.output_item.done", output_index=0, item=message),
                # a request the engine aborted ends as OpenAI ends a failed response
                self._event("response.failed" if final["status"] == "failed" else "response.completed",
                            response=final)]

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()
