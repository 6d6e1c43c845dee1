"""`SharedLoRARegistry`: the adapters served by name, one registry for every API
process of a server (`epd serve --api-servers N`, N > 1).

Each API process keeps its own `LoRARegistry` otherwise, so a runtime load
(POST /v1/load_lora_adapter) would reach only the process the client's
connection landed on. Here the registry is a small JSON file in the run
directory, shared by the N processes:

    <run dir>/loras.json   {"next_id": n, "adapters": [{"name", "path", "base_model_name", "id"}, ...]}
      written whole (a temporary file, then os.replace) under an flock on
      <run dir>/loras.json.lock: make (takes an id), add, remove
      read again by a process when its stat (inode, mtime, size) changed: every
      lookup (a request naming an adapter, /v1/models) sees the latest state

The first process to start writes --lora-modules into it; a restarted one
finds the runtime loads there. The workers are common to every API process,
so the process that takes a load or unload tells them, once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator

from epd.lora_modules import LoRAModule, LoRARegistry
from epd.transport.wire.lora_request import LoRARequest

REGISTRY_FILE = "loras.json"


class SharedLoRARegistry(LoRARegistry):
    """A `LoRARegistry` whose state lives in the file `path`, shared by the API processes."""

    def __init__(self, path: str, modules: tuple[LoRAModule, ...] = ()):
        super().__init__(modules)
        self.path = path
        self._seen: tuple[int, int, int] | None = None  # the file's (inode, mtime, size) as last read
        with self._locked():
            if not os.path.exists(path):
                self._write()  # the first process: --lora-modules
            self._read()

    def get(self, name: str) -> LoRARequest | None:
        self._refresh()
        return super().get(name)

    def module(self, name: str) -> LoRAModule | None:
        self._refresh()
        return super().module(name)

    @property
    def names(self) -> list[str]:
        self._refresh()
        return list(self._modules)

    def make(self, name: str, path: str) -> LoRARequest:
        with self._changing():
            return super().make(name, path)

    def add(self, module: LoRAModule, lora: LoRARequest) -> None:
        with self._changing():
            super().add(module, lora)

    def remove(self, name: str) -> LoRARequest:
        with self._changing():
            return super().remove(name)

    # -- the file ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held for a read and a write of a few hundred bytes
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The latest state, changed inside, written back; nothing written if it raises."""
        with self._locked():
            self._read()
            yield
            self._write()

    def _refresh(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:  # the run dir is going away with the server
            return
        if (stat.st_ino, stat.st_mtime_ns, stat.st_size) != self._seen:
            with self._locked():
                self._read()

    def _read(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            stat = os.fstat(f.fileno())
            state = json.load(f)
        self._modules = {a["name"]: LoRAModule(a["name"], a["path"], a["base_model_name"])
                         for a in state["adapters"]}
        self._requests = {a["name"]: LoRARequest(a["name"], a["id"], os.path.abspath(a["path"]))
                          for a in state["adapters"]}
        self._next_id = state["next_id"]
        self._seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    def _write(self) -> None:
        adapters = [{"name": name, "path": m.path, "base_model_name": m.base_model_name,
                     "id": self._requests[name].lora_int_id} for name, m in self._modules.items()]
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=REGISTRY_FILE + ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"next_id": self._next_id, "adapters": adapters}, f)
        os.replace(tmp, self.path)
        stat = os.stat(self.path)
        self._seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
