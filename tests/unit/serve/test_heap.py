"""`freeze_startup_heap`: what is alive at start-up leaves the collector's generations."""
from __future__ import annotations

import gc
import subprocess
import sys

from epd.processes.heap import freeze_startup_heap


def test_objects_alive_at_start_up_are_frozen_and_garbage_before_it_is_collected():
    class Node:
        pass

    kept = [Node()]  # a tracked container alive at "start-up"
    cycle = Node()
    cycle.self = cycle  # garbage that only a collection frees
    collected = []
    gc.callbacks.append(cb := lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    del cycle
    try:
        frozen = freeze_startup_heap()
        assert sum(collected) >= 1  # the cycle went before the freeze
        assert frozen == gc.get_freeze_count() >= 1
        assert not any(o is kept for o in gc.get_objects())  # no generation walks it any more
        kept.append(Node())  # still an ordinary, mutable object
        assert len(kept) == 2
    finally:
        gc.callbacks.remove(cb)
        gc.unfreeze()  # the test process's heap goes back to normal
    assert any(o is kept for o in gc.get_objects())


def test_a_process_that_froze_its_heap_exits_without_leak_reports():
    # triton's nanobind bindings count their live objects when unloaded: frozen ones were never
    # freed and each process printed "nanobind: leaked ..." at exit; unfrozen at exit, they are freed
    code = ("import triton.language\n"
            "from epd.processes.heap import freeze_startup_heap\n"
            "assert freeze_startup_heap() > 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr
