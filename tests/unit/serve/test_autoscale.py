"""The encoder autoscaling policy on a synthetic clock: threshold, window,
cooldown, idleness, bounds. Milliseconds, no sleeping, no torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from epd.processes.autoscale import DOWN, UP, Decision, EncoderAutoscaler, EncoderLoad, EncoderScaling

SCALING = EncoderScaling(min_encoders=1, max_encoders=3, scale_up_queue_s=1.0, scale_up_window_s=5.0, idle_s=20.0,
                         cooldown_s=10.0)


def load(worker_id: str, oldest_s: float = 0.0, depth: int = 0, answered: int = 0) -> EncoderLoad:
    return EncoderLoad(worker_id, oldest_s, depth, answered)


def backlogged(*ids: str, oldest_s: float = 2.0, answered: int = 0) -> list[EncoderLoad]:
    return [load(w, oldest_s, depth=4, answered=answered) for w in ids]


def run(scaler: EncoderAutoscaler, times: list[float], loads, num_starting: int = 0) -> list[tuple[float, Decision]]:
    """Observes `loads` (a list, or a function of the time) at each time; the decisions taken."""
    out = []
    for t in times:
        decision = scaler.observe(t, loads(t) if callable(loads) else loads, num_starting)
        if decision is not None:
            out.append((t, decision))
    return out


def test_a_backlog_that_lasts_the_window_adds_one_encoder():
    scaler = EncoderAutoscaler(SCALING)
    decisions = run(scaler, [0.0, 1.0, 2.5, 4.0, 4.9, 5.0, 5.5], backlogged("encoder-0"))
    assert decisions == [(5.0, Decision(UP))]


def test_a_backlog_that_breaks_restarts_the_window():
    scaler = EncoderAutoscaler(SCALING)
    busy, calm = backlogged("encoder-0"), backlogged("encoder-0", oldest_s=0.5)  # 0.5 s < the 1 s threshold
    assert run(scaler, [0.0, 4.0], busy) == []
    assert run(scaler, [4.5], calm) == []
    assert run(scaler, [5.0, 9.0], busy) == []  # 4 s of the new window
    assert run(scaler, [10.0], busy) == [(10.0, Decision(UP))]


def test_the_least_backlogged_encoder_decides():
    scaler = EncoderAutoscaler(SCALING)
    loads = [load("encoder-0", 3.0, 9), load("encoder-1", 0.2, 1)]  # one backlog, one keeping up
    assert run(scaler, [0.0, 5.0, 10.0, 30.0], loads) == []


def test_no_scale_up_while_an_added_encoder_is_starting_or_at_the_maximum():
    scaler = EncoderAutoscaler(SCALING)
    assert run(scaler, [0.0, 5.0, 20.0], backlogged("encoder-0"), num_starting=1) == []
    full = EncoderAutoscaler(SCALING)
    assert run(full, [0.0, 5.0, 20.0], backlogged("encoder-0", "encoder-1", "encoder-2")) == []


def test_cooldown_spaces_decisions_and_each_scale_up_needs_its_own_window():
    scaler = EncoderAutoscaler(SCALING)
    two = backlogged("encoder-0", "encoder-1")
    times = [0.0, 5.0, 9.0, 14.0, 15.0, 19.9, 20.0]
    decisions = run(scaler, times, lambda t: backlogged("encoder-0") if t <= 5.0 else two)
    # up at 5; at 15 the cooldown is over but the window restarted at 9 (the first observation after it)
    assert decisions == [(5.0, Decision(UP)), (15.0, Decision(UP))]


def test_an_idle_encoder_above_the_minimum_is_removed_newest_first():
    scaler = EncoderAutoscaler(SCALING)
    idle = [load("encoder-0", answered=7), load("encoder-2", answered=3), load("encoder-1", answered=5)]
    decisions = run(scaler, [0.0, 10.0, 19.9, 20.0], idle)
    assert decisions == [(20.0, Decision(DOWN, "encoder-2"))]
    # cooldown, then the next newest; never below the minimum
    rest = [load("encoder-0", answered=7), load("encoder-1", answered=5)]
    assert run(scaler, [25.0, 29.9, 30.0], rest) == [(30.0, Decision(DOWN, "encoder-1"))]
    assert run(scaler, [40.0, 100.0, 1000.0], [load("encoder-0", answered=7)]) == []


def test_an_encoder_that_answers_images_or_holds_a_queue_is_not_idle():
    scaler = EncoderAutoscaler(SCALING)
    # encoder-1 answers an image every 5 s (an empty queue at each look): busy
    working = lambda t: [load("encoder-0"), load("encoder-1", answered=int(t // 5))]  # noqa: E731
    assert run(scaler, [0.0, 5.0, 10.0, 15.0, 19.0], working) == []
    assert run(scaler, [20.0], working) == [(20.0, Decision(DOWN, "encoder-0"))]  # idle since 0
    queued = EncoderAutoscaler(SCALING)
    held = [load("encoder-0"), load("encoder-1", oldest_s=0.1, depth=1, answered=2)]  # the same image queued
    assert run(queued, [0.0, 19.0, 20.0], held) == [(20.0, Decision(DOWN, "encoder-0"))]


def test_an_encoder_whose_stats_are_late_is_inside_a_batch_not_idle():
    scaler = EncoderAutoscaler(SCALING)
    # encoder-1's last stats (empty queue) are 5 s old: it has been encoding since
    late = lambda t: [load("encoder-0", answered=int(t)), EncoderLoad("encoder-1", 0.0, 0, 3, stats_age_s=5.0)]  # noqa: E731
    assert run(scaler, [0.0, 20.0, 40.0], late) == []
    on_time = [load("encoder-0", answered=41), EncoderLoad("encoder-1", 0.0, 0, 3, stats_age_s=0.2)]
    assert run(scaler, [41.0, 59.9, 60.0], on_time) == [(60.0, Decision(DOWN, "encoder-1"))]  # busy till 40


def test_an_encoder_that_left_is_forgotten_and_a_returning_one_starts_busy():
    scaler = EncoderAutoscaler(SCALING)
    pair = lambda t: [load("encoder-0", answered=int(t)), load("encoder-1")]  # noqa: E731  encoder-0 works
    assert run(scaler, [0.0, 15.0], pair) == []
    assert run(scaler, [16.0], [load("encoder-0", answered=16)]) == []  # encoder-1 gone (a restart, say)
    assert run(scaler, [17.0, 36.9], pair) == []  # back: idle from 17, not from 0
    assert run(scaler, [37.0], pair) == [(37.0, Decision(DOWN, "encoder-1"))]


def test_no_encoder_no_decision():
    scaler = EncoderAutoscaler(SCALING)
    assert run(scaler, [0.0, 100.0], []) == []


@pytest.mark.parametrize("value, expected", [("2", (2, 2)), ("1-4", (1, 4)), ("3-3", (3, 3))])
def test_the_encoders_flag_takes_a_count_or_a_range(value, expected):
    assert EncoderScaling.parse_range(value) == expected


@pytest.mark.parametrize("value", ["", "-2", "1-", "a-b", "1-2-3", "1.5"])
def test_a_malformed_range_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match="--encoders takes N or MIN-MAX"):
        EncoderScaling.parse_range(value)


def test_bad_bounds_and_thresholds_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"1 <= MIN <= MAX, got 3-2"):
        EncoderScaling(3, 2)
    with pytest.raises(ValueError, match=r"1 <= MIN <= MAX, got 0-2"):
        EncoderScaling(0, 2)
    with pytest.raises(ValueError, match="--encoder-idle-s must not be negative"):
        EncoderScaling(1, 2, idle_s=-1)
    with pytest.raises(ValueError, match="--encoder-scale-up-queue-s must not be negative"):
        EncoderScaling(1, 2, scale_up_queue_s=-1)


def test_the_policy_imports_no_torch():
    code = "import sys, epd.processes.autoscale; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_flags_build_the_scaling_config(tiny_model):
    from epd.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", tiny_model, "--encoders", "2-5", "--encoder-scale-up-queue-s", "0.5",
                                      "--encoder-scale-up-window-s", "3", "--encoder-idle-s", "7",
                                      "--encoder-scale-cooldown-s", "2"])
    config = serve_config(args)
    assert config.num_encoders == 2
    assert config.encoder_scaling == EncoderScaling(2, 5, scale_up_queue_s=0.5, scale_up_window_s=3.0, idle_s=7.0,
                                                    cooldown_s=2.0)
    fixed = serve_config(build_parser().parse_args(["serve", tiny_model, "--encoders", "3"]))
    assert (fixed.num_encoders, fixed.encoder_scaling) == (3, None)
    same = serve_config(build_parser().parse_args(["serve", tiny_model, "--encoders", "2-2"]))
    assert (same.num_encoders, same.encoder_scaling) == (2, None)  # a range of one is a fixed count


@pytest.mark.parametrize("flags, message", [
    (["--mode", "aggregated", "--encoders", "1-2"], "needs a mode with encoder workers"),
    (["--encoders", "1-65"], "MAX may be at most 64"),
    (["--encoders", "3-1"], r"1 <= MIN <= MAX, got 3-1"),
    (["--encoders", "two"], "--encoders takes N or MIN-MAX"),
    (["--encoders", "1-2", "--encoder-idle-s", "-1"], "--encoder-idle-s must not be negative"),
])
def test_bad_scaling_flags_are_refused_naming_them(tiny_model, flags, message):
    from epd.cli import build_parser, serve_config

    with pytest.raises(ValueError, match=message):
        serve_config(build_parser().parse_args(["serve", tiny_model, *flags]))


def test_scaling_needs_workers_the_launcher_starts(tiny_model, tmp_path):
    from epd.config import ServeConfig
    from epd.transport.wire.auth import make_keys

    keys = str(make_keys(tmp_path / "keys"))
    with pytest.raises(ValueError, match="not --external-workers"):
        ServeConfig(model=tiny_model, num_encoders=1, encoder_scaling=EncoderScaling(1, 2), external_workers=True,
                    worker_keys=keys)
