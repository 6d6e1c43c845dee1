"""What an attacker can reach: the API key, the listening address, and the
workers' ZeroMQ sockets (private ipc; garbage, truncated frames and a pickle
exploit are dropped, and every worker keeps serving)."""
from __future__ import annotations

import os
import pickle
import stat
import time
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import zmq
from testkit.api_checks import (IMG, TEXT_MESSAGES, assert_error, assert_still_serving, chat_body, group_processes,
                        plain_server_model, post, worker_set, worker_sockets)

from epd.transport.wire.messages import EncodeRequest, PrefillRequest
from epd.transport.wire.sampling import SamplingParams


def test_api_key_from_the_environment(plain_server):
    body = {**chat_body(TEXT_MESSAGES), "model": plain_server_model(plain_server)}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sk-hardening"},
                    {"authorization": "Basic sk-hardening"}):
        assert_error(post(plain_server, body, headers=headers), 401, "api key")
        assert_error(httpx.get(plain_server.base_url + "/v1/models", headers=headers), 401)
    c = openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    c = openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="sk-hardening", max_retries=0)
    assert c.chat.completions.create(**body).choices[0].message.content
    assert httpx.get(plain_server.base_url + "/health").status_code == 200  # probes need no key



def test_the_key_guards_the_docs_and_metrics_name_no_path(plain_server, tiny_model):
    """Issue 33, item 10: the schema and docs pages need the key; /metrics stays open
    (as in vLLM, for Prometheus; --metrics-require-key closes it) and shows the
    checkpoint's name, not the path it lies at."""
    key = {"authorization": "Bearer sk-hardening"}
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(httpx.get(plain_server.base_url + path), 401, "api key")
        assert httpx.get(plain_server.base_url + path, headers=key).status_code == 200
    metrics = httpx.get(plain_server.base_url + "/metrics")
    assert metrics.status_code == 200
    assert tiny_model not in metrics.text and 'model_name="tiny"' in metrics.text


def _listening_addresses(port: int) -> set[str]:
    """Local addresses a TCP socket LISTENs on at `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_binds_loopback_by_default(plain_server):
    from epd.cli import build_parser
    from epd.config import ServeConfig

    assert ServeConfig.__dataclass_fields__["host"].default == "127.0.0.1"
    assert build_parser().parse_args(["serve", "ckpt"]).host == "127.0.0.1"
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp")
    assert _listening_addresses(plain_server.port) == {"0100007F"}  # 127.0.0.1, nothing else


def test_zmq_sockets_are_private_ipc(server):
    sockets = worker_sockets(server)
    assert set(sockets) == {"api", "encoder-0", "prefill-0", "decode-0"}
    for address in sockets.values():
        assert address.startswith("ipc://")
        run_dir = os.path.dirname(address[len("ipc://"):])
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700  # no other user can connect


def _garbage_frames(marker: Path) -> list[list[bytes]]:
    class Exploit:  # what a pickle-based wire would run on receipt
        def __reduce__(self):
            return (open, (str(marker), "w"))

    prefill = PrefillRequest("evil", [1, 2, 3], [], SamplingParams(), [0], None).to_wire()
    encode = EncodeRequest("evil", "ab" * 32, IMG, reply_to="ipc:///nowhere").to_wire()
    header = msgpack.unpackb(bytes(encode[0]))
    return [
        [b"\x00\xffnot msgpack at all"],
        [pickle.dumps(Exploit())],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"type": "no_such_type", "v": 1})],
        [msgpack.packb({"type": "abort", "v": 99, "request_ids": ["x"]})],
        [msgpack.packb({"type": "prefill_request", "v": 1})],  # fields missing
        [bytes(prefill[0])[: len(bytes(prefill[0])) // 2]],  # truncated header
        [bytes(encode[0]), bytes(encode[1])[:10]],  # truncated blob frame
        [bytes(encode[0])],  # blob frame missing
        [msgpack.packb({**header, "frames": [1 << 40]}), b"x"],  # absurd size
        [msgpack.packb({"type": "token_output", "v": 1, "request_id": 5, "token_ids": "no"})],
        [b"", b"", b""],
    ]


def test_garbage_frames_to_every_socket_harm_no_worker(server, expected, tmp_path):
    """No pickle on the wire: every socket gets garbage, truncated frames and a
    pickle that would write a file; every worker logs the drop and keeps serving."""
    sockets = worker_sockets(server)
    workers, pids = worker_set(server), group_processes(server)
    marker = tmp_path / "pwned"
    frames = _garbage_frames(marker)
    ctx = zmq.Context()
    try:
        for address in sockets.values():
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(address)
            for msg in frames:
                sock.send_multipart(msg)
            sock.close()  # lingers until delivered
    finally:
        ctx.term()
    deadline = time.monotonic() + 10
    names = {name: ("collector" if name == "api" else name) for name in sockets}
    while time.monotonic() < deadline:
        log = server.log()
        if all(log.count(f"{n}: dropped a malformed message") >= len(frames) - 1 for n in names.values()):
            break
        time.sleep(0.2)
    for name in names.values():  # the empty-frames message may be read as one frame by some peers
        assert log.count(f"{name}: dropped a malformed message") >= len(frames) - 1, (name, log[-3000:])
    assert not marker.exists()
    assert_still_serving(server, expected, "image")
    assert worker_set(server) == workers and group_processes(server) == pids
    assert server.log().count("EPD ready") == 1
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_semantically_bad_wire_message_is_survived(server, expected):
    """Well-formed frames with contents no worker can use (unknown sampling field):
    refused when decoded, and every worker keeps serving."""
    sockets = worker_sockets(server)
    pids = group_processes(server)
    good = PrefillRequest("bogus", [1, 2], [], SamplingParams(), [0], None).to_wire()
    header = msgpack.unpackb(bytes(good[0]))
    header["sampling"]["no_such_field"] = 1
    names = [name for name in sockets if name != "api"]
    dropped = {name: server.log().count(f"{name}: dropped a malformed message") for name in names}
    ctx = zmq.Context()
    try:
        for name, address in sockets.items():
            if name == "api":
                continue
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(address)
            sock.send_multipart([msgpack.packb({**header, "request_id": f"bogus-{name}"})])
            sock.close()
    finally:
        ctx.term()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            server.log().count(f"{name}: dropped a malformed message") == dropped[name] for name in names):
        time.sleep(0.2)
    assert all(server.log().count(f"{name}: dropped a malformed message") > dropped[name] for name in names)
    assert_still_serving(server, expected)
    assert group_processes(server) == pids

