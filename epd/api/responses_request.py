"""POST /v1/responses bodies (OpenAI's Responses API, stateless) -> the chat path's request.

A Responses request is a chat request in other words: `instructions` is a
system message, `input` (a string, or message items whose content parts are
`input_text` / `input_image` / an earlier answer's `output_text`) the
messages, `max_output_tokens` the max_completion_tokens and `text.format` the
response_format. `ResponsesRequest.to_chat_request` says so, and from there the
chat path's own validation, media handling and grammar engine serve it.

Stateless, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE: `store` is
accepted and nothing is stored (vLLM's choice: `store` defaults to true in
OpenAI's API, so most clients send it without meaning it); what needs a
store (`background`, `previous_response_id`, `conversation`) is refused, as
are tools and prompt templates (docs/decisions/responses-api.md).
"""
from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from epd.api.protocol import MAX_TOP_LOGPROBS, ChatCompletionRequest, RequestError, WireInt, WireInt1

logger = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the `include` entry that asks for logprobs
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(BaseModel):
    """The fields OpenAI's Responses API and vLLM's serving of it know; unknown ones are ignored, as on chat."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Annotated[str, Field(min_length=1)] | None = None  # vLLM: optional
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: WireInt1 | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: WireInt | None = None  # vLLM extra
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    include: list[str] | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True  # vLLM extra
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool | None = False
    store: bool | None = True  # accepted; nothing is stored (see the module docstring)
    background: bool | None = False
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None

    include_usage: ClassVar[bool] = False  # what the chat path's streaming asks; a Responses stream always ends with usage

    @property
    def want_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_chat_request(self, served_model_name: str) -> ChatCompletionRequest:
        """The chat request that generates this response, or a RequestError naming the field."""
        self._refuse_state_and_tools()
        messages = input_messages(self.input)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        return ChatCompletionRequest(
            model=self.model or served_model_name, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, logit_bias=self.logit_bias,
            logprobs=self.want_logprobs, top_logprobs=self.top_logprobs if self.want_logprobs else None,
            skip_special_tokens=self.skip_special_tokens, response_format=self._response_format(),
            stream=self.stream, user=self.user)

    def _refuse_state_and_tools(self) -> None:
        if self.background:
            raise RequestError("background: this server stores no responses (stateless), so it has no "
                               "background mode", param="background")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name}: this server stores no responses (stateless); send the earlier "
                                   "turns in `input` instead", param=name)
        if self.prompt is not None:
            raise RequestError("prompt: prompt templates are not supported", param="prompt")
        if self.tools:
            raise RequestError("tools: tools are not supported on /v1/responses; use /v1/chat/completions",
                               param="tools")
        if self.tool_choice not in ("auto", "none", None):
            raise RequestError("tool_choice: no tools are declared", param="tool_choice")

    def _response_format(self) -> dict | None:
        """text.format -> chat's response_format (the same grammar path)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind == "json_schema":
            if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema", {}), dict):
                raise RequestError("text.format: a json_schema format needs a name and a schema object",
                                   param="text.format")
            return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt.get("schema")}}
        raise RequestError(f"text.format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                           param="text.format.type")


def renamed(error: RequestError, has_instructions: bool) -> RequestError:
    """A refusal of the chat request (or of its prompt, by the orchestrator), named by the
    Responses field it came from: messages[i] is input[i], or input[i - 1] after instructions."""
    param = error.param or ""
    new = param
    for chat_name, name in (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                            ("max_completion_tokens", "max_output_tokens")):
        if param.startswith(chat_name):
            new = name + param[len(chat_name):]
            break
    else:
        if param.startswith("messages"):
            new = re.sub(r"^messages\[(\d+)\]", lambda m: _input_item(int(m[1]), has_instructions), param)
            new = re.sub(r"^messages", "input", new)
    if new == param:
        return error
    return RequestError(error.message.replace(param, new, 1), status=error.status, param=new, code=error.code,
                        type=error.type, retry_after_s=error.retry_after_s)


def _input_item(index: int, has_instructions: bool) -> str:
    index -= has_instructions
    return "instructions" if index < 0 else f"input[{index}]"


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """`input` -> chat messages (validated once more by the chat path)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    return [_message(item, f"input[{i}]") for i, item in enumerate(items)]


def _message(item: Any, where: str) -> dict:
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind != "message":
        raise RequestError(f"{where}.type: {kind!r} items are not supported; expected 'message'",
                           param=f"{where}.type")
    role = item.get("role")
    if role not in _ROLES:
        raise RequestError(f"{where}.role: unsupported role {role!r}; expected one of {', '.join(_ROLES)}",
                           param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: must be a string or a list of content parts", param=f"{where}.content")
    return {"role": role, "content": [_part(part, role, f"{where}.content[{j}]") for j, part in enumerate(content)]}


def _part(part: Any, role: str, where: str) -> dict:
    """input_text / output_text / refusal -> a text part; input_image -> an image_url part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "refusal"):
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise RequestError(f"{where}.text: must be a string", param=f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "input_image":
        url = part.get("image_url")
        if part.get("file_id") is not None:
            raise RequestError(f"{where}.file_id: files are not supported; send image_url (a URL or data URL)",
                               param=f"{where}.file_id")
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}.image_url: must be a non-empty string", param=f"{where}.image_url")
        if role != "user":
            raise RequestError(f"{where}.type: images are only allowed in user messages", param=f"{where}.type")
        return {"type": "image_url", "image_url": {"url": url}}
    raise RequestError(f"{where}.type: unsupported content part type {kind!r}; expected 'input_text' or "
                       "'input_image'", param=f"{where}.type")
