"""`epd serve --mode aggregated --tensor-parallel-size 2`: a chat gives transformers' greedy
text through a worker whose model is sharded over two processes (the image path is the
offline test's: tests/unit/engine/test_tensor_parallel.py); with
its follower rank killed, the worker goes down as one, is restarted, and the next chat gives
the same text."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import chat_text, start_server

MAX_TOKENS = 8


def _followers(pgid: int) -> list[int]:
    """The tensor-parallel follower processes of the server in process group `pgid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"epd.engine.parallel.follower" in cmdline and os.getpgid(int(proc.name)) == pgid:
                found.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
    return found


@pytest.mark.slow
def test_tp2_serves_transformers_text_and_survives_a_rank_death(tiny_model, tmp_path):
    messages = CHATS["text_only"][0]
    expected = hf_generate_text(tiny_model, messages, [], max_new_tokens=MAX_TOKENS)
    srv = start_server(tiny_model, tmp_path, "aggregated", "--tensor-parallel-size", "2")
    try:
        assert chat_text(srv, messages, MAX_TOKENS) == expected
        (follower,) = _followers(srv.pgid)
        os.kill(follower, signal.SIGKILL)
        # the group fails at its next step, the worker restarts (a new follower), the request is sent again
        assert chat_text(srv, messages, MAX_TOKENS) == expected
        assert _followers(srv.pgid) and follower not in _followers(srv.pgid)
        assert "tensor-parallel rank 1" in Path(srv.log_path).read_text()
    finally:
        srv.stop()
