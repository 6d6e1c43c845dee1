"""What the planner simulates: each stage's service times, the workload's requests, the splits.

`ServiceTimes` come from bench/plan_measure.py (and `bench.plan.calibrate`),
`Workload` describes the requests of `epd bench serve --dataset random-mm`
(which of a seed's requests are text-only is the dataset's own draw), and
`splits(N)` lists every way to run N workers; bench/plan_sim.py serves them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from epd.bench.datasets import draw_random_mm

MODES = ("aggregated", "e-pd", "e-p-d")


@dataclass(frozen=True)
class ServiceTimes:
    """What one worker takes alone, in ms: encode per image, prefill per prompt token
    (text and image placeholders alike), a decode step as base + per running sequence.
    The serving overheads the offline engine does not have: `step_overhead_ms` more
    for every engine step a worker runs, and `request_overhead_ms` from a request's
    arrival to its first stage (HTTP, the API process, the hops between processes),
    simulated as work of the API process: one thread, requests in arrival order,
    sharing the cores with the workers; a text-only request's is
    `text_request_overhead_ms` where given (no image to decode and hash)."""

    encode_ms_per_image: float
    prefill_ms_per_token: float
    decode_step_ms: float
    decode_ms_per_seq: float = 0.0
    kv_transfer_ms: float = 0.0
    step_overhead_ms: float = 0.0
    request_overhead_ms: float = 0.0
    text_request_overhead_ms: float | None = None

    def request_overhead_of(self, is_text_only: bool) -> float:
        text = self.text_request_overhead_ms
        return text if is_text_only and text is not None else self.request_overhead_ms

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_ms_per_token * num_tokens

    def decode_ms(self, batch: int) -> float:
        return self.decode_step_ms + self.decode_ms_per_seq * batch if batch else 0.0


@dataclass(frozen=True)
class Workload:
    """The requests: images, prompt tokens (text + image placeholders) and output tokens of each.

    With `text_only_ratio` > 0 a seeded share of them has no image and `text_prompt_tokens`
    prompt tokens (the same text without placeholders): the requests `epd bench serve
    --dataset random-mm --text-only-ratio` draws for the trace's seed, a draw that also
    depends on its `--input-len` and `--image-size` list (`input_len`, `image_sizes`).
    """

    images_per_request: int
    prompt_tokens: int
    output_len: int
    text_only_ratio: float = 0.0
    text_prompt_tokens: int = 0
    input_len: int = 1
    image_sizes: tuple[tuple[int, int], ...] = ((1024, 1024),)

    def __post_init__(self) -> None:
        if not 0.0 <= self.text_only_ratio <= 1.0:
            raise ValueError(f"text_only_ratio must be in [0, 1], got {self.text_only_ratio}")
        if self.text_only_ratio and self.images_per_request and self.text_prompt_tokens < 1:
            raise ValueError("a workload with text-only requests needs their text_prompt_tokens")

    def prompt_tokens_of(self, is_text_only: bool) -> int:
        return self.text_prompt_tokens if is_text_only and self.images_per_request else self.prompt_tokens


@functools.lru_cache(maxsize=1024)  # the planner simulates every split on the same seeds
def text_only_requests(workload: Workload, num_requests: int, seed: int) -> tuple[bool, ...]:
    """Which of a trace's requests have no image: as `bench serve --seed seed` draws its dataset."""
    if not workload.text_only_ratio or not workload.images_per_request:
        return (not workload.images_per_request,) * num_requests
    draws = draw_random_mm(num_requests, workload.input_len, images_per_request=workload.images_per_request,
                           image_sizes=list(workload.image_sizes), text_only_ratio=workload.text_only_ratio,
                           seed=seed)
    return tuple(draw.is_text_only for draw in draws)


@dataclass(frozen=True)
class Split:
    """A mode and its worker counts; `prefill` counts pd workers in e-pd and aggregated ones in aggregated."""

    mode: str
    encoders: int = 0
    prefill: int = 1
    decode: int = 0

    @property
    def label(self) -> str:
        if self.mode == "aggregated":
            return f"{self.prefill}A"
        if self.mode == "e-pd":
            return f"{self.encoders}E{self.prefill}PD"
        return f"{self.encoders}E{self.prefill}P{self.decode}D"

    @property
    def num_workers(self) -> int:
        return self.encoders + self.prefill + self.decode

    def worker_args(self) -> list[str]:
        """The `epd serve` flags of this split's worker counts (its mode is `--mode`)."""
        args = ["--prefill", str(self.prefill)]
        if self.mode != "aggregated":
            args += ["--encoders", str(self.encoders)]
        if self.mode == "e-p-d":
            args += ["--decode", str(self.decode)]
        return args


def splits(num_workers: int) -> list[Split]:
    """Every split of exactly `num_workers` workers: aggregated, e-pd (E + PD), e-p-d (E + P + D)."""
    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    out = [Split("aggregated", prefill=num_workers)]
    out += [Split("e-pd", encoders=e, prefill=num_workers - e) for e in range(num_workers - 1, 0, -1)]
    out += [Split("e-p-d", encoders=e, prefill=p, decode=num_workers - e - p)
            for e in range(num_workers - 2, 0, -1) for p in range(1, num_workers - e)]
    return out
