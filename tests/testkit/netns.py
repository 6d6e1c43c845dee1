"""Multi-node tests' hosts: network namespaces (bench/dev/netns.py: `Network`,
`Host`) and Ray nodes in them (`RayCluster`). `skip_reason()` says why this
machine cannot (not root, no `ip`, no Ray, no namespaces).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.dev.netns import Host, Network

__all__ = ["Host", "Network", "RayCluster", "skip_reason"]

RAY_START_TIMEOUT_S = 120.0


def skip_reason() -> str | None:
    """Why multi-node tests cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install epd[ray])"
    probe = f"epdt-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


class RayCluster:
    """Ray nodes in namespaces, sharing one token (RAY_AUTH_MODE=token)."""

    def __init__(self, workdir: Path, head: Host, port: int = 6379):
        self.workdir = Path(workdir)
        self.head = head
        self.address = f"{head.ip}:{port}"
        self.port = port
        # Ray's session files hold unix sockets (107 bytes at most): a short path, not the workdir
        # (pytest-xdist's tmp paths are longer); removed by whoever made the cluster
        self.ray_tmp = tempfile.mkdtemp(prefix="epdt-ray-")
        token = self.workdir / "ray-token"
        token.write_text(os.urandom(16).hex())
        token.chmod(0o600)
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                        RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                        RAY_DEDUP_LOGS="0",  # the tests read every worker's own start-up line from the log
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
                                  f"--temp-dir={self.ray_tmp}"])])

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
