"""What a shaped link between two nodes costs a KV or embedding transfer.

Two network namespaces on a bridge (bench/dev/netns.py), each link shaped
with `tc tbf` at the given rates. A sender in one namespace pushes messages
of the given sizes to a receiver in the other over ZeroMQ tcp (CURVE, as the
worker plane), which acks each one: the time from send to ack is one
transfer, as `epd:kv_transfer_seconds` times a KV transfer. Needs root.

    python -m bench.dev.link_kv --sizes 23855104,3686400 --rates none,10gbit,1gbit --repeats 5

Latency is not emulated (netem is not available here); add it by
calculation (one round trip per transfer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import zmq

from bench.dev.checkout import checkout_env, python_m
from bench.dev.netns import Network

PORT, ACK_PORT = 18900, 18901


def _keys(curve: bool) -> dict[str, str] | None:
    if not curve:
        return None
    public, secret = zmq.curve_keypair()
    return {"public": public.decode(), "secret": secret.decode()}


def receiver(ip: str, peer: str, key: dict, count: int) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    if key:
        pull.curve_server, pull.curve_secretkey, pull.curve_publickey = (True, key["secret"].encode(),
                                                                         key["public"].encode())
    pull.bind(f"tcp://{ip}:{PORT}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://{peer}:{ACK_PORT}")
    for _ in range(count):
        frames = pull.recv_multipart(copy=False)
        push.send(str(sum(len(f.buffer) for f in frames)).encode())
    ctx.destroy(linger=1000)


def sender(ip: str, peer: str, key: dict, sizes: list[int], repeats: int) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    if key:
        client_public, client_secret = zmq.curve_keypair()
        push.curve_serverkey, push.curve_publickey, push.curve_secretkey = (key["public"].encode(), client_public,
                                                                             client_secret)
    push.connect(f"tcp://{peer}:{PORT}")
    acks = ctx.socket(zmq.PULL)
    acks.bind(f"tcp://{ip}:{ACK_PORT}")
    out = {}
    for size in sizes:
        payload = bytes(size)
        times = []
        for _ in range(repeats + 1):  # the first one also connects: not counted
            start = time.perf_counter()
            push.send_multipart([b"h", payload], copy=False)
            assert int(acks.recv()) == size + 1
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times[1:])
    print(json.dumps(out), flush=True)
    ctx.destroy(linger=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="23855104,3686400", help="bytes per message, comma-separated")
    p.add_argument("--rates", default="none,10gbit,1gbit", help="tc tbf rates ('none': unshaped)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--curve", choices=["on", "off", "both"], default="both",
                   help="ZeroMQ CURVE (the worker plane's encryption) on the connection")
    p.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--args", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.role:
        a = json.loads(args.args)
        if args.role == "receiver":
            receiver(a["ip"], a["peer"], a["key"], len(sizes) * (args.repeats + 1))
        else:
            sender(a["ip"], a["peer"], a["key"], sizes, args.repeats)
        return
    rows = []
    with Network("epdl") as net, tempfile.TemporaryDirectory() as tmp:
        a, b = net.add_host("a"), net.add_host("b")
        for rate, curve in [(r, c) for r in args.rates.split(",")
                            for c in ({"on": [True], "off": [False]}.get(args.curve, [True, False]))]:
            key = _keys(curve)
            for host in (a, b):
                if rate != "none":
                    net.shape(host, rate)
            common = [*python_m("link_kv"), "--sizes", args.sizes, "--repeats", str(args.repeats)]
            recv = b.popen([*common, "--role", "receiver", "--args",
                            json.dumps({"ip": b.ip, "peer": a.ip, "key": key})], Path(tmp) / "recv.log",
                           env=checkout_env())
            out = a.run([*common, "--role", "sender", "--args", json.dumps({"ip": a.ip, "peer": b.ip, "key": key})],
                        env=checkout_env(), timeout_s=600)
            recv.wait(timeout=60)
            if out.returncode != 0:
                raise SystemExit(f"sender failed: {out.stderr}")
            for size, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
                rows.append((rate, "on" if curve else "off", int(size), seconds))
    print("| link (tc tbf) | CURVE | message bytes | median send-to-ack (ms) | effective Gbit/s |")
    print("|---|---|---:|---:|---:|")
    for rate, curve, size, seconds in rows:
        print(f"| {rate} | {curve} | {size:,} | {seconds * 1000:.1f} | {size * 8 / seconds / 1e9:.2f} |")


if __name__ == "__main__":
    main()
