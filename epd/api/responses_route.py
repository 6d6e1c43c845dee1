"""POST /v1/responses: the chat path's `GenerateRoute`, fed a Responses request.

`ResponsesRoute` turns the body into the chat request it means
(epd/api/responses_request.py) and answers with `ResponsesFormat`
(epd/api/responses_format.py); everything between (validation of messages
and images, structured output, the orchestrator's streams, disconnects,
metrics) is the chat path's. The route is declared on FastAPI
(`add_responses_route`); its body is bounded like the generation endpoints'
(`generate_route.read_json_object`: JSON items counted before parsing), then
validated as a `ResponsesRequest`.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from epd.api.completions_format import SSE_DONE
from epd.api.generate_route import (GenerateRoute, ServedResponse, internal_request_id, max_json_items,
                                    read_json_object)
from epd.api.protocol import GenerateRequest, RequestError, validate_body
from epd.api.responses_format import ResponsesFormat
from epd.api.responses_request import ResponsesRequest, renamed

RESPONSES_PATH = "/v1/responses"


def add_responses_route(app: FastAPI, route: GenerateRoute) -> None:
    """POST /v1/responses on `app`, served by a ResponsesRoute sharing `route`'s orchestrator and metrics."""
    responses = ResponsesRoute(route.orchestrator, route.settings, route.metrics)

    max_items = max_json_items(route.orchestrator.max_model_len)

    @app.post(RESPONSES_PATH)
    async def create_response(request: Request) -> Response:
        body = validate_body(ResponsesRequest, await read_json_object(request, max_items))
        return ServedResponse(responses, body)


class ResponsesRoute(GenerateRoute):
    async def serve(self, body: ResponsesRequest, scope, receive, send) -> None:
        await super().serve(body, scope, receive, _without_done(send) if body.stream else send)

    async def _serve(self, body: ResponsesRequest, scope, receive, send, guard) -> None:
        try:
            await super()._serve(body, scope, receive, send, guard)
        except RequestError as exc:  # before the answer started: named by the Responses fields
            raise renamed(exc, body.instructions is not None) from None

    def _prepare(self, body: ResponsesRequest, scope) -> tuple[list[GenerateRequest], ResponsesFormat]:
        request_id = internal_request_id(scope, "resp").replace("-", "_", 1)  # OpenAI's "resp_..." ids
        chat = body.to_chat_request(self.settings.served_model_name)
        lora = self.settings.adapter(chat.model)  # unknown: 404
        model = chat.model if lora else self.settings.served_model_name
        request = chat.to_generate_request(request_id, max_images_per_prompt=self.settings.max_images_per_prompt,
                                           max_videos_per_prompt=self.settings.max_videos_per_prompt,
                                           defaults=self.settings.sampling_defaults)
        request.lora = lora
        self._checked(request, "top_logprobs")
        return [request], ResponsesFormat(request_id, model, int(time.time()), self.orchestrator.decode_token,
                                          body.want_logprobs, _echo(body, request))


def _echo(body: ResponsesRequest, request: GenerateRequest) -> dict:
    """What a response repeats of its request (the sampling values in force, as vLLM reports them)."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
            "top_logprobs": body.top_logprobs, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": [], "parallel_tool_calls": bool(body.parallel_tool_calls),
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "previous_response_id": None,
            "reasoning": body.reasoning, "service_tier": body.service_tier, "background": False,
            "truncation": body.truncation, "user": body.user}


def _without_done(send):
    """The chat path ends a stream with `data: [DONE]`; a Responses stream ends with its
    response.completed event (as OpenAI's and vLLM's), so the marker is cut off the last write."""

    async def send_events(message) -> None:
        body = message.get("body", b"")
        if message["type"] == "http.response.body" and body.endswith(SSE_DONE):
            message = {**message, "body": body[:-len(SSE_DONE)]}
        await send(message)

    return send_events
