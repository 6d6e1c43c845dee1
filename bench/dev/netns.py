"""Hosts with their own IP addresses on one machine: network namespaces on a
private bridge (iproute2), for multi-node tests and link benchmarks. Needs root.

    with Network("epdt") as net:           # a bridge, no route out
        head = net.add_host("h")           # namespace + veth + 10.x.y.N/24, loopback up
        head.popen([...], log)             # a process inside it
        net.shape(head, "1gbit")           # tc tbf on what `head` receives
    # on exit, pass or fail: every process in the namespaces killed,
    # namespaces, veths and the bridge deleted

The bridge carries an address too, so a process outside every namespace can
reach a server inside one; nothing is routed beyond the bridge.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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

    def shape(self, host: Host, rate: str) -> None:
        """Token bucket (tc tbf) at `rate` ("1gbit") on what `host` receives; netem is not used."""
        out = subprocess.run(["tc", "qdisc", "replace", "dev", self.link(host), "root", "tbf", "rate", rate,
                              "burst", "4mb", "latency", "100ms"], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"tc on {self.link(host)}: {out.stderr.strip()}")

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
