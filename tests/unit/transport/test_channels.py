import asyncio
import os

import pytest
import torch
import zmq

from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import AsyncReceiver, AsyncSender, Receiver, Sender
from epd.transport.wire.messages import EncodeDone, KVAck, KVTransfer, TokenOutput, WireError
from epd.transport.wire.sampling import SamplingParams

TIMEOUT_S = 5.0


def _kv_transfer() -> KVTransfer:
    # [layers, blocks, block_size, kv_heads, head_dim]: 128 KiB per frame, above zmq's copy threshold
    k = torch.randn(4, 8, 16, 4, 32).to(torch.bfloat16)
    return KVTransfer("req-9", list(range(100)), 7, SamplingParams(temperature=0.0), [2], [],
                      k, torch.randn(4, 8, 16, 4, 32).to(torch.bfloat16))


def _check_kv(got, sent) -> None:
    assert isinstance(got, KVTransfer) and got.request_id == sent.request_id
    assert got.k_blocks.dtype == torch.bfloat16
    assert torch.equal(got.k_blocks, sent.k_blocks) and torch.equal(got.v_blocks, sent.v_blocks)
    assert got.prompt_token_ids == sent.prompt_token_ids


@pytest.fixture(params=["ipc", "tcp"])
def address(request, ipc_dir):
    if request.param == "ipc":
        return Addresses.ipc(os.path.join(ipc_dir, "run")).worker("decode", 0)  # dir made on bind
    return "tcp://127.0.0.1:*"  # the Receiver reports the port it got


def test_sync_multipart_delivery(address):
    with Receiver(address) as rx, Sender(rx.address) as tx:
        sent = [_kv_transfer(), TokenOutput("req-9", [1, 2], finished=True, finish_reason="stop"),
                KVAck("req-9", ok=True)]
        for msg in sent:
            tx.send(msg)
        got = [rx.recv(timeout_s=TIMEOUT_S) for _ in sent]
        _check_kv(got[0], sent[0])
        assert got[1] == sent[1] and got[2] == sent[2]


def test_fan_in_from_several_senders(address):
    with Receiver(address) as rx:
        senders = [Sender(rx.address) for _ in range(3)]
        for i, tx in enumerate(senders):
            tx.send(TokenOutput(f"req-{i}", [i]))
        got = {rx.recv(timeout_s=TIMEOUT_S).request_id for _ in senders}
        assert got == {"req-0", "req-1", "req-2"}
        for tx in senders:
            tx.close()


def test_recv_times_out_with_none(address):
    with Receiver(address) as rx:
        assert not rx.poll(0.01)
        assert rx.recv(timeout_s=0.05) is None


def test_async_multipart_delivery(address):
    async def main():
        with AsyncReceiver(address) as rx, AsyncSender(rx.address) as tx:
            assert await rx.recv(timeout_s=0.05) is None
            sent = _kv_transfer()
            await tx.send(sent)
            await tx.send(EncodeDone("req-9", "ab" * 32, ok=False, error="bad image"))
            _check_kv(await rx.recv(timeout_s=TIMEOUT_S), sent)
            done = await rx.recv(timeout_s=TIMEOUT_S)
            assert isinstance(done, EncodeDone) and done.error == "bad image"

    asyncio.run(main())


def test_sync_sender_to_async_receiver(address):
    async def main():
        with AsyncReceiver(address) as rx, Sender(rx.address) as tx:
            tx.send(TokenOutput("req-1", [42]))
            got = await rx.recv(timeout_s=TIMEOUT_S)
            assert got == TokenOutput("req-1", [42])

    asyncio.run(main())


def test_receiver_survives_garbage(address):
    with Receiver(address) as rx, Sender(rx.address) as tx:
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(rx.address)
        try:
            garbage = [[b"\xc1"], [b"hello", b"world"], [b""], [b"\x93\x01\x02\x03"],
                       [KVAck("r", True).to_wire()[0], b"extra frame"]]
            for frames in garbage:
                raw.send_multipart(frames)
            for _ in garbage:  # (two PUSH peers are not ordered: drain the garbage first)
                with pytest.raises(WireError):
                    rx.recv(timeout_s=TIMEOUT_S)
            raw.send_multipart(KVAck("req-raw", ok=True).to_wire())
            tx.send(KVAck("req-ok", ok=True))
            got = {rx.recv(timeout_s=TIMEOUT_S).request_id for _ in range(2)}
            assert got == {"req-raw", "req-ok"}
        finally:
            raw.close()


def test_async_receiver_survives_garbage(address):
    async def main():
        with AsyncReceiver(address) as rx, AsyncSender(rx.address) as tx:
            raw = zmq.Context.instance().socket(zmq.PUSH)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(rx.address)
            try:
                raw.send_multipart([b"\xff" * 10, b"\x00"])
                with pytest.raises(WireError):
                    await rx.recv(timeout_s=TIMEOUT_S)
                await tx.send(KVAck("req-ok", ok=True))
                assert await rx.recv(timeout_s=TIMEOUT_S) == KVAck("req-ok", ok=True)
            finally:
                raw.close()

    asyncio.run(main())


def test_bind_failure_names_the_address(ipc_dir):
    with Receiver("tcp://127.0.0.1:*") as rx:
        with pytest.raises(zmq.ZMQError, match="127.0.0.1"):
            Receiver(rx.address)


def test_a_frame_past_the_cap_is_never_kept_and_the_others_arrive(address):
    """Issue 33, item 10: a receiving end takes frames up to `max_frame_bytes` only;
    a peer that sends a larger one is dropped, the socket and other peers go on."""
    cap = 1 << 20
    with Receiver(address, max_frame_bytes=cap) as inbox:
        small = TokenOutput("req-1", [5], num_prompt_tokens=1)
        with Sender(inbox.address) as rogue, Sender(inbox.address) as peer:
            big_k = torch.randn(4, 64, 16, 4, 32)  # float32: 2 MiB, past the cap
            assert big_k.nbytes > cap
            rogue.send(KVTransfer("req-9", [1], 7, SamplingParams(), [2], [], big_k, big_k.clone()))
            peer.send(small)
            assert inbox.recv(timeout_s=TIMEOUT_S) == small
            assert inbox.recv(timeout_s=0.5) is None  # the large one never arrives
            peer.send(small)
            assert inbox.recv(timeout_s=TIMEOUT_S) == small


def test_a_frame_under_the_cap_arrives_whole(address):
    with Receiver(address, max_frame_bytes=4 << 20) as inbox, Sender(inbox.address) as peer:
        sent = _kv_transfer()
        peer.send(sent)
        _check_kv(inbox.recv(timeout_s=TIMEOUT_S), sent)


def test_an_encoder_inbox_takes_the_largest_image_the_api_may_send(ipc_dir):
    """A WorkerSpec's --max-image-bytes sizes the inbox cap of an encoder (and of an
    aggregated worker): an image of that size arrives, a frame well past it does not."""
    from epd.transport.wire.frame_limits import encoder_inbox_frame_bytes
    from epd.transport.wire.messages import EncodeRequest

    max_image_bytes = 80 << 20  # above the header bound, so the image decides the cap
    cap = encoder_inbox_frame_bytes(max_image_bytes)
    assert cap > max_image_bytes
    with Receiver(Addresses.ipc(os.path.join(ipc_dir, "enc")).worker("encoder", 0), max_frame_bytes=cap) as inbox:
        with Sender(inbox.address) as api:
            image = os.urandom(max_image_bytes)
            api.send(EncodeRequest("r", "ab" * 32, image, "ipc:///x/p.sock"))
            got = inbox.recv(timeout_s=30)
            assert isinstance(got, EncodeRequest) and len(got.image) == max_image_bytes
        with Sender(inbox.address) as rogue:
            rogue.send(EncodeRequest("r", "ab" * 32, bytes(cap + 1), "ipc:///x/p.sock"))
            assert inbox.recv(timeout_s=1.0) is None
