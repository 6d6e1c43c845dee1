"""OpenAI request bodies -> the types the orchestrator speaks (epd/requests.py).

Validation happens here, at the edge: every refusal is a `RequestError`
(an HTTP 4xx with an OpenAI error body) naming the offending field in
`param`. Pydantic checks the shape and the documented ranges; the
`to_generate_request` methods check what spans fields (`top_logprobs` needs
`logprobs`, `stream_options` needs `stream`, ...) and build `SamplingParams`.

The orchestrator receives one `GenerateRequest` per sequence (the API fans
`n > 1` out, see `fan_out`) and yields `Delta`s.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from epd.api.chat_messages import CHAT_ROLES, validate_messages  # noqa: F401 (re-exported)
from epd.api.tool_calls import (ToolError, parse_tool_choice, tool_choice_schema,
                                validate_tools)
from epd.api.vllm_fields import REFUSED_CHAT, REFUSED_COMPLETION, check_extra_fields
from epd.transport.media.video_geometry import VideoOptions
from epd.engine.structured_output import check_constraint
from epd.inputs.sampling_defaults import SamplingDefaults
from epd.requests import Delta, GenerateRequest, RequestError  # noqa: F401 (re-exported for the edge)
from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one /v1/completions batch (vLLM's cap is VLLM_MAX_COMPLETION_PROMPTS)
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0
NEUTRAL = SamplingDefaults()  # vLLM's --generation-config vllm: temperature 1, top_p 1, top_k off, ...

def check_token_ids(request: GenerateRequest, vocab_size: int) -> None:
    """Token ids the client names must exist in the model: a stop token id past
    the vocabulary would otherwise reach the sampler (and fail there)."""
    for name, ids in (("stop_token_ids", request.sampling.stop_token_ids),
                      ("logit_bias", request.sampling.logit_bias or ()),
                      ("allowed_token_ids", request.sampling.allowed_token_ids or ()),
                      ("prompt", request.prompt if isinstance(request.prompt, list) else ())):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{name}: token id {bad} is out of vocabulary (vocabulary size: {vocab_size})",
                               param=name)


def check_max_logprobs(request: GenerateRequest, max_logprobs: int, param: str, k: int | None = None) -> None:
    """--max-logprobs (vLLM's cap, -1: none): a request asking more is a 400 naming `param`
    (`k`: the count asked there; the per-token logprobs by default)."""
    k = request.sampling.logprobs if k is None else k
    if k is not None and 0 <= max_logprobs < k:
        raise RequestError(f"{param}: {k} logprobs asked, more than this server's --max-logprobs {max_logprobs}",
                           param=param)


def check_max_tokens(asked: int | None, param: str, max_model_len: int) -> None:
    """vLLM's rule: asking more tokens than the model's whole context is a 400 naming the
    field; a smaller ask that does not fit beside the prompt is cut to the room (serve/preparer.py)."""
    if asked is not None and asked > max_model_len:
        raise RequestError(f"{param}={asked} cannot be greater than max_model_len={max_model_len}. "
                           "Please request fewer output tokens.", param=param)


def fan_out(request: GenerateRequest) -> list[GenerateRequest]:
    """`n` single-sequence requests with distinct ids; a seeded request gives
    sample i the seed `seed + i` (distinct but reproducible)."""
    n = request.sampling.n
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        seed = None if request.sampling.seed is None else request.sampling.seed + i
        out.append(replace(request, request_id=f"{request.request_id}-{i}",
                           sampling=replace(request.sampling, n=1, seed=seed)))
    return out


def check_model(requested: str, served_model_name: str) -> None:
    if requested != served_model_name:
        raise RequestError(f"The model `{requested}` does not exist.", status=404, param="model",
                           code="model_not_found")


# -- pydantic errors -> RequestError ------------------------------------------------------

def format_loc(loc: Sequence[str | int]) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"; pydantic's union-member
    tags ("str", "list[int]") are dropped: they name our types, not the client's fields."""
    out = ""
    for part in loc:
        if (part == "body" and not out) or _is_schema_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_schema_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part)


def request_error_from_validation(errors: Sequence[dict]) -> RequestError:
    """The first error of a pydantic / FastAPI validation failure, as a 400."""
    if not errors:
        return RequestError("invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return RequestError(f"Invalid JSON body: {reason}", code="invalid_json")
    param = format_loc(err.get("loc", ())) or None
    if param is None and err.get("type") in ("model_attributes_type", "model_type", "dict_type"):
        return RequestError("The request body must be a JSON object (with Content-Type: application/json)")
    if param is not None and err.get("type") == "missing":
        return RequestError(f"{param}: field required", param=param)
    # a union reports one error per member: say what each member wanted
    messages = list(dict.fromkeys(_error_text(e) for e in errors if (format_loc(e.get("loc", ())) or None) == param))
    message = " or ".join(messages)
    return RequestError(f"{param}: {message}" if param else message, param=param)


def _error_text(error: dict) -> str:
    """pydantic's message and, as vLLM's errors show it, its type: "... [type=less_than_equal]"."""
    kind = error.get("type")
    return f"{error.get('msg', 'invalid value')} [type={kind}]" if kind else error.get("msg", "invalid value")


def validate_body(model: type[BaseModel], body: Any):
    """A decoded JSON body as `model`, or the RequestError of its first problem."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise request_error_from_validation(exc.errors()) from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """A decoded JSON body -> ChatCompletionRequest, or RequestError (what FastAPI
    does for the route, usable without it)."""
    return validate_body(ChatCompletionRequest, body)


def parse_completion_request(body: Any) -> CompletionRequest:
    return validate_body(CompletionRequest, body)


# -- request bodies ----------------------------------------------------------------------------

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# Integers cross the wire as msgpack int64: anything larger is refused here, not by the encoder.
WireInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
WireInt1 = Annotated[int, Field(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # below the vocabulary size: `check_token_ids`


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk (with include_usage)


class _GenerationRequest(BaseModel):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extras."""

    # fields not declared here land in `model_extra`: vLLM's are refused unless at their
    # default, the others logged once (epd/api/vllm_fields.py); NaN and infinities
    # (which Python's JSON parser accepts) are refused in every float field
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    _refused: ClassVar[dict] = {}

    model: Annotated[str, Field(min_length=1)]
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: WireInt1 | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # vLLM extra sampling parameters
    top_k: WireInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: one of json, regex, choice, grammar, json_object
    response_format: dict[str, Any] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None  # -1: the model's limit
    truncation_side: Literal["left", "right"] | None = None  # left (the default): keep the last tokens
    return_token_ids: bool | None = None  # prompt_token_ids and token_ids in the answer
    stream_interval: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None  # raises --stream-interval
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM's, not streamed
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:<id>"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage in every chunk (needs include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        check_extra_fields(self.model_extra, self._refused)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise RequestError("stream_options can only be set when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's rule (0 streams, and returns nothing)
            raise RequestError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def _request(self, request_id: str, sampling: SamplingParams, **fields) -> GenerateRequest:
        """A GenerateRequest with the fields both endpoints carry the same way."""
        return GenerateRequest(request_id=request_id, sampling=sampling,
                               truncate_prompt_tokens=self.truncate_prompt_tokens,
                               truncation_side=self.truncation_side or "left", **fields)

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's {"token id": bias}; ids are checked against the vocabulary in `check_token_ids`."""
        if not self.logit_bias:
            return None
        not_ids = [key for key in self.logit_bias if _as_int(key) is None]
        if not_ids:  # all of them named, as vLLM does
            raise RequestError(f"logit_bias: keys must be token ids, got {', '.join(map(repr, not_ids))}",
                               param="logit_bias")
        out = {}
        for key, bias in self.logit_bias.items():
            token_id = int(key)
            if not 0 <= token_id <= INT64_MAX or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias: token {key} -> {bias}: ids must be non-negative and "
                                   "biases in [-100, 100]", param="logit_bias")
            out[token_id] = bias
        return out

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        if self.structured_outputs is None:
            return None
        so = self.structured_outputs
        known = ("json", "regex", "choice", "grammar", "json_object")
        unknown = sorted(k for k in so if k not in known and so[k] is not None)
        if unknown:
            raise RequestError(f"structured_outputs: unknown fields {unknown}; expected one of {', '.join(known)}",
                               param="structured_outputs")
        return constraint(lambda: StructuredOutputsParams(**{k: so.get(k) for k in known}), "structured_outputs")

    def _response_format(self) -> StructuredOutputsParams | None:
        """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}."""
        rf = self.response_format
        kind = None if rf is None else rf.get("type")
        if rf is None or kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise RequestError("response_format.json_schema: must be an object with a name and a schema",
                                   param="response_format.json_schema")
            schema = spec.get("schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema: must be a JSON schema object",
                                   param="response_format.json_schema.schema")
            return constraint(lambda: StructuredOutputsParams(json=schema), "response_format.json_schema.schema")
        raise RequestError(f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                           param="response_format.type")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         structured_outputs: StructuredOutputsParams | None = None,
                         defaults: SamplingDefaults = NEUTRAL, prompt_logprobs: int | None = None) -> SamplingParams:
        """`defaults`: the values of the fields the request leaves out (--generation-config);
        max_tokens stays as asked: its default and cap need the prompt's length (serve/preparer.py)."""
        stop = normalize_stop(self.stop)
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                               param="min_tokens")
        try:
            return SamplingParams(
                n=self.n or 1,
                temperature=defaults.temperature if self.temperature is None else self.temperature,
                top_p=defaults.top_p if self.top_p is None else self.top_p,
                top_k=defaults.top_k if self.top_k is None else self.top_k,
                min_p=defaults.min_p if self.min_p is None else self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=defaults.repetition_penalty if self.repetition_penalty is None
                else self.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words or [],
                structured_outputs=structured_outputs or self._structured_outputs(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                stream_interval=self.stream_interval or 1,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            )
        except ValueError as exc:  # SamplingParams names the field first: "top_k must be ..."
            message = str(exc)
            raise RequestError(message, param=message.split(" ", 1)[0]) from None


class ChatCompletionRequest(_GenerationRequest):
    _refused: ClassVar[dict] = REFUSED_CHAT
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_completion_tokens: WireInt1 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM extra
    continue_final_message: bool = False  # vLLM: the last message left open (with add_generation_prompt false)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: more variables for the chat template
    echo: bool = False  # vLLM: the answer starts with the last message's content when it has the answer's role
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM: the video processor's settings for this request

    @property
    def response_role(self) -> str:
        """vLLM's: "assistant" after a generation prompt, otherwise the last message's role."""
        role = self.messages[-1].get("role")
        return "assistant" if self.add_generation_prompt or not isinstance(role, str) else role

    def echo_text(self) -> str:
        """What `echo` puts before the answer: the last message's text when its role is the answer's."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != self.response_role:
            return ""
        content = last.get("content")
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return content if isinstance(content, str) else ""

    def to_generate_request(self, request_id: str, *, max_images_per_prompt: int | None = None,
                            max_videos_per_prompt: int | None = None, max_audios_per_prompt: int = 0,
                            defaults: SamplingDefaults = NEUTRAL) -> GenerateRequest:
        """Raises RequestError for what the schema alone cannot catch. `defaults`:
        the sampling values of the fields the request leaves out."""
        self._check_common()
        if self.tools == []:
            raise RequestError("tools must not be an empty array: give at least one tool or leave the field out",
                               param="tools")
        try:
            tools = validate_tools(self.tools or [])
            tool_choice = parse_tool_choice(self.tool_choice, tools)
        except ToolError as exc:
            raise RequestError(str(exc), param=exc.param) from None
        constraints = [c for c in (self._response_format(), self._structured_outputs()) if c is not None]
        schema = tool_choice_schema(tool_choice, tools)
        if schema is not None:
            constraints.append(constraint(lambda: StructuredOutputsParams(json=schema), "tools"))
        if len(constraints) > 1:
            raise RequestError("at most one of response_format (json), structured_outputs and a required or "
                               "named tool_choice may constrain the output", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        messages = validate_messages(self.messages, max_images_per_prompt, max_videos_per_prompt, max_audios_per_prompt)
        check_mm_processor_kwargs(self.mm_processor_kwargs)
        check_continue_final_message(self.continue_final_message, self.add_generation_prompt)
        check_chat_template_kwargs(self.chat_template_kwargs)
        # max_completion_tokens replaces the deprecated max_tokens; None: up to the model length
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = (self.top_logprobs or 0) if self.echo and self.prompt_logprobs is None else None
        return self._request(request_id, self._sampling_params(max_tokens, logprobs, next(iter(constraints), None),
                                                               defaults, prompt_logprobs),
                             messages=messages, prompt=None, add_generation_prompt=self.add_generation_prompt,
                             tools=tools or None, tool_choice=tool_choice,
                             continue_final_message=self.continue_final_message,
                             chat_template_kwargs=self.chat_template_kwargs or None,
                             mm_processor_kwargs=self.mm_processor_kwargs or None)

class CompletionRequest(_GenerationRequest):
    _refused: ClassVar[dict] = REFUSED_COMPLETION
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = 16  # OpenAI's and vLLM's default here
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = False  # the prompt's text before each answer
    add_special_tokens: bool = True  # vLLM's default for a text prompt (BOS where the tokenizer has one)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value: Any) -> Any:
        return 16 if value is None else value  # vLLM: null is the default, not "as many as fit"

    @property
    def echo_only(self) -> bool:
        """vLLM's echo with max_tokens 0: the prompt alone is the answer (one token is generated, unseen)."""
        return bool(self.echo) and self.max_tokens == 0

    def to_generate_requests(self, request_id: str, *, defaults: SamplingDefaults = NEUTRAL) -> list[GenerateRequest]:
        """One GenerateRequest per prompt of the batch (`request_id`, or `request_id-p<i>` for a batch)."""
        self._check_common()
        constraint_ = self._response_format()
        if constraint_ is not None and self.structured_outputs is not None:
            raise RequestError("at most one of response_format (json) and structured_outputs may constrain the "
                               "output", param="response_format")
        # vLLM: echo with logprobs scores the prompt with the same k
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1, got 0 (with echo, 0 answers the prompt alone)",
                               param="max_tokens")
        max_tokens = 1 if self.echo_only else self.max_tokens
        sampling = self._sampling_params(max_tokens, self.logprobs, constraint_, defaults, prompt_logprobs)
        prompts = normalize_prompts(self.prompt)
        return [self._request(request_id if len(prompts) == 1 else f"{request_id}-p{i}", sampling, messages=None,
                              prompt=prompt, add_special_tokens=self.add_special_tokens)
                for i, prompt in enumerate(prompts)]

    def to_generate_request(self, request_id: str, *, defaults: SamplingDefaults = NEUTRAL) -> GenerateRequest:
        """The GenerateRequest of a one-prompt request."""
        [request] = self.to_generate_requests(request_id, defaults=defaults)
        return request


# The template arguments EPD sets itself: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "return_dict",
                                    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def check_chat_template_kwargs(kwargs: dict | None) -> None:
    """vLLM's chat_template_kwargs: variables the chat template reads (e.g. Qwen3's
    `enable_thinking`); one that names what EPD sets from the request's own fields is a 400."""
    clash = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs or {}))
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}: use the request's own fields",
                           param="chat_template_kwargs")


def check_mm_processor_kwargs(kwargs: dict | None) -> None:
    """vLLM's per-request mm_processor_kwargs, as the Qwen video processor takes them (fps,
    num_frames, do_sample_frames, min/max_pixels, min/max_frames): a key it cannot apply or
    a bad value is a 400 naming the field. They apply to the request's videos."""
    try:
        VideoOptions.from_kwargs(kwargs)
    except ValueError as exc:
        raise RequestError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs") from None


def check_continue_final_message(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:  # vLLM's rule
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")


def constraint(build, param: str) -> StructuredOutputsParams:
    """A StructuredOutputsParams the grammar engine can compile, or a 400 naming `param`."""
    try:
        so = build()
        check_constraint(so)
    except ValueError as exc:
        raise RequestError(f"{param}: {exc}", param=param) from None
    return so


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


# -- field normalisation -----------------------------------------------------------------------

def normalize_stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}",
                           param="stop")
    if any(s == "" for s in stops):
        raise RequestError("stop sequences must be non-empty", param="stop")
    return stops


def normalize_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a request: one text or list of token ids, or a batch of them."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if len(batch) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request are allowed, got {len(batch)}", param="prompt")
    for one in batch:
        if len(one) == 0:
            raise RequestError("prompt must not be empty", param="prompt")
        if isinstance(one, list) and any(t < 0 for t in one):
            raise RequestError("prompt token ids must be non-negative", param="prompt")
    return batch
