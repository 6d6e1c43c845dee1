"""The pure half of `python -m bench.dev.vs_vllm`: per-round values in, ratios with their ranges out.

A measurement is one row (e.g. "text C=32 tok/s") measured on every server
in every round. Each round's ratio is the server's value over the base's
(vLLM's) value in the same round, so the machine's drift between rounds
cancels; a row reports the ratio of the means and the min-max of the
per-round ratios. `higher_is_better` says which way a ratio above 1 points
(tokens/s: up is good; TTFT/TPOT: down is good), shown in the table as
"(higher is better)" or "(lower is better)".
"""
from __future__ import annotations

import statistics


def new_row(name: str, metric: str, higher_is_better: bool) -> dict:
    """An empty row of the results: `values[server]` is a list with one value per round."""
    return {"name": name, "metric": metric, "higher_is_better": higher_is_better, "values": {}}


def add_value(row: dict, server: str, value: float | None) -> None:
    row["values"].setdefault(server, []).append(value)


def ratio_summary(values: list[float | None], base: list[float | None]) -> dict:
    """Mean of each side, the ratio of the means and the min-max of the per-round ratios.
    Rounds where either side has no value (a failed run) or the base is 0 are left out."""
    pairs = [(v, b) for v, b in zip(values, base) if v is not None and b is not None and b != 0]
    if not pairs:
        return {"mean": None, "base_mean": None, "ratio": None, "ratio_min": None, "ratio_max": None, "rounds": 0}
    ratios = [v / b for v, b in pairs]
    mean, base_mean = statistics.fmean(v for v, _ in pairs), statistics.fmean(b for _, b in pairs)
    return {"mean": mean, "base_mean": base_mean, "ratio": mean / base_mean if base_mean else None,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(pairs)}


def summarize(results: dict) -> dict:
    """`results` ({"base": label, "servers": [...], "rows": [row, ...]}) with each row's
    `ratios[server]` (every server but the base) filled in from `ratio_summary`."""
    base = results["base"]
    for row in results["rows"]:
        base_values = row["values"].get(base, [])
        row["ratios"] = {server: ratio_summary(row["values"].get(server, []), base_values)
                         for server in results["servers"] if server != base}
    return results


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def ratio_text(r: dict) -> str:
    """A `ratio_summary` as 'RATIO (MIN-MAX)', or '-' without a round."""
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"


def _own_mean(row: dict, server: str) -> float | None:
    values = [v for v in row["values"].get(server, []) if v is not None]
    return statistics.fmean(values) if values else None


def markdown_table(results: dict) -> str:
    """One line per row: the base's mean, then each server's mean and its ratio (min-max over rounds)."""
    base = results["base"]
    others = [s for s in results["servers"] if s != base]
    head = ["row", base] + [cell for s in others for cell in (s, f"{s} / {base} (range)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        better = "higher" if row["higher_is_better"] else "lower"
        cells = [f"{row['name']} ({better} is better)", _number(_own_mean(row, base))]
        for server in others:
            r = row["ratios"][server]
            # no round to pair (the base failed, or its value is 0: a goodput no rate reached): its own mean
            cells += [_number(r["mean"] if r["rounds"] else _own_mean(row, server)), ratio_text(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def greedy_lines(greedy: dict) -> list[str]:
    """`greedy` = {"base": label, "texts": {server: [text per prompt]}}: how many of each
    server's texts equal the base's."""
    base = greedy.get("base")
    texts = greedy.get("texts", {})
    if base not in texts:
        return []
    lines = []
    for server, outs in texts.items():
        if server == base:
            continue
        same = sum(a == b for a, b in zip(outs, texts[base]))
        lines.append(f"greedy text, {server} vs {base}: {same}/{len(texts[base])} prompts identical")
    return lines
