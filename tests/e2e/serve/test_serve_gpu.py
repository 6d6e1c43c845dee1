"""`epd serve --mode e-p-d` on one GPU: every worker placed on it, the two
KV-cache workers splitting its memory, and greedy text equal to transformers'
(computed on the CPU). Plain HTTP: the GPU machine has no `openai` package."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS
from testkit.server import ServerProcess, chat_text, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def test_e_p_d_on_one_gpu_equals_transformers(tiny_model, tmp_path):
    port = free_port()
    srv = ServerProcess(["serve", tiny_model, "--mode", "e-p-d", "--port", str(port), "--dtype", "float32"],
                        port, str(tmp_path / "server.log")).wait_ready()
    try:
        log = srv.log()
        for worker in ("encoder-0", "prefill-0", "decode-0"):
            assert f"{worker} on cuda:0" in log, log
        assert log.count("KV cache up to 45% of its memory") == 2, log
        for messages, images in CHATS.values():
            assert chat_text(srv, messages, 10) == hf_generate_text(tiny_model, messages, images, 10)
    finally:
        assert srv.stop() == 0, srv.log()
