"""A client light enough not to be the bottleneck when measuring the server itself.

Each stream is one keep-alive HTTP/1.1 connection (asyncio streams, no HTTP
library) that sends its requests one after another: a closed loop, C streams
= C requests in flight. A response is read as raw chunked bytes and parsed
once, at its end: the status, the final usage chunk (`completion_tokens`)
and `[DONE]`; nothing is done per event. `run_streams` can be spread over
several processes (`run_in_processes`); each reports its own CPU time, so a
benchmark can show the client is far from a full core.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


@dataclass
class StreamsResult:
    num_requests: int = 0
    num_failed: int = 0
    num_output_tokens: int = 0
    start_s: float = 0.0  # time.monotonic(): comparable across processes on one host
    end_s: float = 0.0
    cpu_s: float = 0.0  # this client process's CPU time over the run
    first_error: str = ""


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response, chunked or with Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            data = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return status, b"".join(parts)
            parts.append(data[:-2])
    length = int(re.search(rb"content-length: *(\d+)", headers).group(1))
    return status, await reader.readexactly(length)


def output_tokens(status: int, body: bytes) -> int:
    """The completion_tokens of a streamed answer with usage; raises ValueError naming what is wrong."""
    if status != 200:
        raise ValueError(f"HTTP {status}: {body[:300]!r}")
    if not body.rstrip().endswith(b"data: [DONE]"):
        raise ValueError(f"stream ended without [DONE]: {body[-300:]!r}")
    if b'"error"' in body:
        raise ValueError(f"error in stream: {body[-300:]!r}")
    found = _USAGE.findall(body)
    if not found:
        raise ValueError("no usage chunk (send stream_options.include_usage)")
    return int(found[-1])


async def _stream(host: str, port: int, path: str, bodies: list[bytes], result: StreamsResult,
                  api_key: str | None) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"\r\nAuthorization: Bearer {api_key}".encode() if api_key else b""
    try:
        for body in bodies:
            writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + auth
                         + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            status, response = await _read_response(reader)
            result.num_requests += 1
            try:
                result.num_output_tokens += output_tokens(status, response)
            except ValueError as exc:
                result.num_failed += 1
                result.first_error = result.first_error or str(exc)
    finally:
        writer.close()


async def _run(host: str, port: int, path: str, streams: list[list[bytes]], start_at_s: float,
               api_key: str | None) -> StreamsResult:
    result = StreamsResult()
    await asyncio.sleep(max(0.0, start_at_s - time.monotonic()))
    cpu_start = time.process_time()
    result.start_s = time.monotonic()
    await asyncio.gather(*(_stream(host, port, path, bodies, result, api_key) for bodies in streams))
    result.end_s = time.monotonic()
    result.cpu_s = time.process_time() - cpu_start
    return result


def run_streams(host: str, port: int, path: str, streams: list[list[bytes]], start_at_s: float = 0.0,
                api_key: str | None = None) -> StreamsResult:
    """Every stream's bodies POSTed in turn on its own connection, all streams at
    once, from `start_at_s` (time.monotonic()) on."""
    return asyncio.run(_run(host, port, path, streams, start_at_s, api_key))


def run_in_processes(host: str, port: int, path: str, streams: list[list[bytes]],
                     num_processes: int) -> list[StreamsResult]:
    """`run_streams`, the streams dealt over `num_processes` client processes."""
    if num_processes <= 1:
        return [run_streams(host, port, path, streams)]
    shares = [streams[i::num_processes] for i in range(num_processes)]
    with ProcessPoolExecutor(num_processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(abs, range(num_processes)))  # every process started and imported
        start_at_s = time.monotonic() + 0.5  # all begin together
        futures = [pool.submit(run_streams, host, port, path, share, start_at_s) for share in shares if share]
        return [f.result() for f in futures]


def completion_body(model: str, prompt_ids: list[int], output_len: int) -> bytes:
    """A streamed, greedy /v1/completions request for exactly `output_len` tokens, with usage."""
    return json.dumps({"model": model, "prompt": prompt_ids, "max_tokens": output_len, "min_tokens": output_len,
                       "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}, separators=(",", ":")).encode()
