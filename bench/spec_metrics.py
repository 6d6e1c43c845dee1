"""Speculative decoding's acceptance for `epd bench serve`, from the server's /metrics.

The server's counters (vLLM's `vllm:spec_decode_*` names under `epd:`) are
read before and after the measured run; their differences give the run's
drafts, draft tokens and accepted tokens, and from them vLLM's acceptance
rate (accepted / draft tokens) and mean acceptance length (1 + accepted /
drafts: tokens a verifying step yields). A server without /metrics or
without these counters (no speculation, another server) gives no fields.
Workers publish their stats every 0.25 s, so the counters after a run are
read until they stop changing (a few seconds at most).
"""
from __future__ import annotations

import asyncio

import httpx

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_SETTLE_S, _MAX_READS = 0.6, 8


def parse_counters(text: str) -> dict[str, float] | None:
    """Sum of each `epd:spec_decode_<name>_total` over its label sets (every
    worker's), from Prometheus text; None when none of them is there."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name in COUNTERS:
            metric = f"epd:spec_decode_{name}_total"
            if line.startswith(metric) and line[len(metric):len(metric) + 1] in ("{", " "):
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return {name: sums.get(name, 0.0) for name in COUNTERS} if sums else None


async def read_counters(http: httpx.AsyncClient, server_root: str, headers: dict,
                        settle: bool = False, parse=parse_counters):
    """The counters now (None: not served); with `settle`, once two reads agree.
    `parse`: what to read from the Prometheus text (None: nothing there)."""
    async def read() -> dict[str, float] | None:
        try:
            response = await http.get(server_root.rstrip("/") + "/metrics", headers=headers)
        except httpx.HTTPError:
            return None
        return parse(response.text) if response.status_code == 200 else None

    value = await read()
    for _ in range(_MAX_READS if settle and value is not None else 0):
        await asyncio.sleep(_SETTLE_S)
        again = await read()
        if again == value:
            break
        value = again
    return value


def acceptance_fields(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's `spec_decode_*` fields for the result JSON ({} without counters)."""
    if before is None or after is None:
        return {}
    delta = {name: int(after[name] - before[name]) for name in COUNTERS}
    drafts, draft_tokens, accepted = (delta[name] for name in COUNTERS)
    return {**{f"spec_decode_{name}": value for name, value in delta.items()},
            "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else None}
