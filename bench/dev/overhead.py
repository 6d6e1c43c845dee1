"""`python -m bench.dev.overhead`: what serving costs over the offline engine, same checkpoint, same requests.

Text only, greedy, EOS ignored, so every request makes exactly its tokens.
For each concurrency C, C * `--requests-per-stream` prompts of random token
ids (seeded by C) run
  * offline: `LLM(max_num_seqs=C).generate(all)` in this process, with one
    torch thread per core of the CPU set (the engine alone, detokenizer
    included);
  * served: `epd serve` in each `--modes` mode, pinned to the same CPU set,
    fed by C closed-loop streams (a stream sends its next request when the
    last one ended) of streamed /v1/completions with the same token ids.
It reports output tokens/s of both and their ratio, and then requests/s of
one-token requests the same way. With `--rounds R` each server runs every
C R times, each served run right after an offline run of the same requests
(the machine's speed drifts between minutes here, so a ratio is taken
between neighbours), and the table gives the median ratio with its range.
The client is `bench/dev/light_client.py` (raw asyncio HTTP, one parse per response, `--client-procs` processes); its
CPU time is reported to show it is not the bottleneck. The API's CPU time per
output token comes from /proc/<pid>/stat of every API process: the launcher
itself, or with `--api-servers N` the N processes its log names (`EPD: API
server k pid P`), summed; the launcher's other children are the workers,
reported apart. `--server-args` may be given more than once: each server
configuration runs in turn against the same offline numbers (a side-by-side
comparison in one run). `--profile-dir` adds, per server, one more run at
the largest C and one of one-token requests under py-spy (one sampler per
API process, from outside) and prints their top functions by own time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.dev.light_client import completion_body, run_in_processes
from epd.bench.compare import ServeProcess, cpu_set

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (e.g. `epd make-model DIR --preset tiny`)")
    p.add_argument("--modes", default="aggregated,e-p-d", help="comma-separated `epd serve --mode` values")
    p.add_argument("--concurrency", default="32,128", help="comma-separated numbers of concurrent streams")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--one-token-requests", type=int, default=1024,
                   help="one-token requests for the requests/s row (0: skip it)")
    p.add_argument("--one-token-concurrency", type=int, default=32)
    p.add_argument("--offline-threads", type=int, default=None,
                   help="torch threads of the offline engine (default: one per core of the CPU set)")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks of the offline engine and each server")
    p.add_argument("--cpus", default=None, help="CPU list for the offline engine and the servers, e.g. 0-1 "
                                               "(default: all this process may use)")
    p.add_argument("--server-args", action="append", default=None,
                   help="extra `epd serve` flags, e.g. '--api-servers 2'; repeat it to compare configurations "
                        "side by side in one run")
    p.add_argument("--client-procs", type=int, default=1, help="client processes the streams are dealt over")
    p.add_argument("--rounds", type=int, default=1,
                   help="offline-then-served pairs per server and C; the table shows the median ratio and its range")
    p.add_argument("--profile-dir", default=None,
                   help="also profile the API process with py-spy at the largest C; raw stacks go here")
    p.add_argument("--save-result", default=None, metavar="FILE")


def workload(vocab_size: int, num: int, input_len: int, seed: int) -> list[list[int]]:
    """`num` prompts of `input_len` random token ids (clear of the special tokens at the start)."""
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab_size) for _ in range(input_len)] for _ in range(num)]


# -- offline -----------------------------------------------------------------------------------

def offline_rate(model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                 num_kv_blocks: int) -> float:
    """Output tokens/s of `LLM.generate` on `prompts`, at most `concurrency` running at once."""
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(model, max_num_seqs=concurrency, num_kv_blocks=num_kv_blocks)
    params = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][::-1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_tokens == output_len * len(prompts), num_tokens
    del llm
    gc.collect()
    return num_tokens / elapsed


# -- served ------------------------------------------------------------------------------------

def _parent_and_cpu_s(pid: int) -> tuple[int, float]:
    """Process `pid`'s parent pid and user + system CPU seconds (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _live_processes() -> dict[int, tuple[int, float]]:
    """Every live process: pid -> (parent pid, CPU seconds); one that exits while read is left out."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                processes[int(entry)] = _parent_and_cpu_s(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return processes


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    return _parent_and_cpu_s(pid)[1]


def children_cpu_s(pid: int, excluded: set[int] = frozenset()) -> float:
    """CPU seconds of the live direct children of `pid` but `excluded` (the server's workers)."""
    return sum(cpu_s for child, (parent, cpu_s) in _live_processes().items() if parent == pid and child not in excluded)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and all its live descendants (a server and every worker it started)."""
    processes = _live_processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += processes.get(current, (0, 0.0))[1]
        todo += children.get(current, [])
    return total


def steal_s() -> float:
    """CPU seconds the hypervisor gave to others while this machine's CPUs wanted
    to run (/proc/stat's steal, all CPUs): the noise a VM adds to every rate here."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / CLOCK_TICKS if fields[0] == "cpu" and len(fields) > 8 else 0.0


_API_PID = re.compile(r"^EPD: API server (\d+) pid (\d+)$", re.MULTILINE)


def api_pids(launcher_pid: int, log: str) -> list[int]:
    """The API processes of an `epd serve`: with --api-servers N, the latest pid its
    log names for each index; otherwise the launcher, which serves HTTP itself."""
    latest = {int(index): int(pid) for index, pid in _API_PID.findall(log)}
    return [latest[k] for k in sorted(latest)] or [launcher_pid]


def _api_cpu(server: ServeProcess) -> tuple[list[int], list[float], float, float]:
    """(API pids, each one's CPU seconds, the workers' CPU seconds, the launcher's when
    it is not the API process) now."""
    pids = api_pids(server.proc.pid, Path(server.log_path).read_text())
    launcher_s = 0.0 if pids == [server.proc.pid] else process_cpu_s(server.proc.pid)
    return pids, [process_cpu_s(p) for p in pids], children_cpu_s(server.proc.pid, set(pids)), launcher_s


def start_server(model: str, mode: str, cpus: list[int], extra: list[str], log_path: Path) -> ServeProcess:
    """`epd serve` pinned to `cpus`, float32 on the CPU as the offline engine runs."""
    return ServeProcess(model, mode, cpus, ["--dtype", "float32", "--device", "cpu", *extra], log_path)


def served_run(server: ServeProcess, model_name: str, prompts: list[list[int]], output_len: int, concurrency: int,
               client_procs: int) -> dict:
    """One closed-loop run: tokens/s, requests/s, and CPU of the API, its workers and the client."""
    bodies = [completion_body(model_name, p, output_len) for p in prompts]
    streams = [bodies[i::concurrency] for i in range(concurrency)]
    pids, api_0, workers_0, launcher_0 = _api_cpu(server)
    steal_0 = steal_s()
    results = run_in_processes("127.0.0.1", server.port, "/v1/completions", streams, client_procs)
    steal_1 = steal_s()
    pids_1, api_1, workers_1, launcher_1 = _api_cpu(server)
    if pids_1 != pids:
        raise RuntimeError(f"an API process was restarted during the run ({pids} -> {pids_1})")
    api_each_s = [b - a for a, b in zip(api_0, api_1)]
    api_s = sum(api_each_s)
    workers_s = workers_1 - workers_0
    failed = sum(r.num_failed for r in results)
    if failed:
        raise RuntimeError(f"{failed} requests failed; the first: {next(r.first_error for r in results if r.first_error)}")
    duration_s = max(r.end_s for r in results) - min(r.start_s for r in results)
    num_tokens = sum(r.num_output_tokens for r in results)
    num_requests = sum(r.num_requests for r in results)
    return {"duration_s": duration_s, "output_tokens": num_tokens, "requests": num_requests,
            "tok_s": num_tokens / duration_s, "req_s": num_requests / duration_s,
            "api_processes": len(pids), "api_cpu_s": api_s, "api_cpu_s_each": api_each_s,
            "api_us_per_token": api_s / num_tokens * 1e6,
            "api_us_per_request": api_s / num_requests * 1e6, "api_cores": api_s / duration_s,
            "workers_cores": workers_s / duration_s, "launcher_cores": (launcher_1 - launcher_0) / duration_s,
            "client_cores": sum(r.cpu_s for r in results) / duration_s,
            "client_us_per_token": sum(r.cpu_s for r in results) / num_tokens * 1e6,
            "steal_cores": (steal_1 - steal_0) / duration_s}


def profile_run(server: ServeProcess, run, out_path: Path) -> list[tuple[str, float]]:
    """`run()` with py-spy sampling every API process (raw stacks: `out_path`, and
    `<stem>-<k><suffix>` for API process k of several); returns the top functions by
    own time (share of all their samples)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(py_spy):
        raise ValueError("--profile-dir needs py-spy (pip install py-spy)")
    pids = api_pids(server.proc.pid, Path(server.log_path).read_text())
    paths = [out_path] if len(pids) == 1 else [out_path.with_name(f"{out_path.stem}-{k}{out_path.suffix}")
                                               for k in range(len(pids))]
    spies = [subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                               "--nonblocking", "--output", str(path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for pid, path in zip(pids, paths)]
    time.sleep(1.0)  # attached
    try:
        run()
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(60)
    return top_self("\n".join(path.read_text() for path in paths if path.exists()))


def top_self(raw: str, limit: int = 15) -> list[tuple[str, float]]:
    """py-spy raw (collapsed) stacks -> [(function (file:line), share of samples)] by own time."""
    own: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            own[stack.rsplit(";", 1)[-1]] += int(count)
    total = sum(own.values()) or 1
    return [(frame, n / total) for frame, n in own.most_common(limit)]


# -- the whole run -----------------------------------------------------------------------------

def main(args) -> dict:
    import torch
    from transformers import AutoConfig

    cpus = sorted(cpu_set(args.cpus))
    modes = [m for m in args.modes.split(",") if m]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    vocab_size = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    out_dir = Path(args.profile_dir) if args.profile_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    anywhere = sorted(os.sched_getaffinity(0) | set(range(os.cpu_count() or 1)))  # the client's CPUs
    torch.set_num_threads(args.offline_threads or len(cpus))
    work = {c: workload(vocab_size, c * args.requests_per_stream, args.input_len, seed=c) for c in concurrencies}
    one_token = workload(vocab_size, args.one_token_requests, args.input_len, seed=1) if args.one_token_requests else []

    def paired(server: ServeProcess, name: str, row: dict, prompts: list[list[int]], output_len: int,
               concurrency: int) -> dict:
        """`row` with the offline engine's rate on `prompts` (on the servers' cores, with as many
        threads; the idle server's CPU meanwhile shows it did not disturb it), then the served
        run of the same prompts and their ratio: output tokens/s, or requests/s for one-token ones."""
        rate = "req_s" if row.get("one_token") else "tok_s"
        _, api_0, workers_0, _ = _api_cpu(server)
        start = time.perf_counter()
        os.sched_setaffinity(0, cpus)
        try:
            row[f"offline_{rate}"] = offline_rate(args.model, prompts, output_len, concurrency, args.num_kv_blocks)
        finally:
            os.sched_setaffinity(0, anywhere)
        _, api_1, workers_1, _ = _api_cpu(server)
        row["server_cores_during_offline"] = ((sum(api_1) - sum(api_0) + workers_1 - workers_0)
                                              / (time.perf_counter() - start))
        row.update(served_run(server, name, prompts, output_len, concurrency, args.client_procs))
        row["served_over_offline"] = row[rate] / row[f"offline_{rate}"]
        print(json.dumps(row), flush=True)
        return row

    rows, profiles = [], {}
    configs = args.server_args or [""]
    for config in configs:
        extra = ["--num-kv-blocks", str(args.num_kv_blocks), *config.split()]
        for mode in modes:
            label = f"{mode} {config}".strip()
            server = start_server(args.model, mode, cpus, extra, Path(out_dir or tempfile.gettempdir())
                                  / f"overhead-{_file_name(label)}.log")
            try:
                name = server.wait_ready()
                warm = workload(vocab_size, 8, args.input_len, seed=99)
                served_run(server, name, warm, 8, 8, 1)  # first-use costs stay out
                for round_no in range(args.rounds):
                    label_row = {"mode": mode, "server_args": config, "round": round_no}
                    rows += [paired(server, name, {**label_row, "concurrency": c}, work[c], args.output_len, c)
                             for c in concurrencies]
                    if one_token:
                        c = args.one_token_concurrency
                        rows.append(paired(server, name, {**label_row, "concurrency": c, "one_token": True},
                                           one_token, 1, c))
                if out_dir:
                    c = max(concurrencies)
                    fresh = workload(vocab_size, c * args.requests_per_stream, args.input_len, seed=c + 7)
                    profiles[f"{label}, C={c}"] = profile_run(
                        server, lambda: served_run(server, name, fresh, args.output_len, c, args.client_procs),
                        out_dir / f"api-{_file_name(label)}-c{c}.txt")
                    if one_token:
                        fresh = workload(vocab_size, len(one_token), args.input_len, seed=7)
                        profiles[f"{label}, one-token requests"] = profile_run(
                            server, lambda: served_run(server, name, fresh, 1, args.one_token_concurrency,
                                                       args.client_procs),
                            out_dir / f"api-{_file_name(label)}-one-token.txt")
            finally:
                server.stop()
    result = {"model": args.model, "cpus": cpus, "offline_threads": torch.get_num_threads(),
              "input_len": args.input_len, "output_len": args.output_len,
              "requests_per_stream": args.requests_per_stream, "server_args": configs,
              "client_procs": args.client_procs, "rounds": args.rounds, "rows": rows,
              "summary": summarize(rows), "profiles": profiles}
    print(format_table(result))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2))
    return result


_ALSO_MEDIANS = ("api_cores", "workers_cores", "client_cores", "client_us_per_token", "steal_cores")


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (mode, server args, C, one-token or not), in the rows' order:
    the median over its rounds of each figure, and the range of the ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["server_args"], r["concurrency"], bool(r.get("one_token"))), []).append(r)
    out = []
    for (mode, server_args, concurrency, one), rs in groups.items():
        rate = "req_s" if one else "tok_s"
        ratios = [r["served_over_offline"] for r in rs]
        entry = {"mode": mode, "server_args": server_args, "concurrency": concurrency, "one_token": one,
                 "rounds": len(rs), "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                 "ratio_max": max(ratios),
                 "offline": statistics.median(r["offline_req_s" if one else "offline_tok_s"] for r in rs),
                 "served": statistics.median(r[rate] for r in rs),
                 "api_us": statistics.median(r["api_us_per_request" if one else "api_us_per_token"] for r in rs)}
        for key in _ALSO_MEDIANS:
            entry[key] = statistics.median(r.get(key, 0.0) for r in rs)
        out.append(entry)
    return out


def _file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", label.replace("--", "")).strip("_")


def format_table(result: dict) -> str:
    configs = result["server_args"]
    with_args = len(configs) > 1 or configs != [""]
    arg_width = max(len(c) for c in configs) + 2 if with_args else 0
    summary = result.get("summary") or summarize(result["rows"])
    rounds = max((e["rounds"] for e in summary), default=1)

    def label(e: dict) -> str:
        return f"{e['mode']:<11}" + (f"{e['server_args'] or '(defaults)':<{arg_width}}" if with_args else "")

    def ratio(e: dict) -> str:
        spread = f"  [{e['ratio_min']:.2f}, {e['ratio_max']:.2f}]" if rounds > 1 else ""
        return f"{e['ratio']:>7.2f}{spread:<14}" if rounds > 1 else f"{e['ratio']:>7.2f}"

    ratio_head = f"{'ratio':>7}{'  [min, max]':<14}" if rounds > 1 else f"{'ratio':>7}"
    head = f"{'mode':<11}" + (f"{'server args':<{arg_width}}" if with_args else "")
    median = f"; medians of {rounds} rounds (each served run right after an offline run)" if rounds > 1 else ""
    lines = [f"\nserved vs offline: {len(result['cpus'])} CPUs, prompts {result['input_len']} tokens, "
             f"outputs {result['output_len']} tokens; offline: {result['offline_threads']} threads{median}",
             f"{head}{'C':>5}{'offline':>10}{'served':>10}{ratio_head}{'API us':>8}{'API':>6}"
             f"{'workers':>8}{'client':>7}{'client us':>10}{'steal':>6}",
             f"{'':<{len(head)}}{'':>5}{'tok/s':>10}{'tok/s':>10}{'':>{len(ratio_head)}}{'/token':>8}{'cores':>6}"
             f"{'cores':>8}{'cores':>7}{'/token':>10}{'cores':>6}"]
    for e in summary:
        if e["one_token"]:
            continue
        lines.append(f"{label(e)}{e['concurrency']:>5}{e['offline']:>10.0f}{e['served']:>10.0f}{ratio(e)}"
                     f"{e['api_us']:>8.1f}{e['api_cores']:>6.2f}{e['workers_cores']:>8.2f}{e['client_cores']:>7.2f}"
                     f"{e['client_us_per_token']:>10.1f}{e['steal_cores']:>6.2f}")
    one = [e for e in summary if e["one_token"]]
    if one:
        lines.append(f"\none-token requests, C={one[0]['concurrency']}")
        lines.append(f"{head}{'offline req/s':>14}{'served req/s':>13}{ratio_head}{'API us/req':>11}{'API':>6}"
                     f"{'workers':>8}{'client':>7}{'steal':>6}")
        lines.append(f"{'':<{len(head)}}{'':>14}{'':>13}{'':>{len(ratio_head)}}{'':>11}{'cores':>6}{'cores':>8}"
                     f"{'cores':>7}{'cores':>6}")
        for e in one:
            lines.append(f"{label(e)}{e['offline']:>14.0f}{e['served']:>13.0f}{ratio(e)}{e['api_us']:>11.0f}"
                         f"{e['api_cores']:>6.2f}{e['workers_cores']:>8.2f}{e['client_cores']:>7.2f}"
                         f"{e['steal_cores']:>6.2f}")
    if any(r.get("api_processes", 1) > 1 for r in result["rows"]):
        lines.append("\n(API: every API process's CPU summed; the launcher of several is not counted)")
    for name, top in result.get("profiles", {}).items():
        lines.append(f"\nAPI, {name}, top functions by own time (py-spy):")
        lines.extend(f"  {share:6.1%}  {frame}" for frame, share in top)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.dev.overhead", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
