"""The front of vLLM's own encoder disaggregation (1E + 1PD) for `python -m bench.dev.vs_vllm --vllm-ec`.

vLLM splits the encoder off with two `vllm serve` instances of one checkpoint,
both given `--ec-transfer-config` with `ECExampleConnector`: the encoder
instance (`ec_producer`) writes each image's embedding under
`shared_storage_path`, keyed by its `mm_hash`, and the prefill-decode
instance (`ec_consumer`) loads it from there instead of running its vision
tower. Something in front must send each request with images to the encoder
instance first and to the PD instance after; vLLM ships an example proxy for
that (examples/online_serving/disaggregated_encoder). This is ours, with
one encoder and one PD instance:

  POST /v1/chat/completions
    1. images in it: the same body to the encoder instance with one output
       token, unstreamed (`max_tokens` 1, no `min_tokens`, no stream options),
       and waited for: that request runs the encoder, and the producer saves
       the embeddings; an error there is the client's answer (its status and
       body), and the PD instance never sees the request;
    2. the body as the client sent it to the PD instance, whose answer (a
       stream or one JSON body, any status) is passed back as it comes.
    No images: step 2 only.
  GET /v1/models   the PD instance's.
  GET /health      200 once both instances answer 200 on theirs, else 503.

The client's TTFT therefore includes the encoder's round trip, as the user of
such a deployment would see it. Run it as
`python -m bench.dev.vllm_ec_proxy --encoder-url URL --pd-url URL --port N`.
"""
from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MEDIA_TYPES = ("image_url", "video_url", "input_audio", "audio_url")


def has_media(body: dict) -> bool:
    """Whether any chat message carries an image, a video or audio (what the encoder instance encodes)."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in MEDIA_TYPES
                                             for part in content):
            return True
    return False


def encoder_body(body: dict) -> dict:
    """`body` as the encoder instance gets it: one output token, no stream. `min_tokens` goes
    (a bench's exact-length request sets it to the output length, above a max of 1: a 400)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def make_app(encoder_url: str, pd_url: str, timeout_s: float = 3600.0) -> FastAPI:
    """The proxy's routes in front of one encoder instance and one PD instance (root URLs, no /v1)."""
    # no pool limit: every request the client has in flight goes on at once, as it would without the proxy
    http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await http.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        raw = await request.body()
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        forwarded = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        if has_media(body):
            try:
                encoded = await http.post(f"{encoder_url}/v1/chat/completions", json=encoder_body(body),
                                          headers=forwarded)
            except httpx.HTTPError as exc:
                return _error(502, f"encoder instance: {exc!r}")
            if encoded.status_code != 200:
                return Response(encoded.content, status_code=encoded.status_code,
                                media_type=encoded.headers.get("content-type"))
        try:
            upstream = await http.send(http.build_request("POST", f"{pd_url}/v1/chat/completions", content=raw,
                                                          headers={**forwarded, "content-type": "application/json"}),
                                       stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill-decode instance: {exc!r}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    @app.get("/v1/models")
    async def models() -> Response:
        r = await http.get(f"{pd_url}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        states = {}
        for name, url in (("encoder", encoder_url), ("pd", pd_url)):
            try:
                states[name] = (await http.get(f"{url}/health", timeout=5.0)).status_code
            except httpx.HTTPError as exc:
                states[name] = repr(exc)
        ok = all(s == 200 for s in states.values())
        return JSONResponse(states, status_code=200 if ok else 503)

    return app


def _error(status: int, message: str) -> JSONResponse:
    """An OpenAI error body."""
    return JSONResponse({"error": {"message": message, "type": "proxy_error", "code": status}}, status_code=status)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dev.vllm_ec_proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder-url", required=True, help="the ec_producer instance's root URL")
    p.add_argument("--pd-url", required=True, help="the ec_consumer (prefill-decode) instance's root URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(make_app(args.encoder_url.rstrip("/"), args.pd_url.rstrip("/")), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
