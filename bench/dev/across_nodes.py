"""e-p-d across nodes against the same e-p-d on one node: `bench compare`'s
sweep, with placements instead of modes. Needs root (network namespaces).

Every placement serves e-p-d with one encoder, one prefill and one decode
worker, one thread each, niced as the launcher nices them; the API is in
its own namespace `h` and the load comes from outside, over the bridge.

    one-node      `epd serve --mode e-p-d` in `h`: workers on ipc sockets,
                  one shared embedding cache (what the launcher does)
    nodes         `epd serve --external-workers` in `h`, `epd worker` for the
                  encoder, prefill and decode in three more namespaces, each
                  its own cache (embeddings inline in EncodeDone, KV over tcp),
                  CURVE on every worker socket (the worker plane's keys)
    nodes@RATE    the same, every link shaped with `tc tbf` at RATE (e.g. 1gbit)

Namespaces share the machine's cores: this measures what crossing a
network stack, the encryption and the link rate cost the same processes,
not more compute (`--cpus` and `--cpu-sharing` are not used: one thread a
worker, on every core). Ray only places and restarts the same processes (its
data plane is the same ZeroMQ sockets), so it is left out of the timing.

    python -m bench.dev.across_nodes /tmp/small --placements one-node,nodes,nodes@1gbit \\
        --rates 0.05,0.1 --images-per-request 4 --image-size 336x336 --input-len 400 --output-len 32 \\
        --num-prompts 10 --slo-scale 3 --slo-probe-requests 3 --output-dir /tmp/bench/nodes
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.dev.netns import Host, Network
from epd.bench.compare import add_sweep_arguments, format_comparison, make_summary, sweep

API_PORT, WORKER_PORT = 18600, 18601
ROLES = ("encoder", "prefill", "decode")
# As the launcher nices them: a copy of epd.config.SHARED_CPU_NICE (this runs the servers
# as a user would, from the command line).
NICE = {"encoder": 4, "prefill": 2, "decode": 0}
COMMON = ["--dtype", "float32", "--device", "cpu"]


def parse_placement(label: str) -> tuple[str, str | None]:
    """'one-node' -> ('one-node', None); 'nodes@1gbit' -> ('nodes', '1gbit')."""
    kind, _, rate = label.partition("@")
    if kind not in ("one-node", "nodes") or (kind == "one-node" and rate):
        raise ValueError(f"--placements: {label!r} is not one-node, nodes or nodes@RATE (a tc rate such as 1gbit)")
    return kind, rate or None


class _Placement:
    """The processes of one placement, in the namespaces; ready when /health is 200."""

    def __init__(self, args, net: Network, hosts: dict[str, Host], label: str, out_dir: Path):
        kind, rate = parse_placement(label)
        api = hosts["h"]
        self.base_url = f"http://{api.ip}:{API_PORT}"
        self.procs: list[subprocess.Popen] = []
        self.out_dir = out_dir
        file_label = label.replace("@", "-")
        serve = [sys.executable, "-m", "epd.cli", "serve", args.model_dir, "--mode", "e-p-d", "--host", api.ip,
                 "--port", str(API_PORT), *COMMON, *args.server_args.split()]
        for host in hosts.values():  # a placement's links are its own: shaped, or not
            subprocess.run(["tc", "qdisc", "del", "dev", net.link(host), "root"], capture_output=True)
            if rate:
                net.shape(host, rate)
        if kind == "one-node":
            self.procs.append(api.popen([*serve, "--threads-per-worker", "1", "--num-kv-blocks",
                                         str(args.num_kv_blocks), "--mm-cache-dir", str(out_dir / "cache-one-node")],
                                        out_dir / f"server-{file_label}.log"))
            return
        keys = out_dir / "keys"
        if not keys.exists():
            subprocess.run([sys.executable, "-m", "epd.cli", "keys", str(keys)], check=True)
        self.procs.append(api.popen([*serve, "--external-workers", "--worker-port", str(WORKER_PORT),
                                     "--worker-keys", str(keys)], out_dir / f"server-{file_label}.log"))
        for role, name in zip(ROLES, "epd"):
            host = hosts[name]
            cmd = ["nice", "-n", str(NICE[role]), sys.executable, "-m", "epd.cli", "worker", args.model_dir,
                   "--role", role, "--api", f"tcp://{api.ip}:{WORKER_PORT}", "--host", host.ip,
                   "--threads", "1", "--worker-keys", str(keys), "--mm-cache-dir", str(out_dir / f"cache-{name}"),
                   *COMMON]
            if role != "encoder":
                cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
            self.procs.append(host.popen(cmd, out_dir / f"{file_label}-{role}.log"))

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process of the placement exited (see the logs in {self.out_dir})")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready after {timeout_s} s (see the logs in {self.out_dir})")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.base_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("epd:") and ("kv_transfer" in line or "encoder_inline" in line):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first, the API last (it would restart nothing: none are its own)
            if p.poll() is None:
                p.send_signal(2)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(args) -> dict:
    args.tokenizer = args.tokenizer or args.model_dir
    labels = [p for p in args.placements.split(",") if p]
    for label in labels:
        parse_placement(label)
    rates = sorted(float(r) for r in args.rates.split(","))
    if (args.slo_scale is None) == (args.slo_ttft_ms is None or args.slo_tpot_ms is None):
        raise ValueError("give either --slo-ttft-ms and --slo-tpot-ms, or --slo-scale")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ttft_slo, tpot_slo = args.slo_ttft_ms, args.slo_tpot_ms
    per_mode: dict[str, dict] = {}
    moved: dict[str, dict[str, float]] = {}
    with Network("epdb") as net:
        hosts = {name: net.add_host(name) for name in "hepd"}
        for label in labels:
            placement = _Placement(args, net, hosts, label, out_dir)
            try:
                placement.wait_ready()
                per_mode[label], ttft_slo, tpot_slo = sweep(args, placement.base_url, label, rates, ttft_slo,
                                                            tpot_slo, out_dir)
                moved[label] = placement.metrics()
            finally:
                placement.stop()
    summary = make_summary(args, labels, rates, set(os.sched_getaffinity(0)), ttft_slo, tpot_slo, per_mode)
    summary["transfers"] = moved  # KV and inline-embedding counters at the end of each placement's sweep
    print(format_comparison(summary))
    for label, m in moved.items():
        kv_bytes = sum(v for k, v in m.items() if k.startswith("epd:kv_transfer_bytes_total"))
        kv_s = sum(v for k, v in m.items() if k.startswith("epd:kv_transfer_seconds_sum"))
        kv_n = sum(v for k, v in m.items() if k.startswith("epd:kv_transfer_seconds_count"))
        inline = sum(v for k, v in m.items() if k.startswith("epd:encoder_inline_bytes_total"))
        print(f"{label:>12}: KV {kv_bytes / 1e6:.1f} MB in {kv_n:.0f} transfers"
              + (f", {kv_s / kv_n * 1e3:.0f} ms each" if kv_n else "") + f"; embeddings inline {inline / 1e6:.1f} MB")
    (out_dir / "across_nodes.json").write_text(json.dumps(summary, indent=2))
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dev.across_nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="checkpoint directory to serve")
    p.add_argument("--placements", default="one-node,nodes,nodes@1gbit",
                   help="comma-separated one-node | nodes | nodes@RATE; the first is the base")
    p.add_argument("--num-kv-blocks", type=int, default=512)
    add_sweep_arguments(p)
    return p


if __name__ == "__main__":
    main(build_parser().parse_args())
