"""The test servers outlive no test run (issue 44, item 8): a process started through
`testkit.server.died_with_parent` (every `ServerProcess`) gets SIGINT from the kernel
when the test process dies without running its fixtures' teardown, as pytest-xdist's
workers do on Ctrl-C."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]

# The "test process": starts a long sleeper as a test server starts, says its pid, waits.
TEST_PROCESS = ("import subprocess, sys, time; sys.path.insert(0, sys.argv[1]); "
                "from testkit.server import died_with_parent; "
                "p = subprocess.Popen(died_with_parent(sys.executable, '-c', 'import time; time.sleep(600)')); "
                "print(p.pid, flush=True); time.sleep(600)")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_gets_sigint_when_the_test_process_is_killed():
    test_process = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, str(TESTS)], stdout=subprocess.PIPE,
                                    text=True)
    server = int(test_process.stdout.readline())
    try:
        time.sleep(0.5)  # past the exec: the sleeper runs
        assert _running(server)
        test_process.kill()  # no teardown, no exit handler
        test_process.wait(10)
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(server)
    finally:
        test_process.kill()
        if _running(server):
            subprocess.run(["kill", "-9", str(server)])
