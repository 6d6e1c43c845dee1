"""Audio through `epd serve` (Qwen2.5-Omni's thinker, the `qwen2.5-omni-tiny` preset, float32), in
aggregated mode: a chat with OpenAI's `input_audio` clip, sent with the real openai client,
answers what the offline `LLM.chat` answers (greedy text, prompt and output token ids, each
token's top-5 logprobs; offline equals transformers' thinker, tests/unit/engine/
test_qwen_omni_vs_transformers.py), for a 16 kHz clip and one the encoder resamples; vLLM's
`audio_url` part gives the same, and /tokenize counts the clip's prompt as the chat does. A corrupt clip, one past --max-audio-seconds and one past
--limit-mm-per-prompt are each a 400 with an OpenAI error body, and the server keeps serving."""
from __future__ import annotations

import base64
import io
import time
import wave

import httpx
import numpy as np
import pytest
from testkit.api_checks import assert_error
from testkit.server import start_server

pytest.importorskip("av")
openai = pytest.importorskip("openai")
MAX_TOKENS = 5
TOP = 5
QUESTION = {"type": "text", "text": "What is this sound?"}


def wav_bytes(seconds: float, rate: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * (220 + 150 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype(np.int16).tobytes())
    return out.getvalue()


def input_audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


CLIPS = {"16k": wav_bytes(1.3, 16000, 1), "22k": wav_bytes(0.9, 22050, 2)}


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory) -> str:
    from epd.tools.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("omni"), "qwen2.5-omni-tiny", seed=5))


@pytest.fixture(scope="module")
def offline(omni_model):
    """name -> (text, prompt ids, output ids, each token's top-5 ids) of the offline LLM's greedy answer."""
    from epd import LLM, SamplingParams

    llm = LLM(omni_model, dtype="float32", max_num_seqs=2, max_num_batched_tokens=64)
    out = {}
    for name, clip in CLIPS.items():
        [result] = llm.chat([{"role": "user", "content": [input_audio(clip), QUESTION]}],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP))
        o = result.outputs[0]
        out[name] = (o.text, list(result.prompt_token_ids), list(o.token_ids), [[t for t, _ in lp.top]
                                                                                for lp in o.logprobs])
    return out


@pytest.fixture(scope="module")
def server(omni_model, tmp_path_factory):
    srv = start_server(omni_model, tmp_path_factory.mktemp("logs"), "aggregated", "--max-audio-seconds", "2",
                       "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0, srv.log()


def _chat(server, content: list[dict]):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                     "return_token_ids": True})


def _answer(response) -> tuple[str, list[int], list[int], list[list[int]]]:
    choice = response.choices[0]
    tops = [[int(t.token.removeprefix("token_id:")) for t in step.top_logprobs] for step in choice.logprobs.content]
    extra = response.model_extra or {}
    return (choice.message.content, extra.get("prompt_token_ids"), (choice.model_extra or {}).get("token_ids"),
            tops)


@pytest.mark.slow
def test_an_audio_chat_answers_as_offline(server, offline):
    for name, clip in CLIPS.items():
        assert _answer(_chat(server, [input_audio(clip), QUESTION])) == offline[name], name
    url = "data:audio/wav;base64," + base64.b64encode(CLIPS["16k"]).decode()
    assert _answer(_chat(server, [{"type": "audio_url", "audio_url": {"url": url}}, QUESTION])) == offline["16k"]
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    tokenized = httpx.post(server.base_url + "/tokenize", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": [input_audio(CLIPS["22k"]), QUESTION]}]})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == offline["22k"][1]


def _post(server, content: list[dict]) -> httpx.Response:
    body = {"model": "x", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return httpx.post(server.base_url + "/v1/chat/completions", json={**body, "model": model}, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("content, message", [
    ([input_audio(b"RIFF not really a wave file"), QUESTION], "audio file"),
    ([input_audio(wav_bytes(2.5, 16000, 3)), QUESTION], "--max-audio-seconds"),
    ([input_audio(CLIPS["16k"]), input_audio(CLIPS["22k"]), QUESTION], "at most 1 audio clip"),
    ([{"type": "input_audio", "input_audio": {"data": "not base64!"}}], "not base64"),
])
def test_a_bad_clip_is_a_400_and_the_server_serves_on(server, offline, content, message):
    assert_error(_post(server, content), 400, message)
    assert _answer(_chat(server, [input_audio(CLIPS["16k"]), QUESTION])) == offline["16k"]


@pytest.mark.slow
def test_e_p_d_encodes_the_clip_on_an_encoder_worker(omni_model, offline, tmp_path):
    """The clip's embeddings come from the encoder worker, through the cache, to the prefill worker."""
    srv = start_server(omni_model, tmp_path, "e-p-d", "--max-model-len", "512")
    try:
        for name, clip in CLIPS.items():
            assert _answer(_chat(srv, [input_audio(clip), QUESTION])) == offline[name], name
        for _ in range(100):  # the encoder's counters reach the API with its next stats
            num_encoded = _encoder_audio_items(srv)
            if num_encoded >= len(CLIPS):
                break
            time.sleep(0.1)
    finally:
        assert srv.stop() == 0, srv.log()
    assert num_encoded == len(CLIPS)


def _encoder_audio_items(server) -> float:
    """epd:encoder_items of modality "audio" over the encoder workers."""
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("epd:encoder_items")
               and 'modality="audio"' in line and 'role="encoder"' in line)
