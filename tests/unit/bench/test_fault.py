"""`python -m bench.dev.fault`'s own arithmetic: which pid to kill, when goodput is back."""
from __future__ import annotations

import pytest

from bench.dev.fault import goodput_back_after_s, worker_pid
from epd.bench.client import RequestResult

SLOS = {"ttft": 100.0}


def result(start_s: float, ttft_ms: float, success: bool = True) -> RequestResult:
    return RequestResult(success=success, start_s=start_s, ttft_s=ttft_ms / 1e3, e2el_s=ttft_ms / 1e3 + 0.01,
                         output_len=1)


def test_the_latest_pid_of_the_role_is_killed():
    log = ("EPD: worker encoder-0 pid 10\nEPD: worker prefill-0 pid 11\nEPD: worker decode-0 pid 12\n"
           "EPD: worker prefill-0 exited with code -9; restarting in 0.5 s\nEPD: worker prefill-0 pid 13\n")
    assert worker_pid(log, "prefill") == ("prefill-0", 13)
    assert worker_pid(log, "decode") == ("decode-0", 12)
    with pytest.raises(ValueError, match="no pd worker"):
        worker_pid(log, "pd")


def test_goodput_is_back_from_the_first_request_after_which_90_percent_meet_the_slos():
    before = [result(t, 50) for t in (0, 1, 2)]  # fine before the kill at 3 s: not counted
    hurt = [result(3.5, 900), result(4.0, 0, success=False), result(4.5, 400)]
    healed = [result(5.0 + i / 2, 50) for i in range(18)] + [result(14.5, 300)]  # one late straggler
    # from 4.0 s on 18 of 21 meet the SLO (86%); from 4.5 s on, 18 of 20 (90%): back 1.5 s after the kill
    assert goodput_back_after_s(before + hurt + healed, kill_s=3.0, slos_ms=SLOS) == pytest.approx(1.5)
    assert goodput_back_after_s(before + hurt, kill_s=3.0, slos_ms=SLOS) is None
    assert goodput_back_after_s(before, kill_s=3.0, slos_ms=SLOS) is None  # nothing sent after the kill
