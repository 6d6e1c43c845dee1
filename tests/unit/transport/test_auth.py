"""Worker-plane keys over real tcp sockets on 127.0.0.1: only the plane's peers
get a frame through, and only the API's key may stop a worker."""
from __future__ import annotations

import asyncio
import contextlib
import stat

import pytest
import zmq

from epd.transport.wire.auth import API, COLLECTOR_DOMAIN, WORKER, PlaneKeyError, PlaneKeys, make_keys
from epd.transport.wire.channels import AsyncReceiver, Outbox, Receiver, Sender
from epd.transport.wire.messages import Abort, Ready, Shutdown, WireError, WorkerExited

WAIT_S = 1.5  # how long a dropped message is given to (not) arrive


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys") / "plane")


def _ready(worker_id: str = "prefill-9") -> Ready:
    return Ready(worker_id, "prefill", inbox="tcp://127.0.0.1:1", host="h")


def test_make_keys_writes_private_files_and_refuses_to_overwrite(keys_dir):
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    for name in (API, WORKER):
        assert stat.S_IMODE((keys_dir / f"{name}.key_secret").stat().st_mode) == 0o600
        assert (keys_dir / f"{name}.key").exists()
    with pytest.raises(PlaneKeyError, match="already holds keys"):
        make_keys(keys_dir)


def test_load_names_the_missing_file(tmp_path, keys_dir):
    with pytest.raises(PlaneKeyError, match="api.key"):
        PlaneKeys.load(tmp_path, API)
    (tmp_path / "api.key").write_bytes((keys_dir / "api.key").read_bytes())
    (tmp_path / "worker.key").write_bytes((keys_dir / "worker.key").read_bytes())
    with pytest.raises(PlaneKeyError, match="worker.key_secret"):  # a worker host without its secret
        PlaneKeys.load(tmp_path, WORKER)
    api, worker = PlaneKeys.load(keys_dir, API), PlaneKeys.load(keys_dir, WORKER)
    assert api.public == worker.api_public and worker.public == api.worker_public and api.secret != worker.secret


def test_only_the_planes_peers_reach_a_worker_inbox(keys_dir, tmp_path):
    api, worker = PlaneKeys.load(keys_dir, API), PlaneKeys.load(keys_dir, WORKER)
    foreign = PlaneKeys.load(make_keys(tmp_path / "other"), API)
    with Receiver("tcp://127.0.0.1:*", keys=worker) as inbox:
        # no keys at all: a plain PUSH, the forged Ready of the issue
        ctx = zmq.Context.instance()
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(inbox.address)
        plain.send_multipart(_ready().to_wire())
        # keys of another deployment, knowing our server's public key
        with Sender(inbox.address, keys=foreign, server_key=worker.worker_public) as stranger:
            # its handshake fails, so a send may find no connection to queue on: it would wait
            # forever (a 300 s timeout once in CI); refused at the send or dropped after, it never arrives
            stranger.socket.setsockopt(zmq.SNDTIMEO, 2000)
            for msg in (_ready("prefill-8"), Shutdown()):
                with contextlib.suppress(zmq.Again):
                    stranger.send(msg)
            assert inbox.recv(timeout_s=WAIT_S) is None
        plain.close()
        # the plane's own peers get through
        with Sender(inbox.address, keys=api, server_key=api.worker_public) as from_api:
            from_api.send(_ready("prefill-1"))
            msg = inbox.recv(timeout_s=30)
        assert isinstance(msg, Ready) and msg.worker_id == "prefill-1"


def test_shutdown_counts_only_from_the_api(keys_dir):
    api, worker = PlaneKeys.load(keys_dir, API), PlaneKeys.load(keys_dir, WORKER)
    with Receiver("tcp://127.0.0.1:*", keys=worker) as inbox:
        with Sender(inbox.address, keys=worker, server_key=worker.worker_public) as peer:
            peer.send(Shutdown())  # another worker: in the plane, but not the API
            with pytest.raises(WireError, match="not the API"):
                inbox.recv(timeout_s=30)
            peer.send(_ready("decode-0"))  # the same peer's other messages still count
            assert isinstance(inbox.recv(timeout_s=30), Ready)
        with Sender(inbox.address, keys=api, server_key=api.worker_public) as from_api:
            from_api.send(Shutdown())
            assert isinstance(inbox.recv(timeout_s=30), Shutdown)


def test_collector_admits_workers_over_an_outbox(keys_dir):
    """The API's asyncio collector (api pair, collector domain); a worker's
    Outbox picks the API's public key for the API's address."""
    api, worker = PlaneKeys.load(keys_dir, API), PlaneKeys.load(keys_dir, WORKER)

    async def scenario():
        # the process-wide asyncio context, as the API's (its ZAP handler lives as long as it does)
        collector = AsyncReceiver("tcp://127.0.0.1:*", keys=api, domain=COLLECTOR_DOMAIN)
        outbox = Outbox(keys=worker, api_address=collector.address)
        try:
            outbox.send(collector.address, _ready("encoder-0"))
            got = await collector.recv(timeout_s=30)
            # a peer holding only the API's own key is no worker: the collector refuses it
            with Sender(collector.address, keys=api, server_key=api.api_public) as not_a_worker:
                # refused at the handshake, a send may find no connection to queue on (as the stranger's
                # above): it would wait forever (a 300 s timeout once in CI); refused, it never arrives
                not_a_worker.socket.setsockopt(zmq.SNDTIMEO, 2000)
                with contextlib.suppress(zmq.Again):
                    not_a_worker.send(_ready("encoder-7"))
                late = await collector.recv(timeout_s=WAIT_S)
            return got, late
        finally:
            outbox.close()
            collector.close()

    got, late = asyncio.run(scenario())
    assert isinstance(got, Ready) and got.worker_id == "encoder-0"
    assert late is None


@pytest.mark.parametrize("msg", [Abort(["chatcmpl-1"]), Abort([], api_index=0), WorkerExited("decode-0", 1)],
                         ids=["abort", "abort_api", "worker_exited"])
def test_work_and_exits_count_only_from_the_api(keys_dir, msg):
    """A worker's key may say what a worker says, never abort work or report an exit (issue 33)."""
    api, worker = PlaneKeys.load(keys_dir, API), PlaneKeys.load(keys_dir, WORKER)
    with Receiver("tcp://127.0.0.1:*", keys=worker) as inbox:
        with Sender(inbox.address, keys=worker, server_key=worker.worker_public) as peer:
            peer.send(msg)
            with pytest.raises(WireError, match="not the API"):
                inbox.recv(timeout_s=30)
        with Sender(inbox.address, keys=api, server_key=api.worker_public) as from_api:
            from_api.send(msg)
            assert inbox.recv(timeout_s=30) == msg
