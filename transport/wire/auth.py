"""Worker-plane keys: ZeroMQ CURVE on every tcp socket of the worker plane.

Two key pairs, made once by `epd keys DIR` (`make_keys`) and copied to the
hosts that need them:

    api.key, worker.key                every host (public halves)
    api.key_secret                     the API host only
    worker.key_secret                  every host that runs workers

Every socket that binds on tcp is a CURVE server with its process's own pair
(the API's collector: api; a worker's inbox: worker) and admits, through
ZeroMQ's authentication protocol (ZAP), only clients presenting a public key
of the plane: the collector admits workers, an inbox admits the API and
other workers. A peer without a secret key of the plane cannot complete the
handshake, so its frames never reach our code: a forged `Ready` or `Shutdown`
from outside is dropped at the socket. Inside the plane, a `Shutdown` counts
only when the API's key sent it (`Receiver` checks the frame's User-Id).

ipc sockets (one host) carry no CURVE: they live in the launcher's 0700 run
directory, which only the user running `epd serve` can reach.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

API, WORKER = "api", "worker"
# ZAP domains: which clients a bound socket admits
COLLECTOR_DOMAIN = "epd-collector"  # the API's collector: workers only
INBOX_DOMAIN = "epd-inbox"  # a worker's inbox: the API and other workers


class PlaneKeyError(ValueError):
    """Keys missing, unreadable or malformed; the message names the file."""


def make_keys(directory: str | os.PathLike) -> Path:
    """Writes the plane's two key pairs into `directory` (created 0700; secret
    files 0600). Refuses to overwrite existing keys."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    existing = [n for n in (f"{API}.key", f"{WORKER}.key") if (directory / n).exists()]
    if existing:
        raise PlaneKeyError(f"{directory} already holds keys ({', '.join(existing)}); remove them or use another directory")
    for name in (API, WORKER):
        _, secret_file = zmq.auth.create_certificates(str(directory), name)
        os.chmod(secret_file, 0o600)
    return directory


@dataclass(frozen=True)
class PlaneKeys:
    """This process's identity on the worker plane (z85-encoded keys)."""

    role: str  # API or WORKER: whose secret this process holds
    public: bytes
    secret: bytes
    api_public: bytes
    worker_public: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike, role: str) -> PlaneKeys:
        """Reads both public keys and `role`'s secret key from `directory`."""
        if role not in (API, WORKER):
            raise ValueError(f"role must be {API!r} or {WORKER!r}, got {role!r}")
        directory = Path(directory)
        api_public, _ = _read(directory / f"{API}.key", secret=False)
        worker_public, _ = _read(directory / f"{WORKER}.key", secret=False)
        public, secret = _read(directory / f"{role}.key_secret", secret=True)
        if public != (api_public if role == API else worker_public):
            raise PlaneKeyError(f"{directory / f'{role}.key_secret'} does not belong to {directory / f'{role}.key'}")
        return cls(role, public, secret, api_public, worker_public)

    @property
    def api_user_id(self) -> str:
        """The User-Id ZeroMQ gives frames that the API sent."""
        return self.api_public.decode("ascii")

    def server_key(self, address: str, api_address: str | tuple[str, ...]) -> bytes:
        """The public key of whoever binds `address`: the API binds its collector(s), workers their inboxes."""
        apis = (api_address,) if isinstance(api_address, str) else api_address
        return self.api_public if address in apis else self.worker_public

    def admits(self, domain: str, client_key: bytes) -> bool:
        allowed = {COLLECTOR_DOMAIN: (self.worker_public,),
                   INBOX_DOMAIN: (self.api_public, self.worker_public)}.get(domain, ())
        return client_key in allowed


def _read(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise PlaneKeyError(f"cannot read worker-plane key {path}: {exc} (make keys with `epd keys DIR`)") from None
    if secret and not secret_key:
        raise PlaneKeyError(f"{path} holds no secret key")
    return public, secret_key


class _Admission:
    """ZAP credentials provider: the plane's keys per domain."""

    def __init__(self, keys: PlaneKeys):
        self.keys = keys

    def callback(self, domain: str, client_key: bytes) -> bool:
        return self.keys.admits(domain, client_key)


# one ZAP handler per ZeroMQ context (a process has one or two), with the admission it asks
_guards: dict[int, tuple[ThreadAuthenticator, _Admission]] = {}
_guards_lock = threading.Lock()


def guard(ctx: zmq.Context, keys: PlaneKeys) -> None:
    """Starts the ZAP handler for `ctx` once; bound CURVE sockets of that context
    ask it which clients to admit. Called again with other keys (a process that
    serves a second plane after the first, as tests do), it admits by those."""
    underlying = ctx.underlying
    with _guards_lock:
        if underlying in _guards:
            _guards[underlying][1].keys = keys
            return
        auth = ThreadAuthenticator(zmq.Context.shadow(underlying))
        auth.start()
        admission = _Admission(keys)
        for domain in (COLLECTOR_DOMAIN, INBOX_DOMAIN):
            auth.configure_curve_callback(domain, credentials_provider=admission)
        _guards[underlying] = (auth, admission)


def secure_server(sock: zmq.Socket, keys: PlaneKeys, domain: str) -> None:
    """Makes a socket about to bind a CURVE server admitting `domain`'s clients."""
    guard(sock.context, keys)
    sock.zap_domain = domain.encode()
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: PlaneKeys, server_key: bytes) -> None:
    """Makes a socket about to connect a CURVE client with this process's pair."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key
