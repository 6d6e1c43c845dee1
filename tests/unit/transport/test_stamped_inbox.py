"""StampedInbox: a thread reads a real ZeroMQ inbox as messages arrive and stamps
each one then, not when the owner gets round to draining it."""
from __future__ import annotations

import os
import time

import zmq

from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver, Sender
from epd.transport.wire.messages import Abort, Shutdown
from epd.transport.wire.stamped_inbox import StampedInbox

DEADLINE_S = 10.0


def _wait_queued(inbox: StampedInbox, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while inbox._arrived.qsize() < n:
        assert time.monotonic() < deadline, f"{inbox._arrived.qsize()} of {n} messages read"
        time.sleep(0.01)


def test_messages_are_stamped_when_read_in_order_and_garbage_is_skipped(ipc_dir):
    address = Addresses.ipc(os.path.join(ipc_dir, "run")).worker("encoder", 0)
    with Receiver(address) as rx, Sender(rx.address) as tx:
        inbox = StampedInbox(rx, "encoder-0")
        assert list(inbox.drain(0.0)) == []  # nothing yet, and no wait
        inbox.start()
        try:
            tx.send(Abort(["a"]))
            garbage = zmq.Context.instance().socket(zmq.PUSH)
            garbage.connect(rx.address)
            garbage.send_multipart([b"\xc1not msgpack"])
            tx.send(Abort(["b"]))
            tx.send(Shutdown())
            _wait_queued(inbox, 3)
            read_by_s = time.perf_counter()  # every stamp was taken before this moment, by the thread
            got = list(inbox.drain(0.0))
            garbage.close(linger=0)
        finally:
            inbox.stop()
    assert [type(m).__name__ for m, _ in got] == ["Abort", "Abort", "Shutdown"]
    assert [m.request_ids for m, _ in got[:2]] == [["a"], ["b"]]
    stamps = [s for _, s in got]
    assert stamps == sorted(stamps) and stamps[-1] <= read_by_s


def test_drain_waits_for_the_first_message_and_stop_ends_the_thread(ipc_dir):
    address = Addresses.ipc(os.path.join(ipc_dir, "run")).worker("encoder", 1)
    with Receiver(address) as rx, Sender(rx.address) as tx:
        inbox = StampedInbox(rx)
        inbox.start()
        tx.send(Abort(["late"]))
        got = list(inbox.drain(DEADLINE_S))  # returns once the message is in (within the deadline)
        inbox.stop()
        assert not inbox._thread.is_alive()
    assert [m.request_ids for m, _ in got] == [["late"]]
