"""The worker plane's control messages: registration, load, heartbeats and the
prefix cache's block changes (worker -> API), exits (launcher -> API), Abort and Shutdown (API or launcher
-> worker). transport/wire/message.py frames them; transport/wire/messages.py holds the
table of every tag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from epd.transport.wire.codec import Fields, WireError
from epd.transport.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.message import Message, need, read_address, read_api_index
from epd.transport.wire.roles import Role
from epd.transport.wire.wire_values import CacheFaults, EncoderCounters, EngineCounters, LoRAState


SESSION_HEX_CHARS = 32  # a worker process's session token (WorkerIO): 128 random bits


def _session(f: Fields) -> str:
    """The sender's session token: "" or hex, at most 64 characters."""
    value = f.str("session")
    need(len(value) <= 64 and all(c in "0123456789abcdef" for c in value), f.tag,
         f"session: expected hex, got {value!r:.80}")
    return value


@dataclass
class WorkerStats(Message):
    """Worker -> API, every few hundred ms: load for the router, counters for /metrics."""

    TYPE: ClassVar[str] = "worker_stats"
    VERSION: ClassVar[int] = 5  # 2: session, 3: cache, 4: lora, 5: state slots
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queue_depth: int
    engine: EngineCounters | None = None  # engine roles
    encoder: EncoderCounters | None = None  # encoders, and the aggregated worker's in-process one
    session: str = ""  # the sender's session token (its Ready's): the registry takes stats only from it
    cache: CacheFaults | None = None  # its embedding cache's faults; None: it has no cache
    lora: LoRAState | None = None  # its adapters (engine roles with --enable-lora); None: LoRA off
    # its per-request state cache (engine/state_cache.py): slots, and those free; 0 and 0: none
    num_state_slots: int = 0
    num_free_state_slots: int = 0

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "num_running": self.num_running,
                "num_waiting": self.num_waiting, "num_free_blocks": self.num_free_blocks,
                "num_total_blocks": self.num_total_blocks, "queue_depth": self.queue_depth,
                "engine": None if self.engine is None else self.engine.to_map(),
                "encoder": None if self.encoder is None else self.encoder.to_map(), "session": self.session,
                "cache": None if self.cache is None else self.cache.to_map(),
                "lora": None if self.lora is None else self.lora.to_map(),
                "num_state_slots": self.num_state_slots, "num_free_state_slots": self.num_free_state_slots}

    @classmethod
    def _build(cls, f, payload):
        engine, encoder, cache, lora = f.opt_map("engine"), f.opt_map("encoder"), f.opt_map("cache"), f.opt_map("lora")
        counts = [f.int(name) for name in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
                                            "queue_depth")]
        slots = [f.int("num_state_slots"), f.int("num_free_state_slots")]
        need(0 <= slots[1] <= slots[0] < 2 ** 40, cls.TYPE, f"state slots must be 0 <= free <= total, got {slots}")
        need(all(0 <= n < 2 ** 40 for n in counts), cls.TYPE, f"counts must be in [0, 2^40), got {counts}")
        return cls(f.str("worker_id"), f.one_of("role", tuple(Role)), *counts,
                   None if engine is None else EngineCounters.from_map(engine),
                   None if encoder is None else EncoderCounters.from_map(encoder), _session(f),
                   None if cache is None else CacheFaults.from_map(cache),
                   None if lora is None else LoRAState.from_map(lora), *slots)


@dataclass
class Ready(Message):
    """Worker -> API: started, inbox bound. From an `epd worker` on another host
    this is also its registration."""

    TYPE: ClassVar[str] = "ready"
    VERSION: ClassVar[int] = 2  # 2: session
    worker_id: str
    role: str
    inbox: str  # the address its inbox is bound at
    host: str  # its socket.gethostname(): a cache dir is shared only on the same host
    mm_cache_dir: str | None = None  # the embedding cache it reads and writes; None: none
    # A secret of this worker process, drawn at its start: a worker id held by a live
    # worker is taken over, and its stats believed, only with the same session.
    session: str = ""

    def _fields(self):
        return {"worker_id": self.worker_id, "role": self.role, "inbox": self.inbox, "host": self.host,
                "mm_cache_dir": self.mm_cache_dir, "session": self.session}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.one_of("role", tuple(Role)), read_address(f, "inbox"), f.str("host"),
                   f.opt_str("mm_cache_dir"), _session(f))


@dataclass
class Alive(Message):
    """Worker -> API, from the worker's heartbeat thread while its loop is busy
    (a long ViT batch or prefill step sends no WorkerStats): the process is up.
    `busy_s`: how long its loop has not come back (since its last WorkerStats).

    An encoder's loop sends one too as it starts and ends each batch, with
    `working_on`: the request ids whose items it is encoding now (empty: none).
    If it dies, those requests are the suspects of its death
    (docs/architecture.md, "Faults"). None (the heartbeat's): not said."""

    TYPE: ClassVar[str] = "alive"
    VERSION: ClassVar[int] = 3  # 2: session; 3: working_on
    worker_id: str
    busy_s: float
    session: str = ""  # as in its Ready
    working_on: list[str] | None = None

    def _fields(self):
        return {"worker_id": self.worker_id, "busy_s": float(self.busy_s), "session": self.session,
                "working_on": None if self.working_on is None else list(self.working_on)}

    @classmethod
    def _build(cls, f, payload):
        busy_s = f.float("busy_s")
        need(0.0 <= busy_s < 1e9, cls.TYPE, f"busy_s must be finite seconds >= 0, got {busy_s!r}")
        working_on = None
        if f.opt_list("working_on") is not None:
            working_on = f.list_of("working_on", str)
            need(len(working_on) <= MAX_WORKING_ON, cls.TYPE,
                 f"working_on names at most {MAX_WORKING_ON} requests, got {len(working_on)}")
        return cls(f.str("worker_id"), busy_s, _session(f), working_on)


MAX_WORKING_ON = 4096  # request ids in one Alive: more than an encoder batch holds


BLOCK_CHANGES = ("stored", "removed", "cleared")
MAX_BLOCK_HASH = (1 << 64) - 1  # a block hash on the wire: 8 bytes (kv_events.external_block_hash)


@dataclass
class KVBlocks(Message):
    """Engine worker -> every API collector, after a step that changed its prefix cache
    (`--router cache_aware`): the changes in order, each `(kind, block hashes)`: "stored"
    and "removed" as vLLM's BlockStored / BlockRemoved name them (hashes in their 8-byte
    form), "cleared" (no hashes) for AllBlocksCleared. `seq` counts this worker process's
    batches from 0: a gap tells the API's index (epd/serve/prefix_index.py) it missed some."""

    TYPE: ClassVar[str] = "kv_blocks"
    worker_id: str
    seq: int
    changes: list[tuple[str, list[int]]]
    session: str = ""  # as in its Ready

    @classmethod
    def of_events(cls, worker_id: str, seq: int, events: list[KVCacheEvent], session: str = "") -> KVBlocks:
        kinds = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}
        return cls(worker_id, seq, [(kinds[type(e)], list(getattr(e, "block_hashes", ()))) for e in events], session)

    def _fields(self):
        return {"worker_id": self.worker_id, "seq": self.seq, "session": self.session,
                "changes": [[kind, list(hashes)] for kind, hashes in self.changes]}

    @classmethod
    def _build(cls, f, payload):
        seq = f.int("seq")
        need(seq >= 0, cls.TYPE, f"seq must be >= 0, got {seq}")
        changes = []
        for change in f.list_of("changes", list):
            need(len(change) == 2 and change[0] in BLOCK_CHANGES and isinstance(change[1], list), cls.TYPE,
                 f"a change is [kind, hashes] with kind one of {', '.join(BLOCK_CHANGES)}, got {change!r:.80}")
            need(all(type(h) is int and 0 <= h <= MAX_BLOCK_HASH for h in change[1]), cls.TYPE,
                 "block hashes are ints of 8 bytes")
            changes.append((change[0], change[1]))
        return cls(f.str("worker_id"), seq, changes, _session(f))


@dataclass
class WorkerExited(Message):
    """Launcher -> every API process (`--api-servers` > 1, whose workers are not
    its own children): the supervisor saw this worker's process exit."""

    TYPE: ClassVar[str] = "worker_exited"
    VERSION: ClassVar[int] = 2  # 2: restarting
    worker_id: str
    exit_code: int | None
    restarting: bool = True  # False: the supervisor gave up on it (for now): its role may be down

    def _fields(self):
        return {"worker_id": self.worker_id, "exit_code": self.exit_code, "restarting": self.restarting}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.str("worker_id"), f.opt_int("exit_code"), f.bool("restarting"))


@dataclass
class Abort(Message):
    """API -> worker: drop these requests and free their blocks. Launcher ->
    worker, `api_index` set: API process `api_index` exited, drop all of its requests too."""

    TYPE: ClassVar[str] = "abort"
    request_ids: list[str]
    api_index: int | None = None

    def _fields(self):
        return {"request_ids": list(self.request_ids), "api_index": self.api_index}

    @classmethod
    def _build(cls, f, payload):
        return cls(f.list_of("request_ids", str), None if f.opt_int("api_index") is None else read_api_index(f))


@dataclass
class LoRAUpdate(Message):
    """API -> prefill/decode workers: an adapter loaded at run time (POST
    /v1/load_lora_adapter: read it into host memory before its first request
    comes) or unloaded (/v1/unload_lora_adapter: forget it)."""

    TYPE: ClassVar[str] = "lora_update"
    lora: LoRARequest
    is_load: bool

    def _fields(self):
        return {"lora": self.lora.to_list(), "is_load": self.is_load}

    @classmethod
    def _build(cls, f, payload):
        try:
            lora = LoRARequest.from_list(f.opt_list("lora"))
        except ValueError as e:
            raise WireError(f"{f.tag}.lora: {e}") from None
        return cls(lora, f.bool("is_load"))


@dataclass
class Shutdown(Message):
    """Launcher -> worker: finish up and exit."""

    TYPE: ClassVar[str] = "shutdown"
