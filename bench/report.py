"""The result of a serving run: the printed summary table and the result JSON.

The JSON follows vLLM's `bench serve` field names so existing tooling reads
it. Per-request arrays (written with `--save-detailed`) are in request order
and, as in vLLM, in seconds: `ttfts`, `itls` (a list per request),
`latencies` (E2EL), `start_times` (from the start of the run). A failed
request has `output_lens` 0, `ttfts` 0.0 and its message in `errors`.
`num_images` (0 = text-only) lets a reader split results by request kind.
A multi-turn run (bench/multi_turn.py) adds `conversation_ids` and
`turn_indices` (1 for a conversation's first turn) to those arrays, and
`ttft_by_turn` and the `prefix_cache_*` fields to the summary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from epd.bench.client import RequestResult
from epd.bench.metrics import percentile_key

DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                   "generated_texts", "errors", "num_images")
MULTI_TURN_FIELDS = ("conversation_ids", "turn_indices")  # per-request too, only in a multi-turn result
_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))
_WIDTH = 50


def detailed_fields(results: Sequence[RequestResult]) -> dict[str, list]:
    """The per-request arrays of the result JSON, one entry per request in order."""
    return {
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in results],
        "itls": [list(r.itls_s) for r in results],
        "latencies": [r.e2el_s for r in results],
        "start_times": [r.start_s for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "num_images": [r.num_images for r in results],
    }


def results_from_json(result: dict) -> list[RequestResult]:
    """Rebuild per-request results from a result JSON saved with `--save-detailed`."""
    missing = [name for name in DETAILED_FIELDS if name not in result]
    if missing:
        raise ValueError(f"result has no per-request fields {missing}; save it with --save-detailed")
    return [
        RequestResult(success=not error, start_s=start_s, ttft_s=ttft_s, e2el_s=e2el_s, itls_s=list(itls_s),
                      input_len=input_len, output_len=output_len, num_images=num_images,
                      generated_text=text, error=error)
        for input_len, output_len, ttft_s, itls_s, e2el_s, start_s, text, error, num_images in zip(
            *(result[name] for name in DETAILED_FIELDS))
    ]


def write_result(path: str | Path, result: dict, save_detailed: bool = False, append: bool = False) -> None:
    """Write `result` as JSON; the per-request arrays only with `save_detailed`.
    `append` (vLLM's --append-result): one more JSON line of the file instead."""
    if not save_detailed:
        result = {k: v for k, v in result.items() if k not in DETAILED_FIELDS + MULTI_TURN_FIELDS}
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    if append:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    else:
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def format_table(result: dict, percentiles: Sequence[float]) -> str:
    """The 'Serving Benchmark Result' block, as vLLM prints it."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt):<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate", "inf") != "inf":
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for key, name, header in _SECTIONS:
        if f"mean_{key}_ms" not in result:  # not among --percentile-metrics
            continue
        lines.append(header.center(_WIDTH, "-"))
        row(f"Mean {name} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", result[f"median_{key}_ms"], ".2f")
        for q in percentiles:
            p = percentile_key(q)
            row(f"{p.upper()} {name} (ms):", result[f"{p}_{key}_ms"], ".2f")
    if "text_only_mean_ttft_ms" in result:
        for prefix, label in (("text_only", "text-only"), ("image", "image")):
            lines.append(f"TTFT, {label} requests".center(_WIDTH, "-"))
            row("Completed:", result[f"num_{prefix}_completed"])
            row("Mean TTFT (ms):", result[f"{prefix}_mean_ttft_ms"], ".2f")
            for q in percentiles:
                p = percentile_key(q)
                row(f"{p.upper()} TTFT (ms):", result[f"{prefix}_{p}_ttft_ms"], ".2f")
    if "prefix_cache_queries" in result:  # the server reported its prefix cache (multi-turn runs)
        lines.append("Prefix Cache".center(_WIDTH, "-"))
        rate = result["prefix_cache_hit_rate"]
        row("Hit rate (%):", "n/a" if rate is None else 100 * rate, "" if rate is None else ".2f")
        row("Prompt tokens looked up:", result["prefix_cache_queries"])
        row("Prompt tokens found:", result["prefix_cache_hits"])
    for turn in result.get("ttft_by_turn", []):
        lines.append(f"TTFT, turn {turn['turn']}".center(_WIDTH, "-"))
        row("Completed:", turn["completed"])
        row("Median TTFT (ms):", turn["median_ttft_ms"], ".2f")
        for q in percentiles:
            p = percentile_key(q)
            row(f"{p.upper()} TTFT (ms):", turn[f"{p}_ttft_ms"], ".2f")
    if "spec_decode_num_drafts" in result:  # the server reported speculative decoding's counters
        lines.append("Speculative Decoding".center(_WIDTH, "-"))
        rate, length = result["spec_decode_acceptance_rate"], result["spec_decode_mean_acceptance_length"]
        row("Acceptance rate (%):", "n/a" if rate is None else 100 * rate, "" if rate is None else ".2f")
        row("Acceptance length:", "n/a" if length is None else length, "" if length is None else ".2f")
        row("Drafts:", result["spec_decode_num_drafts"])
        row("Draft tokens:", result["spec_decode_num_draft_tokens"])
        row("Accepted tokens:", result["spec_decode_num_accepted_tokens"])
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
