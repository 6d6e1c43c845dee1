"""The core lease (transport/host/core_lease.py) on a real file: the threads each
engine worker takes as the others start and stop work, across processes too."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from epd.transport.host.core_lease import (STALE_S, STEAL_LIMIT, CoreShare, StealMeter, create_lease_file,
                                      read_cpu_times, stolen_share)


def _leases(tmp_path, num_slots: int, num_cores: int):
    path = str(tmp_path / "core-lease")
    create_lease_file(path, num_slots)
    calls = [[] for _ in range(num_slots)]
    leases = [CoreShare(path, slot, num_cores).open(calls[slot].append) for slot in range(num_slots)]
    return path, leases, calls


def test_a_worker_alone_takes_every_core_and_shares_them_while_others_work(tmp_path):
    _, (prefill, decode), calls = _leases(tmp_path, 2, num_cores=2)
    assert decode.take() == 2  # the prefill worker is idle: both cores
    assert prefill.take() == 1  # both busy: one each
    assert decode.take() == 1
    prefill.release()
    assert decode.take() == 2  # the prefill worker went idle again
    assert calls == [[1], [2, 1, 2]]  # torch is told only when the count changes


def test_three_workers_share_by_how_many_are_busy(tmp_path):
    _, (a, b, c), _ = _leases(tmp_path, 3, num_cores=7)
    assert a.take() == 7
    assert b.take() == 3
    assert c.take() == 2
    assert a.take() == 2
    b.release()
    c.release()
    assert a.take() == 7


def test_a_stale_mark_counts_as_idle(tmp_path):
    # a worker killed mid-step never releases: its mark stops counting after STALE_S
    _, (dead, alive), _ = _leases(tmp_path, 2, num_cores=2)
    now = time.monotonic()
    dead.take(now=now)
    assert alive.take(now=now + STALE_S / 2) == 1
    assert alive.take(now=now + STALE_S + 0.1) == 2


def test_another_process_sees_the_marks(tmp_path):
    _, (here,), _ = _leases(tmp_path, 1, num_cores=2)
    two_slots = str(tmp_path / "two")
    create_lease_file(two_slots, 2)
    mine = CoreShare(two_slots, 0, 2).open(lambda n: None)
    script = ("import sys; from epd.transport.host.core_lease import CoreShare;"
              "lease = CoreShare(sys.argv[1], 1, 2).open(lambda n: None); print(lease.take()); "
              "sys.stdin.readline(); lease.release(); print('released', flush=True); sys.stdin.readline()")
    other = subprocess.Popen([sys.executable, "-c", script, two_slots], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "2"  # this process was idle
        assert mine.take() == 1  # the other process's mark is seen here
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "released"
        assert mine.take() == 2
    finally:
        other.kill()
        other.wait(timeout=10)
    assert here.take() == 2  # one slot: always every core


def test_a_slot_outside_the_file_is_refused(tmp_path):
    path = str(tmp_path / "core-lease")
    create_lease_file(path, 2)
    with pytest.raises(ValueError, match="slot 2 is outside the lease file's 2 slots"):
        CoreShare(path, 2, 2).open(lambda n: None)


def _cpu_times_of(readings):
    """A source of (total, steal) jiffies: the hypervisor's, which no test here can set."""
    it = iter(readings)
    return lambda: next(it)


def test_the_steal_is_the_stolen_share_of_each_window():
    meter = StealMeter(_cpu_times_of([(1000, 0), (1200, 10), (1400, 90), (1500, 90)]), window_s=2.0, now=0.0)
    assert meter.update(1.0) == 0.0  # no window has passed: nothing read
    assert meter.update(2.0) == pytest.approx(10 / 200)
    assert meter.update(4.5) == pytest.approx(80 / 200)
    assert meter.update(7.0) == 0.0  # a quiet window again
    assert stolen_share((1000, 0), (1200, 50)) == 0.25  # one window's share, from two readings
    assert stolen_share(None, (1200, 50)) is None and stolen_share((1200, 50), (1200, 50)) is None


def test_a_host_without_a_steal_column_counts_as_unstolen(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 100\n")  # a kernel before steal time
    assert read_cpu_times(str(stat)) is None
    assert read_cpu_times(str(tmp_path / "missing")) is None
    meter = StealMeter(lambda: read_cpu_times(str(stat)), window_s=0.0)
    assert meter.update(time.monotonic()) == 0.0


def test_this_hosts_cpu_times_are_read():
    total, stolen = read_cpu_times()
    assert total > 0 and 0 <= stolen <= total
    total_later, _ = read_cpu_times()
    assert total_later >= total


def test_a_stolen_host_lends_no_cores(tmp_path):
    # 30-45% stolen made the lease 0.49x one fixed thread (docs/benchmarks.md): past the
    # limit each worker takes its even share, whoever else is busy, and lends again after
    path = str(tmp_path / "core-lease")
    create_lease_file(path, 2)
    steal = STEAL_LIMIT * 3
    meter = StealMeter(_cpu_times_of([(0, 0), (1000, int(1000 * steal)), (2000, int(1000 * steal))]),
                       window_s=1.0, now=0.0)
    calls = []
    decode = CoreShare(path, 1, 2).open(calls.append, meter)
    assert decode.take(now=0.5) == 2  # no window yet: the prefill worker is idle, both cores
    assert decode.take(now=1.0) == 1  # stolen: the even share of 2 cores over 2 workers
    assert decode.take(now=1.5) == 1
    assert decode.take(now=2.0) == 2  # the next window was quiet
    assert calls == [2, 1, 2]
