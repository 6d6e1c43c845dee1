"""Hosts with their own IP addresses on one machine, for multi-node tests:
network namespaces on a private bridge (iproute2), Ray nodes in them.

    with Network("epdt") as net:           # a bridge, no route out
        head = net.add_host("h")           # namespace + veth + 10.x.y.1/24, loopback up
        head.popen([...])                  # a process inside it
        start_ray_node(head, ...)          # `ray start` inside it
    # on exit, pass or fail: every process in the namespaces killed,
    # namespaces, veths and the bridge deleted

The bridge carries an address too, so the test process (outside every
namespace) can reach a server inside one; nothing is routed beyond the bridge.
`skip_reason()` says why this machine cannot (not root, no `ip`, no Ray,
no namespaces).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

RAY_START_TIMEOUT_S = 120.0


def skip_reason() -> str | None:
    """Why multi-node tests cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install epd[ray])"
    probe = f"epdt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


class Host:
    """One namespace: a machine with its own address."""

    def __init__(self, net: Network, name: str, ns: str, ip: str):
        self.net, self.name, self.ns, self.ip = net, name, ns, ip

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def run(self, args: list[str], env: dict | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args), capture_output=True, text=True, env=env, timeout=timeout_s)

    def popen(self, args: list[str], log_path: str | Path, env: dict | None = None) -> subprocess.Popen:
        log = open(log_path, "w")
        proc = subprocess.Popen(self.command(args), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        log.close()
        return proc

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """Kills every process in this namespace (a node lost); returns how many."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)


class Network:
    """A bridge and the namespaces on it; everything removed on close, pass or fail."""

    def __init__(self, prefix: str = "epdt"):
        self.tag = f"{prefix}{os.getpid() % 100000}"  # names stay under 15 bytes (IFNAMSIZ)
        self.bridge = f"{self.tag}br"
        self.subnet = f"10.{200 + os.getpid() % 50}.{(os.getpid() // 50) % 250}"
        self.hosts: list[Host] = []

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def bridge_ip(self) -> str:
        return f"{self.subnet}.254"

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        ns, outer = f"{self.tag}-{name}", f"{self.tag}v{index}"
        host = Host(self, name, ns, f"{self.subnet}.{index}")
        self.hosts.append(host)  # before anything is made: close() removes whatever was
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        for args in (("addr", "add", f"{host.ip}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                     ("link", "set", "lo", "up")):
            _ip("-n", ns, *args)
        return host

    def link(self, host: Host) -> str:
        """The bridge-side veth of `host` (where `tc` shapes what the host receives)."""
        return f"{self.tag}v{self.hosts.index(host) + 1}"

    def close(self) -> None:
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:  # processes may fork while we kill
            if not sum(host.kill_all() for host in self.hosts if _ns_exists(host.ns)):
                break
            time.sleep(0.3)
        for host in self.hosts:
            _ip("netns", "delete", host.ns, check=False)  # takes its veth pair along
            _ip("link", "delete", f"{self.tag}v{self.hosts.index(host) + 1}", check=False)
        _ip("link", "delete", self.bridge, check=False)


def _ns_exists(ns: str) -> bool:
    return ns in _ip("netns", "list", check=False).stdout.split()


class RayCluster:
    """Ray nodes in namespaces, sharing one token (RAY_AUTH_MODE=token)."""

    def __init__(self, workdir: Path, head: Host, port: int = 6379):
        self.workdir = Path(workdir)
        self.head = head
        self.address = f"{head.ip}:{port}"
        self.port = port
        token = self.workdir / "ray-token"
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                        RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                        # a lost node is declared dead after ~3 s instead of ~15 s
                        RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
                        RAY_health_check_failure_threshold="3", RAY_health_check_initial_delay_ms="1000")
        self.env.pop("RAY_ADDRESS", None)

    def add_nodes(self, nodes: list[tuple[Host, int, dict[str, float]]]) -> None:
        """Joins (host, CPUs, custom resources) nodes to the head, one by one (a
        raylet must register within Ray's 30 s, which a busy 2-core machine
        misses when several start at once)."""
        import json

        for host, num_cpus, resources in nodes:
            self._start([(host, [f"--address={self.address}", f"--num-cpus={num_cpus}",
                                 f"--resources={json.dumps(resources)}"])])

    def start_head(self) -> None:
        self._start([(self.head, ["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
                                  f"--temp-dir={self.workdir / 'ray'}"])])

    def _start(self, nodes: list[tuple[Host, list[str]]]) -> None:
        procs = []
        for host, args in nodes:
            cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={host.ip}",
                   "--object-store-memory=80000000", "--disable-usage-stats", *args]
            procs.append((host, subprocess.Popen(host.command(cmd), env=self.env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True)))
        failed = []
        for host, proc in procs:  # every `ray start` ends before we judge (or clean up)
            try:
                out, _ = proc.communicate(timeout=RAY_START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            if proc.returncode != 0:
                failed.append(f"ray start on {host.name} failed:\n{out[-3000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
