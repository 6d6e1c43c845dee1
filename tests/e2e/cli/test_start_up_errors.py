"""A start-up error from the `epd` command, run as a user runs it (a real
subprocess): one line on stderr and exit code 2, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest
from testkit.family_checkpoints import SUPPORTED
from testkit.family_checkpoints import config_only_checkpoint as _checkpoint


@pytest.mark.parametrize("command", [["chat", "{dir}", "--prompt", "hi"], ["serve", "{dir}", "--port", "18931"]])
def test_cli_start_up_error_is_a_message_not_a_traceback(tmp_path, command):
    model_dir = _checkpoint(tmp_path, {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]})
    argv = [a.format(dir=model_dir) for a in command]
    proc = subprocess.run([sys.executable, "-m", "epd.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"epd {command[0]}: model_type 'llava'" in proc.stderr
    assert all(s in proc.stderr for s in SUPPORTED)


def test_the_cli_reports_a_bad_range_and_exits_2(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "serve", tiny_model, "--encoders", "4-2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "epd serve: --encoders MIN-MAX needs 1 <= MIN <= MAX, got 4-2" in proc.stderr
