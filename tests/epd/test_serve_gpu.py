"""`epd serve --mode e-p-d` on one GPU: every worker placed on it, the two
KV-cache workers splitting its memory, and greedy text equal to transformers'
(computed on the CPU). Plain HTTP: the GPU machine has no `openai` package."""
from __future__ import annotations

import httpx
import pytest
import torch
from hf_reference import hf_generate_text
from media import image_bytes, image_part
from server import ServerProcess, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IMG_A, IMG_B = image_bytes(100, 60, seed=1), image_bytes(37, 150, seed=2, fmt="JPEG")
CHATS = [
    ([{"role": "user", "content": "Tell me about the red chair."}], []),
    ([{"role": "user", "content": [image_part(IMG_A), {"type": "text", "text": "Describe it."}]}], [IMG_A]),
    ([{"role": "user", "content": [image_part(IMG_A), image_part(IMG_B), {"type": "text", "text": "Compare."}]}],
     [IMG_A, IMG_B]),
]


def test_e_p_d_on_one_gpu_equals_transformers(tiny_model, tmp_path):
    port = free_port()
    srv = ServerProcess(["serve", tiny_model, "--mode", "e-p-d", "--port", str(port), "--dtype", "float32"],
                        port, str(tmp_path / "server.log")).wait_ready()
    try:
        log = srv.log()
        for worker in ("encoder-0", "prefill-0", "decode-0"):
            assert f"{worker} on cuda:0" in log, log
        assert log.count("KV cache up to 45% of its memory") == 2, log
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        for messages, images in CHATS:
            r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120,
                           json={"model": model, "messages": messages, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == hf_generate_text(tiny_model, messages, images, 10)
    finally:
        assert srv.stop() == 0, srv.log()
