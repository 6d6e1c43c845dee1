"""Serving metrics from per-request results: pure functions, no I/O.

Definitions (those of vLLM's `bench serve` unless said otherwise):
  * TTFT  — sending to the first content token.
  * TPOT  — (E2EL - TTFT) / (output_len - 1); undefined for outputs of 0 or
            1 token, which are left out of TPOT statistics.
  * ITL   — every gap between successive content chunks, all requests pooled.
  * E2EL  — sending to the end of the stream.
  * Percentiles are numpy's linear interpolation. Statistics of an empty
    set are 0.0 (as vLLM; JSON has no NaN).
  * Goodput — completed requests that meet every given SLO, per second of
    run. For goodput a request without a TPOT counts as TPOT 0 (meets it).

Rate sweeps (for `epd bench compare`): a sweep is a list of
(request_rate, results of the run at that rate).
  * `distserve_max_rate` — DistServe's goodput: the highest rate at which at
    least 90% of all requests meet both the TTFT and the TPOT SLO.
  * `p99_max_rate` — the published EPD results': the highest rate at which
    P99 TTFT and P99 TPOT both meet their SLOs.
In both, a failed request misses every SLO, and the answer is the highest
tested rate that satisfies the rule (0.0 if none does), without interpolation.

Confidence intervals (`attainment_ci`, `distserve_rate_ci`): a percentile
bootstrap over requests, seeded — resample each run's requests with
replacement (`BOOTSTRAP_RESAMPLES` times), recompute the statistic, and take
the central `confidence` share of the resampled values. For goodput every
rate of the sweep is resampled together, so its interval is a range of
tested rates. With 10 requests a rate the 95% interval of an attainment of
90% is about [70%, 100%]; with 40, about [80%, 98%].
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from epd.bench.client import RequestResult

SLO_NAMES = ("ttft", "tpot", "e2el")
BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
Sweep = Sequence[tuple[float, Sequence[RequestResult]]]


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos_ms: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME in {', '.join(SLO_NAMES)}; got {pair!r}")
        try:
            slos_ms[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos_ms[name] < 0:
            raise ValueError(f"--goodput {pair!r}: an SLO must be >= 0 ms")
    return slos_ms


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0], each in (0, 100]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--percentiles takes comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--percentiles must be in (0, 100], got {text!r}")
    return values


def percentile_key(q: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (the vLLM field-name spelling)."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q}"


def request_tpot_ms(result: RequestResult) -> float | None:
    """Time per output token after the first, in ms; None for 0/1-token outputs or a failed request."""
    if not result.success or result.output_len < 2:
        return None
    return (result.e2el_s - result.ttft_s) * 1000.0 / (result.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (numpy, linear interpolation); 0.0 for no values."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def summarize(values_ms: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p<q> of `values_ms` as `{'mean_<name>_ms': ...}`."""
    arr = np.asarray(values_ms, dtype=float)
    out = {
        f"mean_{name}_ms": float(arr.mean()) if arr.size else 0.0,
        f"median_{name}_ms": percentile(arr, 50),
        f"std_{name}_ms": float(arr.std()) if arr.size else 0.0,
    }
    for q in percentiles:
        out[f"{percentile_key(q)}_{name}_ms"] = percentile(arr, q)
    return out


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """True when `result` completed and meets every SLO in `slos_ms` (a missing TPOT counts as 0)."""
    if not result.success:
        return False
    observed_ms = {"ttft": result.ttft_s * 1000.0, "tpot": request_tpot_ms(result) or 0.0,
                   "e2el": result.e2el_s * 1000.0}
    return all(observed_ms[name] <= slo for name, slo in slos_ms.items())


def latencies_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in ms over completed requests: ttft, tpot (where defined), itl (pooled), e2el."""
    done = [r for r in results if r.success]
    tpots = [request_tpot_ms(r) for r in done]
    return {
        "ttft": [r.ttft_s * 1000.0 for r in done],
        "tpot": [t for t in tpots if t is not None],
        "itl": [itl * 1000.0 for r in done for itl in r.itls_s],
        "e2el": [r.e2el_s * 1000.0 for r in done],
    }


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    percentiles: Sequence[float] = (99.0,), slos_ms: dict[str, float] | None = None) -> dict:
    """The aggregate fields of a run's result JSON (vLLM names)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    done = [r for r in results if r.success]
    total_input = sum(r.input_len for r in done)
    total_output = sum(r.output_len for r in done)
    out: dict = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (sum(meets_slos(r, slos_ms) for r in done) / duration_s) if slos_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    samples = latencies_ms(results)
    for name in LATENCY_METRICS:
        out.update(summarize(samples[name], name, percentiles))
    # mixed traffic: TTFT of text-only and image requests apart
    text_only = [r for r in done if r.num_images == 0]
    with_images = [r for r in done if r.num_images > 0]
    out["num_text_only_completed"] = len(text_only)
    out["num_image_completed"] = len(with_images)
    if text_only and with_images:
        for prefix, group in (("text_only", text_only), ("image", with_images)):
            stats = summarize([r.ttft_s * 1000.0 for r in group], "ttft", percentiles)
            out.update({f"{prefix}_{key}": value for key, value in stats.items()})
    return out


def slo_attainment(results: Sequence[RequestResult], ttft_slo_ms: float, tpot_slo_ms: float) -> float:
    """Share of all requests (failed ones included, as misses) meeting both SLOs."""
    if not results:
        return 0.0
    slos = {"ttft": ttft_slo_ms, "tpot": tpot_slo_ms}
    return sum(meets_slos(r, slos) for r in results) / len(results)


def _met(results: Sequence[RequestResult], ttft_slo_ms: float, tpot_slo_ms: float) -> np.ndarray:
    slos = {"ttft": ttft_slo_ms, "tpot": tpot_slo_ms}
    return np.array([meets_slos(r, slos) for r in results], dtype=float)  # [num_requests], 1.0 = met


def _resampled_attainment(met: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """[resamples] attainments of `met` resampled with replacement."""
    if not met.size:
        return np.zeros(resamples)
    picks = rng.integers(0, met.size, size=(resamples, met.size))  # [resamples, num_requests]
    return met[picks].mean(axis=1)


def _interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1.0 - confidence) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def attainment_ci(results: Sequence[RequestResult], ttft_slo_ms: float, tpot_slo_ms: float, *,
                  confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                  seed: int = 0) -> tuple[float, float]:
    """(low, high) of `slo_attainment`'s `confidence` interval, bootstrapped over requests."""
    rng = np.random.default_rng(seed)
    return _interval(_resampled_attainment(_met(results, ttft_slo_ms, tpot_slo_ms), rng, resamples), confidence)


def distserve_rate_ci(sweep: Sweep, ttft_slo_ms: float, tpot_slo_ms: float, attainment: float = 0.9, *,
                      confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = 0) -> tuple[float, float]:
    """(low, high) of `distserve_max_rate`'s interval: every rate's requests resampled
    together, the goodput of each resampled sweep, its central `confidence` share."""
    rng = np.random.default_rng(seed)
    rates = np.array([rate for rate, _ in sweep], dtype=float)  # [num_rates]
    if not rates.size:
        return 0.0, 0.0
    passed = np.stack([_resampled_attainment(_met(results, ttft_slo_ms, tpot_slo_ms), rng, resamples) >= attainment
                       for _, results in sweep], axis=1)  # [resamples, num_rates]
    goodputs = np.where(passed, rates, 0.0).max(axis=1)  # [resamples]
    return _interval(goodputs, confidence)


def distserve_max_rate(sweep: Sweep, ttft_slo_ms: float, tpot_slo_ms: float,
                       attainment: float = 0.9) -> float:
    """Highest rate with `slo_attainment` >= `attainment` (DistServe's definition); 0.0 if none."""
    ok = [rate for rate, results in sweep if slo_attainment(results, ttft_slo_ms, tpot_slo_ms) >= attainment]
    return max(ok, default=0.0)


def tail_latencies_ms(results: Sequence[RequestResult], q: float = 99.0) -> tuple[float, float]:
    """(P<q> TTFT, P<q> TPOT) in ms, a failed request counting as infinitely slow.

    Requests without a TPOT (0/1-token outputs) are left out of the TPOT
    percentile; if no request has one, P<q> TPOT is 0.0. No requests at
    all gives (inf, inf).
    """
    if not results:
        return math.inf, math.inf
    failed = [math.inf] * sum(not r.success for r in results)
    samples = latencies_ms(results)

    def tail(values: list[float]) -> float:
        values = values + failed
        if not values:
            return 0.0
        with np.errstate(invalid="ignore"):
            value = float(np.percentile(values, q))
        return math.inf if math.isnan(value) else value  # inf - inf interpolation gives nan

    return tail(samples["ttft"]), tail(samples["tpot"])


def p99_max_rate(sweep: Sweep, ttft_slo_ms: float, tpot_slo_ms: float, q: float = 99.0) -> float:
    """Highest rate whose P<q> TTFT and P<q> TPOT both meet their SLOs (the EPD paper's); 0.0 if none."""
    ok = []
    for rate, results in sweep:
        ttft_ms, tpot_ms = tail_latencies_ms(results, q)
        if ttft_ms <= ttft_slo_ms and tpot_ms <= tpot_slo_ms:
            ok.append(rate)
    return max(ok, default=0.0)
