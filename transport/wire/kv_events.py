"""KV cache events in vLLM's format: what an engine worker publishes so that an
external router (vLLM's router, llm-d, Dynamo) knows which blocks it holds.

vLLM's `vllm/distributed/kv_events.py` defines them as msgspec structs; the
bytes here are the same (tests/unit/engine/test_kv_events.py decodes them with
vLLM's own classes):

    EventBatch        an array [ts, events, data_parallel_rank]
    BlockStored       a map {"type": "BlockStored", block_hashes, parent_block_hash,
                      token_ids, block_size, lora_id, medium, lora_name, extra_keys}
    BlockRemoved      a map {"type": "BlockRemoved", block_hashes, medium}
    AllBlocksCleared  a map {"type": "AllBlocksCleared"}

Fields with a default (`extra_keys` and those after it) are left out when they
hold it, as msgspec's `omit_defaults` does. A block hash on this wire is the
last 8 bytes of EPD's sha256 block hash read as an unsigned big-endian int
(`external_block_hash`): vLLM's default form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1);
docs/decisions/kv-events.md says why.

`KVEventsConfig` is vLLM's `--kv-events-config`, read from its JSON keys.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack

from epd.transport.wire.flag_json import json_object

MEDIUM_GPU = "GPU"  # vLLM's name for an engine's own KV cache (the tier a hit costs nothing from)


def external_block_hash(block_hash: bytes) -> int:
    """A block's hash as events carry it: its digest's last 8 bytes, unsigned big-endian
    (vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class BlockStored:
    """Full blocks now in the prefix cache: `block_hashes` chained in prompt order,
    the first one's parent `parent_block_hash` (None: it starts a prompt),
    `token_ids` all their tokens; `extra_keys` one entry per block (None: none):
    the adapter's name, then `(mm_hash, offset)` for each image or video whose
    placeholders the block holds, `offset` its first placeholder's position
    from the block's start (negative: it began in an earlier block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None

    def to_wire(self) -> dict:
        wire = {"type": "BlockStored", "block_hashes": self.block_hashes,
                "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name}
        if self.extra_keys is not None:
            wire["extra_keys"] = [None if keys is None else list(keys) for keys in self.extra_keys]
        return wire


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache forgotten (`reset_prefix_cache`)."""

    def to_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int | None = 0) -> bytes:
    """vLLM's `KVEventBatch`, msgpack: the payload frame of one published batch."""
    return msgpack.packb([float(ts), [event.to_wire() for event in events], data_parallel_rank])


def decode_event_batch(payload: bytes) -> tuple[float, list[KVCacheEvent], int | None]:
    """`(ts, events, data_parallel_rank)` of a batch (ours or vLLM's); ValueError on anything else."""
    try:
        batch = msgpack.unpackb(payload, strict_map_key=False)
        rank = batch[2] if len(batch) > 2 else None
        return float(batch[0]), [_decode_event(event) for event in batch[1]], rank
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


def _decode_event(wire: dict) -> KVCacheEvent:
    kind = wire.pop("type")
    if kind == "BlockStored":
        keys = wire.pop("extra_keys", None)
        known = {f.name for f in fields(BlockStored)}
        return BlockStored(**{k: v for k, v in wire.items() if k in known},
                           extra_keys=None if keys is None else [None if k is None else _untagged(k) for k in keys])
    if kind == "BlockRemoved":
        return BlockRemoved(wire["block_hashes"], wire.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


def _untagged(keys: list) -> tuple:
    """One block's extra keys as `BlockStored` holds them: `(mm_hash, offset)` pairs as tuples."""
    return tuple(tuple(key) if isinstance(key, list) else key for key in keys)


PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`, its keys and defaults. `endpoint`: the PUB socket
    (bound when it holds `*` or is ipc/inproc, else connected, as vLLM does);
    `replay_endpoint`: a ROUTER socket (bound) that resends the last `buffer_steps`
    batches from a sequence number; `hwm`: the PUB socket's high-water mark.
    `max_queue_size` is read and unused: batches are sent from the step, not queued."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are on, else "null" (vLLM's)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive int, got {value!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"--kv-events-config: endpoint must be a ZeroMQ address, got {self.endpoint!r}")

    @property
    def is_on(self) -> bool:
        return self.enable_kv_cache_events is True and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The settings of a deployment's `rank`-th engine worker (from 0), as vLLM offsets them by
        data-parallel rank: a tcp port plus `rank` (port 0 stays 0), an ipc/inproc address
        suffixed `_dp{rank}`; rank 0 keeps them."""
        return replace(self, endpoint=_offset_endpoint(self.endpoint, rank),
                       replay_endpoint=_offset_endpoint(self.replay_endpoint, rank))

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """From the flag's JSON text, a dict (`LLM`), or itself; None stays None.
        ValueError naming a key EPD does not read, or a value of the wrong type."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object("--kv-events-config", value)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: EPD does not read {', '.join(unknown)} "
                             f"(it takes {', '.join(known)})")
        if not isinstance(value.get("enable_kv_cache_events", False), bool):
            raise ValueError(f"--kv-events-config: enable_kv_cache_events must be true or false, "
                             f"got {value['enable_kv_cache_events']!r}")
        for name in ("topic", "replay_endpoint"):
            if name in value and not isinstance(value[name], str) and not (name == "replay_endpoint"
                                                                            and value[name] is None):
                raise ValueError(f"--kv-events-config: {name} must be a string, got {value[name]!r}")
        return cls(**value)


def _offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if port == "0" else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
