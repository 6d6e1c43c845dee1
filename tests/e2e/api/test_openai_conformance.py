"""The official `openai` client against a real `epd serve` (aggregated, tiny
checkpoint, `--served-model-name`; the shared aggregated server): every field it sends does what OpenAI's
documentation says, streamed and not, and greedy text equals transformers'."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.hf_reference import hf_generate_text, hf_inputs
from testkit.media import image_bytes, image_part
from testkit.mode_servers import SERVED_MODEL

pytestmark = pytest.mark.parametrize("mode_server", ["aggregated"], indirect=True)

MODEL = SERVED_MODEL
NUM_TOKENS = 12
IMG = image_bytes(72, 40, seed=11)
TEXT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story about a lighthouse."}]}]
IMAGE = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "What is this?"}]}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(mode_server):
    """The shared aggregated server (tests/testkit/mode_servers.py), served as SERVED_MODEL."""
    return mode_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[str, str]:
    return {"text": hf_generate_text(tiny_model, TEXT, [], NUM_TOKENS),
            "image": hf_generate_text(tiny_model, IMAGE, [IMG], NUM_TOKENS)}


@pytest.fixture(scope="module")
def prompt_tokens(tiny_model) -> dict[str, int]:
    return {"text": hf_inputs(tiny_model, TEXT, [])["input_ids"].shape[1],
            "image": hf_inputs(tiny_model, IMAGE, [IMG])["input_ids"].shape[1]}


def create(client, messages=TEXT, **kwargs):
    kwargs.setdefault("max_tokens", NUM_TOKENS)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def streamed(chunks) -> dict[int, dict]:
    """Chunks -> {choice index: {"text", "finish_reason", "logprobs"}} (and "usage" under -1)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            out[-1] = {"usage": chunk.usage}
        for choice in chunk.choices:
            acc = out.setdefault(choice.index, {"text": "", "finish_reason": None, "logprobs": []})
            acc["text"] += choice.delta.content or ""
            acc["finish_reason"] = choice.finish_reason or acc["finish_reason"]
            if choice.logprobs is not None:
                acc["logprobs"] += choice.logprobs.content
    return out


def test_models_and_served_model_name(client, tiny_model):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError):  # the checkpoint path is not the served name
        client.chat.completions.create(model=tiny_model, messages=TEXT, max_tokens=1)
    r = create(client, max_tokens=1)
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_text_for_string_parts_and_image_content(client, expected, stream):
    for messages, key in ((TEXT, "text"), (PARTS, "text"), (IMAGE, "image")):
        if stream:
            text = streamed(create(client, messages, stream=True))[0]["text"]
        else:
            text = create(client, messages).choices[0].message.content
        assert text == expected[key], key


def test_max_tokens_max_completion_tokens_and_usage(client, prompt_tokens):
    for kwargs, num in (({"max_tokens": 3}, 3), ({"max_completion_tokens": 5}, 5),
                        ({"max_tokens": 3, "max_completion_tokens": 4}, 4)):
        r = create(client, IMAGE, extra_body=IGNORE_EOS, **kwargs)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == num
        assert r.usage.prompt_tokens == prompt_tokens["image"]
        assert r.usage.total_tokens == prompt_tokens["image"] + num


def test_stream_options_include_usage(client, prompt_tokens):
    chunks = list(create(client, stream=True, stream_options={"include_usage": True}, max_tokens=5,
                         extra_body=IGNORE_EOS))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens["text"], 5)
    assert all(c.usage is None for c in create(client, stream=True, max_tokens=2))


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return create(client, temperature=1.0, top_p=0.95, seed=seed, max_tokens=24,
                      extra_body=IGNORE_EOS).choices[0].message.content

    assert sample(1234) == sample(1234)
    streamed_text = streamed(create(client, temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, stream=True,
                                    extra_body=IGNORE_EOS))[0]["text"]
    assert streamed_text == sample(1234)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_strings_end_the_text_before_them(client, expected, stream):
    text = expected["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    for stops in (stop, ["never-in-the-output", stop]):
        if stream:
            got = streamed(create(client, stop=stops, stream=True))[0]
            content, finish = got["text"], got["finish_reason"]
        else:
            choice = create(client, stop=stops).choices[0]
            content, finish = choice.message.content, choice.finish_reason
        assert content == text[: text.index(stop)]
        assert stop not in content and finish == "stop"


def test_n_choices(client, expected):
    r = create(client, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == expected["text"] for c in r.choices)  # greedy: all the same
    assert r.usage.completion_tokens == 3 * create(client).usage.completion_tokens
    sampled = create(client, n=2, temperature=1.0, seed=7, max_tokens=16, extra_body=IGNORE_EOS)
    assert sampled.usage.completion_tokens == 32
    by_index = streamed(create(client, n=2, temperature=1.0, seed=7, max_tokens=16, stream=True,
                               extra_body=IGNORE_EOS))
    assert [by_index[i]["text"] for i in (0, 1)] == [c.message.content for c in sampled.choices]


def test_presence_and_frequency_penalties_reach_the_sampler(client):
    def text(**penalties):
        return create(client, max_tokens=48, extra_body=IGNORE_EOS, **penalties).choices[0].message.content

    plain = text()
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(presence_penalty=0.0, frequency_penalty=0.0) == plain


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_logprobs_and_top_logprobs(client, stream):
    kwargs = dict(logprobs=True, top_logprobs=3, max_tokens=6, extra_body=IGNORE_EOS)
    if stream:
        entries = streamed(create(client, stream=True, **kwargs))[0]["logprobs"]
    else:
        entries = create(client, **kwargs).choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        top = [t.logprob for t in e.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert e.logprob == pytest.approx(top[0])  # greedy picks the most likely token
        assert e.bytes == list(e.token.encode())
    assert create(client, max_tokens=2).choices[0].logprobs is None


def test_completions_with_a_text_prompt(client, tiny_model, expected, prompt_tokens):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(TEXT, tokenize=False,
                                                                           add_generation_prompt=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected["text"]
    assert r.usage.prompt_tokens == prompt_tokens["text"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]


def test_x_request_id_is_echoed(server, client):
    body = {"model": MODEL, "messages": TEXT, "max_tokens": 1}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert httpx.post(server.base_url + "/v1/chat/completions", json=body).headers["x-request-id"]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=TEXT, max_tokens=1,
                                                           extra_headers={"x-request-id": "sdk-7"})
    assert raw.headers["x-request-id"] == "sdk-7"
