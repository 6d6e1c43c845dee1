"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize.

    /tokenize    {"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?}
                 {"model"?, "messages", "add_generation_prompt"?: true, "tools"?, "mm_processor_kwargs"?,
                  "return_token_strs"?}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"model"?, "tokens"} -> {"prompt"}

A chat's tokens are the orchestrator's own (`OrchestratorLike.tokenize`: the
same preparer that builds a chat's prompt), so an image or a video (sampled as
the request's `mm_processor_kwargs` say) costs here exactly the placeholder
tokens it costs in `usage.prompt_tokens`. Bodies are bounded as the
generation endpoints' are (`generate_route.check_json_items`); every refusal is
a 400 (413 for a body past the bound) with an OpenAI error body.
"""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from epd.api.chat_messages import validate_messages
from epd.api.generate_route import max_json_items, read_json_object
from epd.api.orchestrator_like import OrchestratorLike
from epd.api.protocol import (INT64_MAX, check_chat_template_kwargs, check_continue_final_message,
                              check_mm_processor_kwargs, validate_body)
from epd.api.settings import ApiSettings
from epd.api.tool_calls import ToolError, validate_tools
from epd.requests import GenerateRequest, RequestError
from epd.transport.wire.sampling import SamplingParams

TOKENIZE_PATH, DETOKENIZE_PATH = "/tokenize", "/detokenize"
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # below the vocabulary size: checked in the route


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # vLLM's default for a text prompt
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # a video's sampling, as the chat request's
    # vLLM's, which EPD's chat endpoint does not take either: refused when set (`UNSUPPORTED_CHAT_FIELDS`)
    add_special_tokens: bool = False
    chat_template: str | None = None


UNSUPPORTED_CHAT_FIELDS = ("add_special_tokens", "chat_template")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


def add_tokenizer_routes(app: FastAPI, orchestrator: OrchestratorLike, settings: ApiSettings) -> None:
    max_items = max_json_items(orchestrator.max_model_len)

    @app.post(TOKENIZE_PATH)
    async def tokenize(request: Request) -> dict:
        body = await read_json_object(request, max_items)
        if "messages" in body:
            chat = validate_body(TokenizeChatRequest, body)
            _check_model(chat.model, settings)
            generate = _chat_request(chat, settings)
            token_ids = await orchestrator.tokenize(generate)
            return_token_strs = chat.return_token_strs
        else:
            text = validate_body(TokenizeCompletionRequest, body)
            _check_model(text.model, settings)
            generate = GenerateRequest(request_id="tokenize", messages=None, prompt=text.prompt,
                                       sampling=SamplingParams())
            # an empty prompt is no tokens here (generation refuses it)
            token_ids = await orchestrator.tokenize(generate, text.add_special_tokens) if text.prompt else []
            return_token_strs = text.return_token_strs
        return {"count": len(token_ids), "max_model_len": orchestrator.max_model_len, "tokens": token_ids,
                "token_strs": orchestrator.token_strs(token_ids) if return_token_strs else None}

    @app.post(DETOKENIZE_PATH)
    async def detokenize(request: Request) -> dict:
        body = validate_body(DetokenizeRequest, await read_json_object(request, max_items))
        _check_model(body.model, settings)
        bad = next((t for t in body.tokens if t >= orchestrator.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: token id {bad} is outside the vocabulary [0, {orchestrator.vocab_size})",
                               param="tokens")
        return {"prompt": orchestrator.detokenize(body.tokens)}


def _chat_request(chat: TokenizeChatRequest, settings: ApiSettings) -> GenerateRequest:
    """The GenerateRequest a chat completion of these messages would make (sampling aside)."""
    defaults = TokenizeChatRequest.model_fields
    for name in UNSUPPORTED_CHAT_FIELDS:
        if getattr(chat, name) != defaults[name].default:
            raise RequestError(f"{name} is not supported: EPD tokenizes a chat as its chat endpoint renders it",
                               param=name)
    try:
        tools = validate_tools(chat.tools or [])
    except ToolError as exc:
        raise RequestError(str(exc), param=exc.param) from None
    messages = validate_messages(chat.messages, settings.max_images_per_prompt, settings.max_videos_per_prompt,
                                 settings.max_audios_per_prompt)
    check_continue_final_message(chat.continue_final_message, chat.add_generation_prompt)
    check_chat_template_kwargs(chat.chat_template_kwargs)
    check_mm_processor_kwargs(chat.mm_processor_kwargs)
    return GenerateRequest(request_id="tokenize", messages=messages, prompt=None, sampling=SamplingParams(),
                           add_generation_prompt=chat.add_generation_prompt, tools=tools or None,
                           continue_final_message=chat.continue_final_message,
                           chat_template_kwargs=chat.chat_template_kwargs or None,
                           mm_processor_kwargs=chat.mm_processor_kwargs or None)


def _check_model(model: str | None, settings: ApiSettings) -> None:
    if model is not None:  # optional here, as in vLLM; an adapter's name too (the same tokenizer)
        settings.adapter(model)
