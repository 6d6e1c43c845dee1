"""`epd serve` end to end: real worker processes, ZeroMQ, LMDB, HTTP, and the
official `openai` client, against transformers' greedy text."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from testkit.hf_reference import hf_generate_text
from testkit.media import CHATS, image_bytes, image_part
from testkit.server import ServerProcess, free_port, start_server

MAX_TOKENS = 10


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_text(server, messages, max_tokens=MAX_TOKENS, stream=False) -> str:
    c = client(server)
    if not stream:
        r = c.chat.completions.create(model=server_model(server), messages=messages, max_tokens=max_tokens,
                                      temperature=0)
        return r.choices[0].message.content
    chunks = c.chat.completions.create(model=server_model(server), messages=messages, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def server_model(server) -> str:
    return client(server).models.list().data[0].id


@pytest.fixture(scope="module")
def expected_texts(tiny_model):
    return {name: hf_generate_text(tiny_model, m, imgs, max_new_tokens=MAX_TOKENS) for name, (m, imgs) in CHATS.items()}


@pytest.fixture(scope="module")
def server(mode_server):
    """The mode's shared server (tests/e2e/conftest.py: the flags these tests rely on are
    explained there). Every test below must give the same outputs in all three modes."""
    return mode_server


@pytest.mark.parametrize("chat", list(CHATS))
def test_greedy_text_equals_transformers(server, expected_texts, chat):
    messages, _ = CHATS[chat]
    assert chat_text(server, messages) == expected_texts[chat]
    assert chat_text(server, messages, stream=True) == expected_texts[chat]


STREAM_PROMPT = [400 + 13 * i for i in range(12)]  # token ids
STREAM_TOKENS = 13


@pytest.fixture(scope="module")
def offline(tiny_model):
    """The offline engine's greedy completion of STREAM_PROMPT (every token as it comes, no
    serving), a stop string that the 6th token completes, and the completion it stops. The
    6th is inside a held batch at intervals 3 (tokens 4-6) and 4 (tokens 5-8), so the
    tokens after it must be dropped for the counts to match."""
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    llm = LLM(tiny_model)
    params = dict(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
    full = llm.generate(STREAM_PROMPT, SamplingParams(**params))[0].outputs[0]
    before, through = (llm.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False) for k in (5, 6))
    stop = through[len(before):]
    assert stop.strip() and stop not in before and through.startswith(before)
    stopped = llm.generate(STREAM_PROMPT, SamplingParams(**params, stop=[stop]))[0].outputs[0]
    assert len(full.token_ids) == STREAM_TOKENS and len(stopped.token_ids) == 6 and stopped.finish_reason == "stop"
    return full, stop, stopped


def completion(server, stream: bool, **body) -> tuple[list[dict], dict]:
    """/v1/completions of STREAM_PROMPT with one logprob entry per token: (the content
    events, one per SSE event; or the one response) and the usage."""
    body = {"model": server_model(server), "prompt": STREAM_PROMPT, "temperature": 0, "ignore_eos": True,
            "max_tokens": STREAM_TOKENS, "logprobs": 0, "stream": stream, **body}
    if not stream:
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [r.json()], r.json()["usage"]
    events = []
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=120,
                      json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return [e for e in events if e["choices"]], events[-1]["usage"]


def choice_outputs(events: list[dict], n: int) -> list[tuple[str, list[str], str]]:
    """Per choice: its text, its tokens (from logprobs) and its finish reason."""
    outputs = []
    for index in range(n):
        choices = [c for e in events for c in e["choices"] if c["index"] == index]
        outputs.append(("".join(c["text"] for c in choices),
                        [t for c in choices for t in c["logprobs"]["tokens"]],
                        [c["finish_reason"] for c in choices if c["finish_reason"]][-1]))
    return outputs


def test_stream_interval_gives_the_same_text_and_tokens_in_fewer_events(server, offline):
    full, _, _ = offline
    whole, whole_usage = completion(server, stream=False)
    events, usage = completion(server, stream=True)
    [(text, tokens, finish)] = choice_outputs(whole, 1)
    assert text == full.text and len(tokens) == STREAM_TOKENS and finish == "length"
    assert choice_outputs(events, 1) == [(text, tokens, finish)]
    assert usage == whole_usage and usage["completion_tokens"] == STREAM_TOKENS
    # the first token at once, then one event per `interval` tokens at most (fewer when the reader is behind)
    assert len(events) <= 1 + math.ceil((STREAM_TOKENS - 1) / server.stream_interval)


def test_stop_strings_and_n_under_the_stream_interval(server, offline):
    _, stop, stopped = offline
    for stream in (False, True):
        events, usage = completion(server, stream=stream, stop=[stop], n=2)
        for text, tokens, finish in choice_outputs(events, 2):  # tokens past the stop are never sent
            assert (text, len(tokens), finish) == (stopped.text, len(stopped.token_ids), "stop")
        assert usage["completion_tokens"] == 2 * len(stopped.token_ids)


def test_text_only_request_skips_the_encoder(server):
    before = server.settled_sum("epd:encoder_images_total")
    chat_text(server, [{"role": "user", "content": "Only words here, no pictures at all."}])
    assert server.settled_sum("epd:encoder_images_total") == before


LONG_TEXT = "Count the blocks, please. " * 16  # over the e-p-d fixture's --max-local-prefill-tokens 64


def test_kv_transfer_moves_exactly_the_request_blocks_and_frees_them(server):
    if server.mode != "e-p-d":
        pytest.skip("KV moves only in e-p-d")
    before = server.settled_sum("epd:kv_transfer_bytes_total")
    local = server.metric_sum("epd:local_prefills_total")
    r = client(server).chat.completions.create(model=server_model(server), max_tokens=5, temperature=0,
                                               messages=[{"role": "user", "content": LONG_TEXT}])
    assert r.usage.prompt_tokens > 64
    assert server.metric_sum("epd:local_prefills_total") == local  # too long: through the prefill worker
    block_bytes = 2 * 3 * 16 * 2 * 16 * 4  # k+v, tiny: 3 layers, 16 tokens, 2 kv heads, head_dim 16, fp32
    expected = math.ceil(r.usage.prompt_tokens / 16) * block_bytes
    _wait_for(lambda: server.metric_sum("epd:kv_transfer_bytes_total") - before == expected)
    _wait_for(lambda: server.metric_sum("epd:kv_cache_usage_perc", role="prefill") == 0
              and server.metric_sum("epd:kv_cache_usage_perc", role="decode") == 0)


def _engine_counts(server) -> dict[str, float]:
    """Settled per-role engine counters: where prompts were prefilled, and KV moves."""
    return {"local": server.metric_sum("epd:local_prefills_total"),
            "prefill": server.settled_sum("epd:prefix_cache_queries_total", role="prefill"),
            "decode": server.settled_sum("epd:prefix_cache_queries_total", role="decode"),
            "kv": server.settled_sum("epd:kv_transfer_bytes_total")}


def test_short_text_prompt_is_prefilled_on_the_decode_worker(server, expected_texts):
    if server.mode != "e-p-d":
        pytest.skip("local prefill is e-p-d's")
    before = _engine_counts(server)
    assert chat_text(server, CHATS["text_only"][0]) == expected_texts["text_only"]
    after = _engine_counts(server)
    assert after["local"] == before["local"] + 1
    assert after["prefill"] == before["prefill"] and after["kv"] == before["kv"]  # the prefill worker never saw it
    assert after["decode"] > before["decode"]  # the decode worker looked its prompt up in its prefix cache


def test_image_and_long_text_prompts_go_through_the_prefill_worker(server):
    if server.mode != "e-p-d":
        pytest.skip("local prefill is e-p-d's")
    for messages in (CHATS["one_image"][0], [{"role": "user", "content": LONG_TEXT}]):
        before = _engine_counts(server)
        chat_text(server, messages, max_tokens=3)
        after = _engine_counts(server)
        assert after["local"] == before["local"]
        assert after["prefill"] > before["prefill"] and after["kv"] > before["kv"]


def test_short_text_prompts_arriving_together_are_answered_wherever_they_are_prefilled(server, expected_texts):
    """A short text prompt that finds the decode worker prefilling another may go to the
    idle prefill worker instead (which one depends on timing): either way the answer is
    transformers', every try is counted once, and KV moves only if one was redirected."""
    if server.mode != "e-p-d":
        pytest.skip("local prefill is e-p-d's")
    before = _engine_counts(server)
    redirected = server.metric_sum("epd:local_prefills_redirected_total")
    num_requests = 6

    async def ask_together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as c:
            model = (await c.models.list()).data[0].id
            responses = await asyncio.gather(*(c.chat.completions.create(
                model=model, messages=CHATS["text_only"][0], max_tokens=MAX_TOKENS, temperature=0)
                for _ in range(num_requests)))
        return [r.choices[0].message.content for r in responses]

    assert asyncio.run(ask_together()) == [expected_texts["text_only"]] * num_requests
    after = _engine_counts(server)
    num_redirected = server.metric_sum("epd:local_prefills_redirected_total") - redirected
    assert after["local"] - before["local"] + num_redirected == num_requests
    assert (after["prefill"] > before["prefill"]) == (after["kv"] > before["kv"]) == (num_redirected > 0)


def test_a_client_leaving_a_local_prefill_frees_the_decode_workers_blocks(server):
    if server.mode != "e-p-d":
        pytest.skip("local prefill is e-p-d's")
    aborted = server.settled_sum("epd:requests_aborted_total", role="decode")
    local = server.metric_sum("epd:local_prefills_total")
    body = {"model": server_model(server), "messages": CHATS["text_only"][0], "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        num_chunks = 0
        while num_chunks < 20:
            num_chunks += next(lines).startswith("data: {")
    assert server.metric_sum("epd:local_prefills_total") == local + 1
    _wait_for(lambda: server.metric_sum("epd:kv_cache_usage_perc", role="decode") == 0
              and server.metric_sum("epd:num_requests_running", role="decode") == 0, timeout_s=60)
    assert server.settled_sum("epd:requests_aborted_total", role="decode") == aborted + 1


def test_four_images_spread_over_two_encoders(server):
    if server.mode != "e-p-d":
        pytest.skip("two encoders only in the e-p-d fixture")
    imgs = [image_bytes(64 + 8 * i, 48, seed=100 + i) for i in range(4)]
    per_encoder = [server.settled_sum("epd:encoder_images_total", worker=f"encoder-{i}") for i in range(2)]
    chat_text(server, [{"role": "user", "content": [*map(image_part, imgs), {"type": "text", "text": "All four?"}]}])
    _wait_for(lambda: sum(server.metric_sum("epd:encoder_images_total", worker=f"encoder-{i}")
                          for i in range(2)) - sum(per_encoder) == 4)
    for i in range(2):
        assert server.metric_sum("epd:encoder_images_total", worker=f"encoder-{i}") > per_encoder[i]


def test_repeated_image_hits_the_cache(server):
    img = image_bytes(90, 90, seed=77)
    messages = [{"role": "user", "content": [image_part(img), {"type": "text", "text": "Again?"}]}]
    first = chat_text(server, messages)
    encoded = server.settled_sum("epd:encoder_images_total")
    hits = server.metric_sum("epd:mm_cache_hits_total")
    hit_tokens = server.metric_sum("epd:mm_cache_hit_tokens_total")
    assert chat_text(server, messages) == first
    assert server.metric_sum("epd:mm_cache_hits_total") == hits + 1
    assert server.metric_sum("epd:mm_cache_hit_tokens_total") == hit_tokens + 9  # 90x90 -> 96x96: 6x6 patches, 3x3 merged
    assert server.settled_sum("epd:encoder_images_total") == encoded


def test_shared_cores_run_later_stages_first(server):
    """With --cpu-sharing shared the kernel, not the launcher, shares the cores:
    the decode worker keeps niceness 0, the prefill worker 2, each encoder 4."""
    if server.mode != "e-p-d":
        pytest.skip("the e-p-d server shares its cores (the default); e-pd splits them")
    out = subprocess.run(["ps", "-eo", "pgid=,ni=,comm="], capture_output=True, text=True, check=True).stdout
    nice = [int(ni) for pgid, ni, *_ in (line.split() for line in out.splitlines()) if int(pgid) == server.pgid]
    assert nice.count(4) == 2 and nice.count(2) == 1, nice  # two encoders, one prefill worker
    assert 0 in nice  # the API and the decode worker


def test_small_cache_evicts_and_every_request_succeeds(server):
    if server.mode != "e-pd":
        pytest.skip("the tiny cache is in the e-pd fixture")
    for i in range(12):
        img = image_bytes(128, 128, seed=500 + i)
        text = chat_text(server, [{"role": "user", "content": [image_part(img), {"type": "text", "text": "Hm?"}]}],
                         max_tokens=3)
        assert isinstance(text, str)


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


def _cache_entries(cache_dir: str, model: str) -> list:
    import lmdb
    from transformers import AutoConfig

    from epd.engine.model_info import ModelInfo
    from epd.transport.embedding_cache.mm_entry import decode_entry

    fingerprint = ModelInfo.from_pretrained(model, AutoConfig.from_pretrained(model)).fingerprint
    env = lmdb.open(cache_dir, readonly=True, lock=False, max_dbs=3)
    try:
        with env.begin(db=env.open_db(b"entries", create=False)) as txn:
            return [decode_entry(value, fingerprint) for _, value in txn.cursor()]
    finally:
        env.close()


def test_cache_survives_a_restart(tiny_model, tmp_path):
    """A warm cache dir: the same image after a restart costs no encoder time,
    even when another mode wrote it (here the aggregated worker's in-process
    encoder; e-pd reads it: an encoder worker that is never asked, the fewest
    processes to start of the modes with one)."""
    from epd.families.qwen_vl.image_processor import ImagePreprocessor

    cache = str(tmp_path / "cache")
    img = image_bytes(80, 120, seed=31)
    messages = [{"role": "user", "content": [image_part(img), {"type": "text", "text": "Remember me?"}]}]
    first = start_server(tiny_model, tmp_path, "aggregated", "--mm-cache-dir", cache)
    try:
        text = chat_text(first, messages)
        assert first.settled_sum("epd:encoder_images_total") == 1
    finally:
        assert first.stop() == 0
    [entry] = _cache_entries(cache, tiny_model)
    assert tuple(entry.meta["grid_thw"]) == ImagePreprocessor(tiny_model).geometry.grid_thw(80, 120)
    second = start_server(tiny_model, tmp_path, "e-pd", "--mm-cache-dir", cache)
    try:
        assert chat_text(second, messages) == text
        assert second.metric_sum("epd:mm_cache_hits_total") == 1
        assert second.settled_sum("epd:encoder_images_total") == 0
    finally:
        assert second.stop() == 0
    assert not second.group_alive()


def test_external_workers_over_tcp(tiny_model, tmp_path, expected_texts):
    """`epd serve --external-workers` + `epd worker --api tcp://...` (an encoder
    and a pd worker) on loopback, with worker-plane keys: a peer without them
    joins nothing and stops nothing. Nobody here supervises these workers, so
    the API judges them by their messages: an encoder batch twice as long as
    the heartbeat timeout does not make the encoder look dead (its heartbeat
    thread says Alive), and a killed one is found dead by its silence."""
    keys = tmp_path / "keys"
    assert subprocess.run([sys.executable, "-m", "epd.cli", "keys", str(keys)]).returncode == 0
    port = free_port()
    worker_port = free_port()
    timeout_s = 3.0
    api = ServerProcess(["serve", tiny_model, "--mode", "e-pd", "--external-workers", "--port", str(port),
                         "--worker-port", str(worker_port), "--worker-keys", str(keys)], port, str(tmp_path / "api.log"),
                        env={**os.environ, "EPD_HEARTBEAT_TIMEOUT_S": str(timeout_s)})
    common = [tiny_model, "--api", f"tcp://127.0.0.1:{worker_port}", "--dtype", "float32", "--device", "cpu",
              "--threads", "1", "--worker-keys", str(keys)]
    encoder = ServerProcess(["worker", *common, "--role", "encoder"], worker_port, str(tmp_path / "encoder.log"),
                            env={**os.environ, "EPD_TEST_ENCODER_BATCH_DELAY_S": str(2 * timeout_s)})
    pd = ServerProcess(["worker", *common, "--role", "pd", "--num-kv-blocks", "128"], worker_port,
                       str(tmp_path / "pd.log"))
    try:
        api.wait_ready()
        messages, _ = CHATS["one_image"]
        assert chat_text(api, messages) == expected_texts["one_image"]  # one encoder batch of >= 6 s
        assert "treated as dead" not in api.log(), api.log()
        assert api.settled_sum("epd:encoder_images_total") == 1  # encoded once: never failed over
        workers = [k for k in api.metrics() if k.startswith("epd:num_requests_running{")]
        assert any('worker="pd@' in k for k in workers), workers
        inbox = re.search(r"inbox (tcp://\S+)", pd.log()).group(1)
        with _forged_peer(f"tcp://127.0.0.1:{worker_port}", inbox) as rogue:
            for _ in range(3):  # the worker was not stopped, and no request goes to the rogue
                assert chat_text(api, CHATS["text_only"][0]) == expected_texts["text_only"]
            assert rogue.poll(1000) == 0
        assert [k for k in api.metrics() if k.startswith("epd:num_requests_running{")] == workers
        # silent past the heartbeat timeout, a killed worker is dead
        encoder.proc.kill()
        deadline = time.monotonic() + timeout_s + 20
        while (health := httpx.get(api.base_url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "the silent worker was never declared dead"
            time.sleep(0.5)
        assert health.status_code == 503 and health.json()["missing_roles"] == ["encoder"]
    finally:
        codes = [api.stop(), encoder.stop(), pd.stop()]
    assert codes == [0, -signal.SIGKILL, 0], (codes, api.log(), pd.log())  # the encoder was killed above
    assert not api.group_alive() and not encoder.group_alive() and not pd.group_alive()


@contextlib.contextmanager
def _forged_peer(collector: str, inbox: str):
    """A peer without the plane's keys sends a Ready for a rogue pd worker
    (which would receive users' prompts) and a Shutdown to the real worker;
    yields the rogue's inbox."""
    import zmq

    from epd.transport.wire.messages import Ready, Shutdown

    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.PULL)
        rogue_port = rogue.bind_to_random_port("tcp://127.0.0.1")
        for address, msg in ((collector, Ready("pd-66", "pd", f"tcp://127.0.0.1:{rogue_port}", "evil")),
                             (inbox, Shutdown())):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, 2000)  # the keyless handshake may fail before the send: no pipe is left
            push.connect(address)
            try:
                push.send_multipart(msg.to_wire())
            except zmq.Again:  # refused at the handshake: delivered nowhere, which is what the test asserts
                pass
            push.close()
        yield rogue
    finally:
        ctx.destroy(linger=0)
