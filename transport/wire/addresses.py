"""Where every socket lives: the one place a ZeroMQ address is built.

Each worker binds one PULL socket (its inbox) at `worker(role, index)`; the
API binds one PULL socket (the collector: TokenOutput, WorkerStats, Ready) at
`collector()`. Everyone else connects PUSH sockets to those.

* `ipc://` on one host: `ipc://<run_dir>/<role>-<index>.sock`, `<run_dir>/api.sock`.
* `tcp://` across hosts: collector at `base_port`, worker k of role r at
  `base_port + 1 + r * max_workers_per_role + k` (r = position in `Role`);
  a single endpoint (the collector `epd worker` registers with, its own
  inbox) is `tcp_address(host, port)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from epd.transport.wire.roles import Role

DEFAULT_BASE_PORT = 27100
MAX_API_SERVERS = 64  # `epd serve --api-servers` at most (a PrefillRequest's api_index is below it)
_MAX_IPC_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


@dataclass(frozen=True)
class Addresses:
    """Addresses of one deployment. Build with `ipc(...)`, `for_run(...)` or `tcp(...)`."""

    scheme: str  # "ipc" | "tcp"
    run_dir: str = ""  # ipc only
    host: str = "127.0.0.1"  # tcp only
    base_port: int = DEFAULT_BASE_PORT  # tcp only
    max_workers_per_role: int = 64

    @classmethod
    def ipc(cls, run_dir: str | os.PathLike) -> Addresses:
        """Unix-socket addresses under `run_dir` (created by whoever binds)."""
        return cls(scheme="ipc", run_dir=os.path.abspath(run_dir))

    @classmethod
    def for_run(cls, run_id: str, root: str = "/tmp") -> Addresses:
        """ipc addresses under `<root>/epd-<run_id>/`."""
        return cls.ipc(os.path.join(root, f"epd-{run_id}"))

    @classmethod
    def tcp(cls, host: str = "127.0.0.1", base_port: int = DEFAULT_BASE_PORT,
            max_workers_per_role: int = 64) -> Addresses:
        """TCP addresses on `host` (loopback by default) from `base_port` up."""
        last = base_port + len(Role) * max_workers_per_role
        if not (0 < base_port and last <= 65535):
            raise ValueError(f"port range {base_port}..{last} is outside 1..65535")
        return cls(scheme="tcp", host=host, base_port=base_port,
                   max_workers_per_role=max_workers_per_role)

    def worker(self, role: Role | str, index: int) -> str:
        """Inbox (PULL) address of worker `index` of `role`."""
        role = Role.parse(role)
        if not 0 <= index < self.max_workers_per_role:
            raise ValueError(f"worker index {index} outside 0..{self.max_workers_per_role - 1}")
        if self.scheme == "ipc":
            return self._ipc(f"{role}-{index}.sock")
        offset = 1 + list(Role).index(role) * self.max_workers_per_role + index
        return tcp_address(self.host, self.base_port + offset)

    def collector(self, api_index: int = 0) -> str:
        """API process `api_index`'s PULL address (`--api-servers`): token
        outputs, stats and Ready messages. Process 0's is the single API's."""
        if self.scheme == "ipc":
            return self._ipc("api.sock" if api_index == 0 else f"api-{api_index}.sock")
        if api_index:
            raise ValueError("tcp addresses have one collector")
        return tcp_address(self.host, self.base_port)

    def _ipc(self, name: str) -> str:
        path = os.path.join(self.run_dir, name)
        if len(path.encode()) > _MAX_IPC_PATH_BYTES:
            raise ValueError(f"ipc socket path too long ({len(path)} > 107 bytes): {path}")
        return f"ipc://{path}"


def tcp_address(host: str, port: int) -> str:
    """`tcp://host:port`; ValueError for a port outside 1..65535."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is outside 1..65535")
    return f"tcp://{host}:{port}"


def is_tcp_address(address: str) -> bool:
    """Whether `address` is `tcp://HOST:PORT` with a port in 1..65535."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    return address.startswith("tcp://") and bool(host and sep) and port.isdigit() and 0 < int(port) < 65536


def is_peer_address(address: str) -> bool:
    """Whether a peer may name `address` for us to connect to: `ipc://` and an
    absolute path that fits a unix socket, or `tcp://HOST:PORT` with a host
    name, an IPv4 address or a bracketed IPv6 one (no wildcard) and a port in
    1..65535. What ZeroMQ would refuse to connect to is refused here, where a
    message is decoded, not where a loop sends to it."""
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        return path.startswith("/") and "\0" not in path and len(path.encode()) <= _MAX_IPC_PATH_BYTES
    if not is_tcp_address(address):
        return False
    host = address[len("tcp://"):].rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        return len(host) > 2 and all(c in _IPV6_CHARS for c in host[1:-1])
    return len(host) <= 253 and all(c in _HOST_CHARS for c in host) and not host.startswith(("-", "."))


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
_IPV6_CHARS = frozenset("0123456789abcdefABCDEF:.%")


def worker_id(role: Role | str, index: int) -> str:
    """The canonical worker id, e.g. "prefill-0" (used as EncodeRequest.reply_to etc.)."""
    return f"{role}-{index}"


def parse_worker_id(worker_id_: str) -> tuple[Role, int]:
    """Inverse of `worker_id`: "prefill-0" -> ("prefill", 0); ValueError if malformed."""
    role, sep, index = worker_id_.rpartition("-")
    if not sep or role not in set(Role) or not index.isdigit():
        raise ValueError(f"bad worker id {worker_id_!r}")
    return Role(role), int(index)
