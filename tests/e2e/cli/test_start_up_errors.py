"""A start-up error from the `epd` command, run as a user runs it (a real
subprocess): one line on stderr and exit code 2, no traceback."""
from __future__ import annotations

import json
import shutil
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


def _head_for_another_target(tmp_path, tiny_model, tiny_draft) -> tuple[str, str]:
    """A real EAGLE-3 head whose config says it drafts for a target of hidden size 2048."""
    from epd.tools.make_eagle3 import make_eagle3

    head = make_eagle3(tmp_path / "head", "tiny-eagle3")
    config = json.loads((head / "config.json").read_text())
    config["target_hidden_size"] = 2048
    (head / "config.json").write_text(json.dumps(config))
    return (json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}),
            f"the EAGLE-3 head at {head} is for a target of hidden size 2048")


def _draft_with_another_vocabulary(tmp_path, tiny_model, tiny_draft) -> tuple[str, str]:
    """The tiny target's real draft model, its tokenizer replaced by another (2048 tokens)."""
    from epd.families.qwen_vl.presets import qwen_tokenizer

    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft, draft)
    qwen_tokenizer(2048).save_pretrained(str(draft))
    return (json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}),
            f"the draft model {draft} has another vocabulary than the target's")


def _too_many_draft_tokens(tmp_path, tiny_model, tiny_draft) -> tuple[str, str]:
    return (json.dumps({"method": "ngram", "num_speculative_tokens": 100000}),
            "num_speculative_tokens must be an integer from 1 to 32, got 100000")


@pytest.mark.parametrize("case", [_head_for_another_target, _draft_with_another_vocabulary, _too_many_draft_tokens])
def test_a_speculative_config_that_cannot_serve_the_target_is_refused_before_any_worker(tmp_path, tiny_model,
                                                                                        tiny_draft, case):
    """Issue 44, item 8: found by the CLI from the files (one line, exit 2), where it was
    found inside each decode-side worker (two tracebacks and exit 3 after ~20 s)."""
    spec, problem = case(tmp_path, tiny_model, tiny_draft)
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "serve", tiny_model, "--mode", "e-p-d", "--port", "18932",
                           "--speculative-config", spec], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "EPD: worker" not in proc.stdout, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("epd serve:")]
    assert len(errors) == 1 and problem in errors[0], proc.stderr[-2000:]
