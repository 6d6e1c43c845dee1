"""The embedding cache: mm_hash -> MMEntry in one LMDB environment per host.

Many processes open the same directory: LMDB gives many concurrent readers
and one writer at a time. Three named databases:

    entries   32-byte key -> value (format in mm_entry.py)
    used      32-byte key -> u64 last-used time in ns (LRU order)
    meta      b"total_bytes" -> u64 sum of entry value sizes

Recency: `get` hits are buffered in memory and written to `used` in one write
transaction at most every `touch_interval_s` (and before every `put`), so a
read never waits for the writer lock. A read-only instance records no recency;
its hits only count in its stats.

Capacity: a `put` that would push `total_bytes` past `budget_bytes` (`max_bytes`,
or less where the filesystem cannot hold that much: mm_cache_space.py) first
evicts least-recently-used entries down to `low_water * budget_bytes`
(amortizes the O(n log n) scan over many puts). A write that fails for room
evicts harder and tries once more. A value larger than the cache, or a write
that still fails, is skipped and counted, with one warning: the cache never
fails a request.
Corrupt or foreign entries read as misses and are deleted by writable instances.

Faults: a cache whose file cannot be opened is set aside by a writer and
replaced by a fresh one (mm_cache_env.py); without any (a reader that found it
corrupt, a fresh one that failed too) the instance runs closed (`is_open`
False): every lookup a miss, every put skipped. An LMDB error at run time
fails that one lookup or put, counted in `stats`, with one warning per kind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import lmdb
import msgpack

from epd.transport.wire.codec import WireError
from epd.transport.embedding_cache.mm_cache_env import open_env
from epd.transport.embedding_cache.mm_cache_space import free_bytes, is_space_error, space_bytes
from epd.transport.embedding_cache.mm_entry import MMEntry, decode_entry, encode_entry, read_header
from epd.transport.wire.wire_values import CacheFaults

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")
_TOTAL = b"total_bytes"
_MAP_SLACK_BYTES = 64 << 20


def _canonical(obj: Any) -> Any:
    """Dicts with sorted str keys, tuples as lists: one encoding per config."""
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    return obj


def mm_hash(image_bytes: bytes, model_fingerprint: str, processor_config: dict) -> str:
    """Content key of an image: 64 hex chars of blake2b-256 over
    msgpack([tag, fingerprint, sorted processor config, len(image)]) + raw image bytes."""
    prefix = [b"epd-mm-v1", model_fingerprint, _canonical(processor_config), len(image_bytes)]
    digest = hashlib.blake2b(msgpack.packb(prefix, use_bin_type=True), digest_size=32)
    digest.update(image_bytes)
    return digest.hexdigest()


def adapted_mm_hash(mm_hash: str, adapter_digest: str) -> str:
    """Content key of an image (or video) encoded by a tower run with a LoRA adapter
    (--enable-tower-lora) whose files hash to `adapter_digest` (transport/weights/lora_files.py):
    never the base tower's key, nor another adapter's, nor an older version's of the same."""
    return hashlib.blake2b(f"epd-mm-tower-lora-v1:{mm_hash}:{adapter_digest}".encode(), digest_size=32).hexdigest()


def audio_key_config(family: str, features: dict) -> dict:
    """The config an audio clip's `mm_hash` is taken with: its modality, the family (model_type)
    and its feature extractor's settings (docs/decisions/audio-items.md). The API keys a served
    clip with it and the encoder checks the key it computes the same way."""
    return {"modality": "audio", "family": family, "features": features}


@dataclass
class CacheStats:
    """Counters of one MMCache instance (this process only)."""

    queries: int = 0
    hits: int = 0
    puts: int = 0
    skipped_puts: int = 0
    space_failures: int = 0  # of skipped_puts: no room on the filesystem (or in the map)
    evictions: int = 0
    bad_entries: int = 0  # corrupt or foreign values seen
    read_errors: int = 0  # reads that LMDB failed (a damaged file): each a miss

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class MMCache:
    """LMDB-backed mm_hash -> MMEntry cache shared by processes on one host.

    Open once per process (LMDB forbids two handles on one env in a process,
    and a handle must not cross fork()). Keys are `mm_hash` hex strings.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int, readonly: bool = False, *,
                 model_fingerprint: str = "", touch_interval_s: float = 1.0,
                 low_water: float = 0.9):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.path, self.max_bytes, self.readonly = str(path), int(max_bytes), readonly
        self.model_fingerprint = model_fingerprint
        self.touch_interval_s, self.low_water = touch_interval_s, low_water
        self.stats = CacheStats()
        self._pending: dict[bytes, int] = {}  # key -> last-used ns, not yet written
        self._lock = threading.Lock()
        self._last_flush_s = time.monotonic()
        self._last_ns = 0
        self._closed = False
        self._warned: set[str] = set()
        opened = open_env(self.path, 2 * self.max_bytes + _MAP_SLACK_BYTES, readonly)
        self._env = None if opened is None else opened.env
        self._set_aside = opened is not None and opened.set_aside
        if opened is not None:
            self._entries, self._used, self._meta = opened.entries, opened.used, opened.meta

    @property
    def is_open(self) -> bool:
        """False when no environment could be opened: every lookup a miss, every put skipped."""
        return self._env is not None and not self._closed

    def faults(self) -> CacheFaults:
        """This instance's faults, for the worker's stats (and /metrics)."""
        s = self.stats
        return CacheFaults(serving=int(self.is_open), set_aside=int(self._set_aside), read_errors=s.read_errors,
                           bad_entries=s.bad_entries, space_failures=s.space_failures, skipped_puts=s.skipped_puts)

    def _warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message + " (warned once; see the cache's stats)", *args)

    # --- reads ---------------------------------------------------------------

    def get(self, key: str) -> MMEntry | None:
        """The entry for `key` as fresh CPU tensors, or None (miss, corrupt, foreign)."""
        raw_key = _key(key)
        self.stats.queries += 1
        try:
            entry = self._read(raw_key, lambda value: decode_entry(value, self.model_fingerprint))
        except WireError as e:
            self._drop_bad(raw_key, e)
            return None
        if entry is None:
            return None
        self.stats.hits += 1
        self._touch(raw_key)
        return entry

    def contains(self, key: str) -> bool:
        """True if a valid entry for `key` is present (checks framing, copies no tensors)."""
        raw_key = _key(key)
        try:
            return self._read(raw_key, lambda v: read_header(v, self.model_fingerprint)) is not None
        except WireError:
            return False

    __contains__ = contains

    def __len__(self) -> int:
        def read() -> int:
            with self._env.begin() as txn:
                return txn.stat(self._entries)["entries"]
        return self._read_or(0, read)

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all entry values, as tracked by writers (0 when unreadable)."""
        def read() -> int:
            with self._env.begin(db=self._meta) as txn:
                return _u64(txn.get(_TOTAL))
        return self._read_or(0, read)

    def _read(self, raw_key: bytes, parse):
        """Run `parse` on the value's map view inside one read txn; None if absent."""
        def read():
            with self._env.begin(db=self._entries, buffers=True) as txn:
                value = txn.get(raw_key)
                return None if value is None else parse(value)
        return self._read_or(None, read)

    def _read_or(self, default, read):
        """read(), or `default` when the cache is not open or LMDB fails the read."""
        if not self.is_open:
            return default
        try:
            return self._retry(read)
        except lmdb.Error as e:
            self.stats.read_errors += 1
            self._warn_once("read", "mm cache %s: a read failed (%s): a miss; the file may be damaged "
                            "(it is set aside when a worker next fails to open it)", self.path, e)
            return default

    def _retry(self, fn):
        """Run fn; if another process grew the map, adopt the new size and rerun once."""
        try:
            return fn()
        except lmdb.MapResizedError:
            self._env.set_mapsize(0)
            return fn()

    # --- writes --------------------------------------------------------------

    def put(self, key: str, entry: MMEntry) -> bool:
        """Store `entry` under `key`; True if it is in the cache afterwards.

        Never raises for cache conditions (full, oversize, LMDB errors): those
        skip the put with a warning. An entry that is not [n, hidden] is a ValueError.
        """
        raw_key = _key(key)
        if self.readonly:
            log.warning("put on a read-only mm cache ignored")
            return False
        if not self.is_open:
            self.stats.skipped_puts += 1
            return False
        value = encode_entry(entry, self.model_fingerprint)
        if len(value) > self.max_bytes:
            log.warning("mm cache entry of %d bytes exceeds the %d-byte cache: not cached",
                        len(value), self.max_bytes)
            self.stats.skipped_puts += 1
            return False
        limit = self.budget_bytes
        if len(value) > limit:
            return self._no_space(f"{len(value)} bytes to write, room for {limit} "
                                  f"(--mm-cache-gb allows {self.max_bytes})")
        budget = int(limit * self.low_water)
        if len(value) > budget:
            budget = limit
        for attempt in range(2):
            try:
                self._retry(lambda: self._write(raw_key, value, limit, budget))
                self.stats.puts += 1
                return True
            except lmdb.Error as e:
                if not is_space_error(e):
                    self.stats.skipped_puts += 1
                    self._warn_once("write", "mm cache %s: a write failed (%s): not cached", self.path, e)
                    return False
                if attempt == 1:
                    return self._no_space(str(e))
                # map overhead, or the filesystem filled under us: evict harder, once
                limit = budget = max(len(value), min(limit, self.budget_bytes) // 2)
        return False

    @property
    def budget_bytes(self) -> int:
        """Bytes of entries this cache keeps under: `max_bytes`, or less where its
        filesystem cannot hold that much (mm_cache_space.py; measured on every put)."""
        room = space_bytes(self.path)
        return self.max_bytes if room is None else min(self.max_bytes, room)

    def _no_space(self, detail: str) -> bool:
        """A put the filesystem (or the map) has no room for: skipped, counted, warned once."""
        self.stats.skipped_puts += 1
        self.stats.space_failures += 1
        free = free_bytes(self.path)
        self._warn_once("space", "the cache filesystem is full (%s; %s bytes free on the filesystem of %s): "
                        "new embeddings are not cached until space comes back (then caching resumes "
                        "by itself); skipped puts are counted", detail, free, self.path)
        return False

    def _write(self, raw_key: bytes, value: bytes, limit: int, budget: int) -> None:
        """Insert in one write txn; if that would exceed `limit`, evict down to `budget`."""
        with self._env.begin(write=True) as txn:
            self._flush_into(txn)
            now = _U64.pack(self._now_ns())
            total = _u64(txn.get(_TOTAL, db=self._meta))
            existing = txn.get(raw_key, db=self._entries)
            if existing is not None:
                try:
                    read_header(existing, self.model_fingerprint)
                    txn.put(raw_key, now, db=self._used)  # content-addressed: already there
                    return
                except WireError:  # replace a corrupt or foreign value
                    total = max(0, total - self._delete(txn, raw_key))
            if total + len(value) > limit:
                total = self._evict(txn, total, budget - len(value))
            txn.put(raw_key, value, db=self._entries)
            txn.put(raw_key, now, db=self._used)
            txn.put(_TOTAL, _U64.pack(total + len(value)), db=self._meta)

    def _evict(self, txn: lmdb.Transaction, total: int, target: int) -> int:
        """Delete least-recently-used entries until total <= target; return the new total."""
        used = {k: _u64(v) for k, v in txn.cursor(db=self._used).iternext()}
        keys = list(txn.cursor(db=self._entries).iternext(keys=True, values=False))
        keys.sort(key=lambda k: (used.get(k, 0), k))  # no used-time (foreign writer): first
        for key in keys:
            if total <= target:
                break
            total = max(0, total - self._delete(txn, key))
            self.stats.evictions += 1
        return total

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int:
        """Delete one entry; return its value size."""
        value = txn.pop(key, db=self._entries)
        txn.delete(key, db=self._used)
        return 0 if value is None else len(value)

    def _drop_bad(self, raw_key: bytes, error: Exception) -> None:
        self.stats.bad_entries += 1
        log.warning("mm cache entry %s unusable (%s): miss", raw_key.hex()[:16], error)
        if self.readonly or not self.is_open:
            return
        try:
            with self._env.begin(write=True) as txn:
                total = _u64(txn.get(_TOTAL, db=self._meta))
                total = max(0, total - self._delete(txn, raw_key))
                txn.put(_TOTAL, _U64.pack(total), db=self._meta)
        except lmdb.Error as e:
            self._warn_once("delete", "mm cache %s: could not delete a bad entry: %s", self.path, e)

    # --- recency -------------------------------------------------------------

    def _now_ns(self) -> int:
        # Strictly increasing within this process so back-to-back uses keep their order.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns

    def _touch(self, raw_key: bytes) -> None:
        if self.readonly:
            return
        with self._lock:
            self._pending[raw_key] = self._now_ns()
        if time.monotonic() - self._last_flush_s >= self.touch_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write buffered last-used times now (also done by put and close)."""
        if self.readonly or not self.is_open:
            return
        try:
            with self._env.begin(write=True) as txn:
                self._flush_into(txn)
        except lmdb.Error as e:
            self._warn_once("flush", "mm cache %s: writing recency failed: %s", self.path, e)

    def _flush_into(self, txn: lmdb.Transaction) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush_s = time.monotonic()
        for key, used_ns in pending.items():
            if txn.get(key, db=self._entries) is not None:  # never resurrect an evicted key
                txn.put(key, _U64.pack(used_ns), db=self._used)

    def close(self) -> None:
        """Flush recency and close the environment (idempotent)."""
        if not self._closed:
            self.flush()
            if self._env is not None:
                self._env.close()
            self._closed = True

    def __enter__(self) -> MMCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(mm_hash_hex: str) -> bytes:
    try:
        raw = bytes.fromhex(mm_hash_hex)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"mm_hash must be 64 hex chars, got {mm_hash_hex!r:.80}")
    return raw


def _u64(data: bytes | None) -> int:
    return 0 if data is None or len(data) != 8 else _U64.unpack(data)[0]
