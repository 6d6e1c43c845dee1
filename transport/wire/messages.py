"""Every message that crosses a socket, as a plain dataclass: the one table
of tag -> class, and `decode_message`.

The classes live by plane: transport/wire/request_messages.py (EncodeRequest,
EncodeDone, PrefillRequest, KVTransfer, KVAck, TokenOutput, TokenOutputs: a
request's way through the workers) and transport/wire/control_messages.py
(WorkerStats, Ready, Alive, KVBlocks, WorkerExited, Abort, LoRAUpdate, Shutdown: the worker
plane's control); transport/wire/message.py holds their base `Message` and the wire
layout. Import them all from here.

Values nested in a message have explicit forms too: MMSpan and TokenLogprobs as
lists, SamplingParams and the worker counters as maps with a closed key set.
`decode_message(frames)` raises `WireError` (and nothing else) for any bad
input: garbage, truncation, wrong types, wrong frame count, unknown tag/version,
and fields that decode but no worker could use (an unknown sampling key, a
sampling value SamplingParams refuses, a non-hex mm_hash, a span outside the prompt).
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from typing import Any, Sequence

from epd.transport.wire.codec import WireError
from epd.transport.wire.control_messages import (Abort, Alive, KVBlocks, LoRAUpdate, Ready, Shutdown, WorkerExited,
                                                 WorkerStats)
from epd.transport.wire.message import RESERVED, Message, decode_as, header_of
from epd.transport.wire.mm_span import MMSpan
from epd.transport.wire.request_messages import (EncodeDone, EncodeRequest, KVAck, KVTransfer, PrefillRequest,
                                            TokenOutput, TokenOutputs)

__all__ = [
    "WireError", "Message", "MMSpan", "EncodeRequest", "EncodeDone", "PrefillRequest",
    "KVTransfer", "KVAck", "TokenOutput", "TokenOutputs", "WorkerStats", "Ready", "Abort", "Shutdown",
    "WorkerExited", "Alive", "LoRAUpdate", "KVBlocks",
    "MESSAGE_TYPES", "decode_message",
]

# The one place a tag becomes a class.
MESSAGE_TYPES: dict[str, type[Message]] = {
    "encode_request": EncodeRequest,
    "encode_done": EncodeDone,
    "prefill_request": PrefillRequest,
    "kv_transfer": KVTransfer,
    "kv_ack": KVAck,
    "token_output": TokenOutput,
    "token_outputs": TokenOutputs,
    "worker_stats": WorkerStats,
    "ready": Ready,
    "abort": Abort,
    "shutdown": Shutdown,
    "worker_exited": WorkerExited,
    "alive": Alive,
    "lora_update": LoRAUpdate,
    "kv_blocks": KVBlocks,
}
assert all(cls.TYPE == tag for tag, cls in MESSAGE_TYPES.items())
assert not any(f.name in RESERVED for cls in MESSAGE_TYPES.values() for f in dataclass_fields(cls))


def decode_message(frames: Sequence[Any]) -> Message:
    """Decode a multipart message (bytes / memoryview / zmq.Frame) into its dataclass."""
    header = header_of(frames)
    tag = header.get("type")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError(f"unknown message type {tag!r:.80}")
    return decode_as(cls, header, frames)
