"""The HTTP edge: FastAPI app, OpenAI request parsing and responses, errors, API metrics.

    server.py              `build_app`: the OpenAI-compatible app, its routes and handlers
    settings.py            `ApiSettings`: what the app serves and whom
    generate_route.py      POST /v1/chat/completions and /v1/completions (`GenerateRoute`)
    protocol.py            OpenAI request bodies -> the orchestrator's types (epd/requests.py)
    chat_messages.py       chat messages checked at the edge: roles, content parts, images, videos
    tool_calls.py          `tools` / `tool_choice` as a constraint, and tool calls parsed from the output
    tool_parsers/          tool_choice "auto"'s formats by vLLM's --tool-call-parser names (hermes, pythonic, glm45, qwen3_coder)
    vllm_fields.py         every request field vLLM knows: served, or a 400 naming it
    completions_format.py  the completions endpoints' answers: chat.completion(.chunk), text_completion, SSE
    merged_streams.py      the `n` sequences of one request, merged into one stream
    responses_route.py     POST /v1/responses (the Responses API) over the chat path's route
    responses_request.py   Responses API bodies -> the chat path's request
    responses_format.py    the Responses API's answer: a `response` object or its stream events
    lora_routes.py         POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    tokenizer_routes.py    POST /tokenize and /detokenize
    errors.py              OpenAI error bodies, and the handlers that turn every refusal into one
    body_limit.py          the request body's size cap (`--max-request-body-mb`)
    fast_path.py           every place the edge leans on FastAPI's, Starlette's or uvicorn's insides
    metrics.py             request-level Prometheus metrics, named like vLLM's
    orchestrator_like.py   `OrchestratorLike`: all the edge knows of the serving layer behind it
"""
