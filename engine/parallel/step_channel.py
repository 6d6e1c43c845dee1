"""The channel on which rank 0 hands each forward's inputs to its followers.

One ZeroMQ PUSH socket per follower (`ipc://<run dir>/tp-rank-<r>.sock`), bound
by rank 0; each follower's PULL connects. A message is one `Step`: an op name
("setup", "forward", "logits", "stop"), a small map of plain values, and named
tensors; encoded as a msgpack header `{"op", "values", "tensors": [[name,
dtype, shape], ...]}` followed by one raw frame per tensor (C order), as the
wire's messages are (transport/wire/codec.py) but inside one worker: both ends
are the same build, so it carries no version and never crosses a host.
ZeroMQ rather than a gloo broadcast because a follower waits for the next
step without a deadline (a server may idle for hours) and gloo waits have one;
the follower polls and watches its parent instead (follower.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
import zmq

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                                       torch.int32, torch.bool)}


class StepTimeout(RuntimeError):
    """A follower did not take a step in time (it is gone or stuck)."""


@dataclass
class Step:
    op: str
    values: dict = field(default_factory=dict)  # msgpack-able plain values
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def address(run_dir: str | Path, rank: int) -> str:
    return f"ipc://{Path(run_dir) / f'tp-rank-{rank}.sock'}"


def encode(step: Step) -> list:
    frames, metas = [], []
    for name, t in step.tensors.items():
        t = t.detach().contiguous().cpu()
        metas.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        frames.append(t.view(torch.uint8).numpy() if t.numel() else b"")
    return [msgpack.packb({"op": step.op, "values": step.values, "tensors": metas}), *frames]


def decode(frames: list) -> Step:
    header = msgpack.unpackb(frames[0])
    tensors = {}
    for (name, dtype, shape), frame in zip(header["tensors"], frames[1:]):
        data = bytearray(frame)  # a writable copy: the model may write into what it is given
        flat = torch.frombuffer(data, dtype=_DTYPES[dtype]) if data else torch.empty(0, dtype=_DTYPES[dtype])
        tensors[name] = flat.reshape(shape)
    return Step(header["op"], header["values"], tensors)


class StepSender:
    """Rank 0's end: the same step to every follower."""

    def __init__(self, run_dir: str | Path, size: int, timeout_s: float):
        """A send waits at most `timeout_s` for a follower to take it (StepTimeout after)."""
        self.context = zmq.Context.instance()
        self.sockets = []
        for rank in range(1, size):
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
            sock.bind(address(run_dir, rank))
            self.sockets.append(sock)

    def send(self, step: Step) -> None:
        frames = encode(step)
        for rank, sock in enumerate(self.sockets, start=1):
            try:
                sock.send_multipart(frames, copy=False)
            except zmq.Again:
                raise StepTimeout(f"tensor-parallel rank {rank} took no step within the deadline") from None

    def send_stop(self) -> None:
        """"stop" to each follower that can take it now (one that is gone is not waited for)."""
        frames = encode(Step("stop"))
        for sock in self.sockets:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)


class StepReceiver:
    """A follower's end."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address(run_dir, rank))

    def recv(self, timeout_ms: int) -> Step | None:
        """The next step, or None when none came within `timeout_ms`."""
        if not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)
