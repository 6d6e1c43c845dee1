"""bench/dev/vllm_ec_proxy.py (the front of vLLM's encoder disaggregation in `python -m bench.dev.vs_vllm --vllm-ec`),
started as the bench starts it (`vllm_servers.ProxyProcess`, a subprocess) in front of two fake
OpenAI servers on 127.0.0.1 standing in for vLLM's encoder and prefill-decode instances
(vLLM runs in its own environment, not in tests), driven by the bench's own client."""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from bench.dev.vllm_ec_proxy import encoder_body, has_media
from bench.dev.vllm_servers import ProxyProcess, ec_transfer_config
from epd.bench.client import build_payload, send_chat_request
from epd.bench.datasets import BenchRequest
from testkit.fake_openai_server import running_fake_server

ENCODER_S = 0.5  # the stand-in encoder's time per request: one token at this delay
IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(encoder, pd, proxy): the two stand-ins' states and the running proxy."""
    with running_fake_server() as encoder, running_fake_server() as pd:
        encoder.token_delay_s = ENCODER_S
        proxy = ProxyProcess(encoder.base_url, pd.base_url, os.sched_getaffinity(0),
                             tmp_path_factory.mktemp("proxy") / "proxy.log")
        try:
            assert proxy.wait_ready(30) == "fake-model"  # /health through both, /v1/models from the PD one
            yield encoder, pd, proxy
        finally:
            proxy.stop()


def _send(proxy: ProxyProcess, request: BenchRequest):
    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            return await send_chat_request(http, f"{proxy.base_url}/v1/chat/completions", "fake-model", request,
                                           timeout_s=30)
    return asyncio.run(go())


def test_images_go_to_the_encoder_with_one_token_first_then_unchanged_to_the_pd_instance(deployment):
    encoder, pd, proxy = deployment
    request = BenchRequest("describe these", output_len=5, image_urls=(IMAGE,) * 4, text_first=True)
    before_e, before_pd = len(encoder.payloads), len(pd.payloads)
    result = _send(proxy, request)
    assert result.success, result.error
    assert result.output_len == 5 and result.generated_text == "t0 t1 t2 t3 t4 "
    # the PD instance's first token came after the encoder's whole answer (the proxy waits for it)
    assert result.ttft_s >= ENCODER_S
    [to_encoder] = encoder.payloads[before_e:]
    [to_pd] = pd.payloads[before_pd:]
    sent = build_payload("fake-model", request)
    assert to_pd == sent
    assert to_encoder["max_tokens"] == 1 and to_encoder["stream"] is False
    assert "min_tokens" not in to_encoder and "stream_options" not in to_encoder
    assert to_encoder["messages"] == sent["messages"]


def test_text_only_skips_the_encoder(deployment):
    encoder, pd, proxy = deployment
    before_e, before_pd = len(encoder.payloads), len(pd.payloads)
    result = _send(proxy, BenchRequest("just text", output_len=3))
    assert result.success and result.output_len == 3
    assert result.ttft_s < ENCODER_S
    assert len(encoder.payloads) == before_e and len(pd.payloads) == before_pd + 1


def test_an_encoder_error_is_the_answer_and_the_pd_instance_never_sees_the_request(deployment):
    encoder, pd, proxy = deployment
    before_e, before_pd = len(encoder.payloads), len(pd.payloads)
    body = build_payload("fake-model", BenchRequest("FAIL here", output_len=4, image_urls=(IMAGE,)))
    r = httpx.post(f"{proxy.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad prompt FAIL"
    assert len(encoder.payloads) == before_e + 1 and len(pd.payloads) == before_pd
    bad = httpx.post(f"{proxy.base_url}/v1/chat/completions", content=b"[1, 2]", timeout=30)
    assert bad.status_code == 400 and "JSON object" in bad.json()["error"]["message"]


def test_the_pd_instances_errors_pass_through(deployment):
    _, _, proxy = deployment
    body = build_payload("fake-model", BenchRequest("FAIL text", output_len=2))
    r = httpx.post(f"{proxy.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad prompt FAIL"


def test_media_detection_and_the_encoders_body():
    assert has_media({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]})
    assert not has_media({"messages": [{"role": "user", "content": "hi"}]})
    assert not has_media({"prompt": "x"})
    body = {"messages": [], "max_completion_tokens": 9, "stream": True}
    assert encoder_body(body) == {"messages": [], "max_completion_tokens": 1, "max_tokens": 1, "stream": False}


def test_ec_transfer_config_names_vllms_example_connector_and_the_shared_path(tmp_path):
    config = json.loads(ec_transfer_config("ec_producer", tmp_path))
    assert config == {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                      "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
