"""`python -m bench.dev.vs_vllm`: EPD against vLLM itself, same machine, checkpoint and trace (issue 32).

Starts `vllm serve` from vLLM's own environment (`--vllm-bin`, or the `vllm`
beside `--vllm-python`; `scripts/vllm_env.sh` builds the CPU one) and
`epd serve` in each of `--modes` (one after another, each start-up timed),
all pinned to the same CPUs and kept up for the whole run, then:
  * greedy text: a few prompts (text, one image, two images) to every server;
    each server's texts against vLLM's;
  * interleaved rounds (`--rounds`, each row measured on vLLM, then on each
    EPD mode, then the next row; the next round the same again), with one
    client for all (`--client epd`: `epd bench serve`'s code in this process;
    `--client vllm`: `vllm bench serve` from vLLM's environment):
      - served output tokens/s, text, at each `--streams` count (closed loop:
        `--max-concurrency C`, everything sent at once), and the same run's
        CPU milliseconds per output token of the server's processes (steal-free:
        the hypervisor's noise lowers tokens/s, not this);
      - median TTFT and TPOT with K images per request at a fixed rate
        (`--image-rows K@RATE,...`);
      - after those rows, goodput with `--goodput-images` (4) images a request
        over `--goodput-rates` (`vs_vllm_goodput`: `epd bench compare`'s sweep
        and goodput, SLOs from vLLM's solo latency or given);
  * offline tokens/s (before any server starts): `vs_vllm_offline`.
With `--vllm-ec`, vLLM's own encoder disaggregation ("vllm-ec": an encoder
and a prefill-decode `vllm serve` with `ECExampleConnector`, behind our proxy;
`vllm_servers.VllmEcPeer`) runs too, for the greedy texts and the goodput
rows only.
Each row reports the ratio of means against vLLM and the min-max of the
per-round ratios (`vs_vllm_table`); written as vs_vllm.json and vs_vllm.md in
`--output-dir`. Not in CI: it needs vLLM's environment and minutes per row.
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

from bench.dev import vs_vllm_goodput, vs_vllm_offline
from bench.dev.overhead import steal_s, tree_cpu_s
from bench.dev.vllm_servers import VllmEcPeer, VllmProcess
from bench.dev.vs_vllm_table import add_value, greedy_lines, markdown_table, new_row, summarize
from epd.bench import serve as bench_serve
from epd.bench.client import send_chat_request
from epd.bench.compare import ServeProcess, cpu_set, warm_up
from epd.bench.datasets import load_tokenizer, sample_random, sample_random_mm

BASE = "vllm"
EC = "vllm-ec"  # vLLM's encoder disaggregation: greedy texts and goodput rows only
CPU_PER_TOKEN = "server_cpu_ms_per_token"  # not a field of the client's result: added from /proc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory both serve (e.g. `epd make-model --preset small`)")
    peer = p.add_mutually_exclusive_group(required=True)
    peer.add_argument("--vllm-bin", help="vLLM's `vllm` command (e.g. /work/vllm-venv/bin/vllm)")
    peer.add_argument("--vllm-python", help="vLLM's Python; its `vllm` is the one beside it")
    p.add_argument("--vllm-ec", action="store_true",
                   help="also vLLM's own encoder disaggregation (1 encoder + 1 prefill-decode `vllm serve`, "
                        "ECExampleConnector, our proxy in front): greedy texts and goodput rows")
    p.add_argument("--modes", default="aggregated",
                   help="comma-separated `epd serve --mode`s; a mode may carry its own flags in brackets, "
                        "e.g. 'aggregated,aggregated[--threads-per-worker 2]' (both measured, each its own label)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each row on every server)")
    p.add_argument("--streams", default="1,8,32,128", help="text rows: concurrent streams, comma-separated")
    p.add_argument("--image-rows", default="1@0.5,4@0.25",
                   help="image rows: IMAGES@RATE (requests/s), comma-separated; empty for none")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per text row (at least the streams)")
    p.add_argument("--image-num-prompts", type=int, default=16, help="requests per image row")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--image-size", default="448x448", help="WxH of the image rows' images")
    p.add_argument("--greedy-tokens", type=int, default=24, help="tokens per greedy-text prompt (0: no greedy texts)")
    p.add_argument("--greedy-only", action="store_true",
                   help="only the greedy texts (a family's check against vLLM): no offline, served or goodput rows")
    p.add_argument("--offline-concurrency", type=int, default=32, help="offline row's requests; 0: no offline row")
    p.add_argument("--offline-rounds", type=int, default=None, help="offline rounds (default: --rounds)")
    p.add_argument("--offline-threads", type=int, default=None, help="torch threads of both engines (default: CPUs)")
    p.add_argument("--client", choices=["epd", "vllm"], default="epd",
                   help="who sends the traces: epd bench serve's code, or vLLM's `vllm bench serve`")
    p.add_argument("--cpus", default=None, help="CPU list every server is pinned to, e.g. 0-1 (default: all)")
    p.add_argument("--server-args", default="", help="extra `epd serve` flags")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, e.g. '--max-num-seqs 128'")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="KV cache of both servers, GiB: vLLM's VLLM_CPU_KVCACHE_SPACE and EPD's --kv-cache-gb "
                        "(unless --server-args sets EPD's)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0, help="start-up limit per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench-results/vs-vllm")
    vs_vllm_goodput.add_arguments(p)


def vllm_bin(args) -> str:
    return args.vllm_bin or str(Path(args.vllm_python).parent / "vllm")


def parse_image_rows(text: str) -> list[tuple[int, float]]:
    """'1@0.5,4@0.25' -> [(1, 0.5), (4, 0.25)]."""
    rows = []
    for part in filter(None, text.split(",")):
        images, _, rate = part.partition("@")
        if not rate:
            raise ValueError(f"--image-rows: {part!r} is not IMAGES@RATE")
        rows.append((int(images), float(rate)))
    return rows


def workloads(args) -> list[dict]:
    """Every served row: its name, the client's flags (epd bench serve's names) and what it measures."""
    rows = []
    for c in (int(x) for x in args.streams.split(",") if x):
        text = {"name": f"text C={c} output tok/s", "metric": "output_throughput", "higher": True,
                "dataset": "random", "num_prompts": max(args.num_prompts, c), "max_concurrency": c,
                "rate": "inf", "images": 0}
        # the same run's CPU cost: time the hypervisor steals slows a server's tokens/s, not this
        rows += [text, {**text, "name": f"text C={c} server CPU ms per output token", "metric": CPU_PER_TOKEN,
                        "higher": False, "shares_run_with": text["name"]}]
    for images, rate in parse_image_rows(args.image_rows):
        for metric, label in (("median_ttft_ms", "median TTFT ms"), ("median_tpot_ms", "median TPOT ms")):
            rows.append({"name": f"{images} image(s) @ {rate:g} req/s {label}", "metric": metric, "higher": False,
                         "dataset": "random-mm", "num_prompts": args.image_num_prompts, "max_concurrency": None,
                         "rate": str(rate), "images": images, "shares_run_with": f"{images}@{rate:g}"})
    return rows


def epd_client(args, workload: dict, base_url: str, model: str, seed: int, out: Path) -> dict:
    """One run of `epd bench serve`'s code; its result JSON (vLLM's field names)."""
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    flags = ["--base-url", base_url, "--model", model, *(["--tokenizer", args.model_dir] if args.model_dir else []),
             "--dataset", workload["dataset"], "--num-prompts", str(workload["num_prompts"]),
             "--request-rate", workload["rate"], "--input-len", str(args.input_len),
             "--output-len", str(args.output_len), "--seed", str(seed), "--no-progress", "--save-result", str(out)]
    if workload["max_concurrency"]:
        flags += ["--max-concurrency", str(workload["max_concurrency"])]
    if workload["images"]:
        flags += ["--images-per-request", str(workload["images"]), "--image-size", args.image_size, "--text-first"]
    return bench_serve.main(p.parse_args(flags))


def vllm_client(args, workload: dict, base_url: str, model: str, seed: int, out: Path) -> dict:
    """One run of `vllm bench serve` (vLLM's environment) with the same workload; its result JSON."""
    cmd = [vllm_bin(args), "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", base_url, "--model", model, "--tokenizer", args.model_dir,
           "--dataset-name", workload["dataset"], "--num-prompts", str(workload["num_prompts"]),
           "--request-rate", workload["rate"], "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if workload["max_concurrency"]:
        cmd += ["--max-concurrency", str(workload["max_concurrency"])]
    if workload["images"]:
        w, h = args.image_size.split("x")
        k = workload["images"]
        cmd += ["--random-mm-base-items-per-request", str(k),
                "--random-mm-limit-mm-per-prompt", json.dumps({"image": k, "video": 0}),
                "--random-mm-bucket-config", f"{{({h}, {w}, 1): 1.0}}"]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    return json.loads(out.read_text())


def greedy_texts(args, servers: dict, models: dict) -> dict:
    """Each server's greedy texts for one text prompt, one with an image and one with two."""
    import asyncio

    tokenizer = load_tokenizer(args.model_dir)
    size = [tuple(int(x) for x in args.image_size.split("x"))]
    requests = sample_random(1, 32, args.greedy_tokens, seed=args.seed, tokenizer=tokenizer)
    for k in (1, 2):
        requests += sample_random_mm(1, 32, args.greedy_tokens, images_per_request=k, image_sizes=size,
                                     seed=args.seed + k, tokenizer=tokenizer)

    async def ask(base_url: str, model: str) -> list[str]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as http:
            outs = [await send_chat_request(http, f"{base_url}/v1/chat/completions", model, r, timeout_s=300.0)
                    for r in requests]
        return [o.generated_text if o.success else f"<failed: {o.error}>" for o in outs]

    return {"base": BASE, "texts": {label: asyncio.run(ask(s.base_url, models[label]))
                                    for label, s in servers.items()}}


def start_servers(args, cpus: set[int], out_dir: Path) -> tuple[dict, dict, dict]:
    """vLLM's server, then one `epd serve` per mode, each started alone and waited for (so each
    start-up is its own, on the machine the others leave idle); (servers, models, start-up s)."""
    servers: dict[str, ServeProcess] = {}
    models, startup = {}, {}
    try:
        for label in [BASE, *([EC] if args.vllm_ec else []), *modes(args)]:
            servers[label] = server = _launch(args, label, cpus, out_dir / f"server-{_slug(label)}.log")
            models[label] = server.wait_ready(args.ready_timeout_s)
            startup[label] = time.monotonic() - server.started_s
            print(f"{label}: ready after {startup[label]:.0f} s", flush=True)
    except BaseException:  # one failed to start: the others must not outlive the bench
        for server in servers.values():
            server.stop()
        raise
    return servers, models, startup


def _launch(args, label: str, cpus: set[int], log_path: Path) -> ServeProcess | VllmEcPeer:
    if label == BASE:
        return VllmProcess(vllm_bin(args), args.model_dir, cpus, args.vllm_args.split(), log_path,
                           args.vllm_kv_cache_gib)
    if label == EC:
        return VllmEcPeer(vllm_bin(args), args.model_dir, cpus, args.vllm_args.split(), log_path.parent,
                          args.vllm_kv_cache_gib, log_path.parent / "vllm-ec-cache")
    mode, extra = epd_server_args(args, label)
    return ServeProcess(args.model_dir, mode, cpus, extra, log_path)


def epd_server_args(args, label: str) -> tuple[str, list[str]]:
    """An EPD label's `--mode` and flags: 'e-p-d[--threads-per-worker 2]' -> ('e-p-d', [--server-args...,
    '--threads-per-worker', '2', KV budget])."""
    mode, _, own = label.partition("[")
    extra = args.server_args.split() + own.rstrip("]").split()
    if not {"--kv-cache-gb", "--num-kv-blocks"} & {a.split("=")[0] for a in extra}:
        # the same KV budget as vLLM's: EPD's CPU default (1 GiB) held a third of what vLLM's 4 did,
        # so prompts vLLM found in its prefix cache had been evicted from EPD's
        extra += ["--kv-cache-gb", str(args.vllm_kv_cache_gib)]
    return mode, extra


def _slug(text: str) -> str:
    """A label as a file name's part: 'aggregated[--threads-per-worker 2]' -> 'aggregated_--threads-per-worker_2_'."""
    return "".join(c if c.isalnum() or c in "-.=@" else "_" for c in text)


def modes(args) -> list[str]:
    return [m for m in args.modes.split(",") if m]


def offline_rows(args, cpus: set[int], out_dir: Path) -> list[dict]:
    """The offline row, every round: vLLM's engine, then EPD's, on one workload."""
    if not args.offline_concurrency:
        return []
    c = args.offline_concurrency
    row = new_row(f"offline C={c} output tok/s (engine, any mode)", "tok_s", True)
    workload = out_dir / "offline-workload.json"
    vs_vllm_offline.write_workload(workload, args.model_dir, "float32", args.offline_threads or len(cpus), c,
                                   args.input_len, args.output_len, 0.0, args.seed, args.vllm_kv_cache_gib)
    python = args.vllm_python or str(Path(args.vllm_bin).parent / "python")
    engines = [(BASE, python, vs_vllm_offline.vllm_command()),
               (modes(args)[0].partition("[")[0], sys.executable,
                vs_vllm_offline.epd_command())]
    for r in range(args.offline_rounds or args.rounds):
        for label, exe, script in engines:
            tok_s = vs_vllm_offline.run_engine(exe, script, workload, cpus, out_dir / f"offline-{_slug(label)}-r{r}.log",
                                               args.ready_timeout_s)
            add_value(row, label, tok_s)
            print(f"round {r} offline {label}: {tok_s} tok/s", flush=True)
    return [row]


def served_rows(args, servers: dict, models: dict, out_dir: Path, steal: dict) -> list[dict]:
    """Every workload on every server but vllm-ec, round after round (A, B, A, B ...);
    `steal` gets each run's share of the vCPUs' time the hypervisor stole (None: unknown)."""
    client = vllm_client if args.client == "vllm" else epd_client
    servers = {label: server for label, server in servers.items() if label != EC}
    rows: list[dict] = []
    for label, server in servers.items():  # first-use costs (compiles, allocations) out of the rounds
        warm_up(_warmup_args(args, models[label]), server.base_url, out_dir / f"warmup-{_slug(label)}.json")
    for r in range(args.rounds):
        results: dict[tuple[str, str], dict] = {}  # one run per (run key, server): TTFT and TPOT share it
        for i, workload in enumerate(workloads(args)):
            if r == 0:
                rows.append(new_row(workload["name"], workload["metric"], workload["higher"]))
            key = workload.get("shares_run_with", workload["name"])
            for label, server in servers.items():
                run = f"r{r} {key} {label}"
                if (key, label) not in results:
                    out = out_dir / f"r{r}-{_slug(label)}-{_slug(key)}.json"
                    seed = args.seed + 7919 * (r + 1) + i  # a fresh trace each round: no cache hits across rounds
                    before = (time.monotonic(), steal_s())
                    cpu_before = tree_cpu_s(server.proc.pid)
                    try:
                        results[key, label] = client(args, workload, server.base_url, models[label], seed, out)
                        results[key, label][CPU_PER_TOKEN] = cpu_ms_per_token(
                            tree_cpu_s(server.proc.pid) - cpu_before, results[key, label].get("total_output_tokens"))
                    except Exception as exc:  # one failed run leaves a gap, not the whole bench
                        print(f"round {r} {workload['name']} {label}: failed ({exc})", flush=True)
                        results[key, label] = {}
                    # the host's noise in this run: stolen vCPU time decides whether threads help
                    steal[run] = stolen_share(before, (time.monotonic(), steal_s()))
                value = results[key, label].get(workload["metric"])
                add_value(rows[i], label, value)
                stolen = "" if steal[run] is None else f" (host steal {steal[run]:.1%})"
                print(f"round {r} {workload['name']} {label}: {value}{stolen}", flush=True)
    return rows


def cpu_ms_per_token(cpu_s: float, output_tokens: int | None) -> float | None:
    """A server's CPU milliseconds (all its processes) per output token of one run."""
    return 1000 * cpu_s / output_tokens if output_tokens else None


def stolen_share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The share of the host's vCPU time its hypervisor stole between two (monotonic s,
    `steal_s()`) readings; None if no time passed."""
    elapsed = (after[0] - before[0]) * (os.cpu_count() or 1)
    return (after[1] - before[1]) / elapsed if elapsed > 0 else None


def _warmup_args(args, model: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(["--model", model, "--tokenizer", args.model_dir, "--dataset", "random-mm",
                         "--image-size", args.image_size, "--input-len", str(args.input_len),
                         "--output-len", "8", "--seed", str(args.seed), "--no-progress"])


def main(args) -> dict:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    parse_image_rows(args.image_rows)  # a typo fails now, not after start-up
    vs_vllm_goodput.rates(args)
    cpus = cpu_set(args.cpus)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [] if args.greedy_only else offline_rows(args, cpus, out_dir)
    servers, models, startup = start_servers(args, cpus, out_dir)
    steal: dict[str, float | None] = {}
    goodput, goodput_runs = [], {}
    try:
        greedy = greedy_texts(args, servers, models) if args.greedy_tokens else {}
        print("\n".join(greedy_lines(greedy)), flush=True)
        if not args.greedy_only:
            rows += served_rows(args, servers, models, out_dir, steal)
            goodput, goodput_runs = vs_vllm_goodput.goodput_rows(args, servers, models, out_dir, _slug)
            rows += goodput
    finally:
        for server in servers.values():
            server.stop()
    startup_row = new_row("start-up to ready s", "startup_s", False)
    for label, seconds in startup.items():
        add_value(startup_row, label, seconds)
    results = summarize({"base": BASE, "servers": list(servers), "rows": rows + [startup_row], "greedy": greedy,
                         "config": {k: v for k, v in vars(args).items() if k != "func"}, "cpus": sorted(cpus),
                         "goodput": goodput_runs, "host_steal": steal})
    report = "\n".join([markdown_table(results), "", *greedy_lines(greedy),
                        *vs_vllm_goodput.against_lines(goodput, EC)])
    print(report)
    (out_dir / "vs_vllm.json").write_text(json.dumps(results, indent=2))
    (out_dir / "vs_vllm.md").write_text(report + "\n")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.dev.vs_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    main(parser.parse_args())
