"""vLLM's request fields through a real `epd serve` (the shared server of every
mode) and the official `openai` client (issue 31 item 5): each one does what vLLM
does with it, or is refused with a 400 naming it; an unknown field is logged once."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.media import image_bytes, image_part
from testkit.mode_servers import MODES, SERVED_MODEL

pytestmark = pytest.mark.parametrize("mode_server", MODES, indirect=True)

MODEL = SERVED_MODEL
PROMPT = "The lighthouse keeper opened the door and"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(mode_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=mode_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, prompt=PROMPT, max_tokens=12, extra=None, **kwargs):
    body = {"ignore_eos": True, **(extra or {})}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=body, **kwargs)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=120)


@pytest.fixture(scope="module")
def reference(client):
    """The greedy completion of PROMPT, with its token ids."""
    r = complete(client, extra={"return_token_ids": True})
    choice = r.choices[0].model_extra
    return {"text": r.choices[0].text, "token_ids": choice["token_ids"], "prompt_token_ids": choice["prompt_token_ids"],
            "usage": r.usage}


def test_return_token_ids_completions(client, reference, mode_server):
    tokenized = post(mode_server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert reference["prompt_token_ids"] == tokenized
    assert len(reference["token_ids"]) == reference["usage"].completion_tokens == 12
    chunks = list(complete(client, stream=True, extra={"return_token_ids": True}))
    first = chunks[0].choices[0].model_extra
    assert first["prompt_token_ids"] == tokenized
    assert all(c.choices[0].model_extra["prompt_token_ids"] is None for c in chunks[1:] if c.choices)
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == reference["token_ids"]
    plain = complete(client).choices[0].model_extra  # not asked: null, as vLLM answers
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["prompt_logprobs"] is None


def test_return_token_ids_chat(client, mode_server):
    messages = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    tokenized = post(mode_server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert r.model_extra["prompt_token_ids"] == tokenized and r.model_extra["prompt_logprobs"] is None
    assert len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))
    with_prompt = [c.model_extra.get("prompt_token_ids") for c in chunks if c.model_extra.get("prompt_token_ids")]
    assert with_prompt == [tokenized]
    streamed_ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed_ids == r.choices[0].model_extra["token_ids"]


def test_stop_string_stop_reason_and_include_stop_str(client, reference):
    text = reference["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[:text.index(stop)]
    r = complete(client, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == \
        (cut, "stop", stop)
    kept = complete(client, stop=[stop], extra={"include_stop_str_in_output": True}).choices[0]
    assert (kept.text, kept.model_extra["stop_reason"]) == (cut + stop, stop)
    streamed = list(complete(client, stop=[stop], stream=True, extra={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut + stop
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop
    assert complete(client).choices[0].model_extra["stop_reason"] is None  # a length finish


def test_stop_token_id_is_the_stop_reason_and_min_tokens_defers_it(client, reference):
    ids = reference["token_ids"]
    stop_id = ids[2] if ids[2] not in ids[:2] else ids[0]
    at = ids.index(stop_id)
    r = complete(client, extra={"stop_token_ids": [stop_id], "return_token_ids": True})
    choice = r.choices[0].model_extra
    assert (r.choices[0].finish_reason, choice["stop_reason"], choice["token_ids"]) == \
        ("stop", stop_id, ids[:at + 1])
    later = complete(client, extra={"stop_token_ids": [stop_id], "min_tokens": at + 2, "return_token_ids": True})
    assert later.usage.completion_tokens > at + 1
    later_ids = later.choices[0].model_extra["token_ids"]  # the stop token is masked until min_tokens (vLLM)
    assert later_ids[:at] == ids[:at] and stop_id not in later_ids[:at + 2]
    # a stop string inside the first min_tokens tokens is not matched either (vLLM's rule)
    first_text = complete(client, max_tokens=1).choices[0].text
    if first_text.strip():
        held = complete(client, stop=[first_text], extra={"min_tokens": 3})
        assert held.usage.completion_tokens >= 3


def test_skip_special_tokens(client, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    special = tok.convert_tokens_to_ids("<|im_start|>")
    forced = {"allowed_token_ids": [special]}
    assert complete(client, max_tokens=3, extra=forced).choices[0].text == ""
    shown = complete(client, max_tokens=3, extra={**forced, "skip_special_tokens": False}).choices[0].text
    assert shown == "<|im_start|>" * 3


def test_echo_prepends_the_prompt(client, reference):
    r = complete(client, echo=True)
    assert r.choices[0].text == PROMPT + reference["text"]
    assert r.usage.prompt_tokens == reference["usage"].prompt_tokens
    streamed = list(complete(client, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + reference["text"]
    by_ids = complete(client, prompt=reference["prompt_token_ids"], echo=True)
    assert by_ids.choices[0].text == PROMPT + reference["text"]


def test_batched_prompts_prompt_major_with_n(client, reference):
    other = "A second prompt, about the sea"
    alone = complete(client, prompt=other).choices[0].text
    r = complete(client, prompt=[PROMPT, other], n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [reference["text"]] * 2 + [alone] * 2
    other_tokens = complete(client, prompt=other).usage.prompt_tokens
    assert r.usage.prompt_tokens == reference["usage"].prompt_tokens + other_tokens
    assert r.usage.completion_tokens == 4 * 12
    ids = complete(client, prompt=[reference["prompt_token_ids"], reference["prompt_token_ids"][:4]])
    assert ids.choices[0].text == reference["text"] and len(ids.choices) == 2
    chunks = list(complete(client, prompt=[PROMPT, other], stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == {0: reference["text"], 1: alone}
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "completions":
        chunks = list(complete(client, max_tokens=6, stream=True, stream_options=options))
    else:
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
            stream_options=options, temperature=0, extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices and (getattr(c.choices[0], "text", None)
                                                     or getattr(getattr(c.choices[0], "delta", None), "content", None))]
    assert with_text and all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in with_text)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    plain = list(complete(client, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, reference):
    ids = reference["prompt_token_ids"]
    r = complete(client, extra={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == complete(client, prompt=ids[-4:]).choices[0].text
    right = complete(client, extra={"truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right.choices[0].text == complete(client, prompt=ids[:4]).choices[0].text
    whole = complete(client, extra={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].text == reference["text"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_stream_interval_per_request(client):
    chunks = list(complete(client, max_tokens=12, stream=True, extra={"stream_interval": 4}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(chunks) <= 5  # the first token, then every 4 (the last at once): not one chunk a token


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("logprob_token_ids", [1]), ("length_penalty", 0.5),
                                          ("priority", 3), ("cache_salt", "salt"), ("suffix", "x")])
def test_vllm_fields_not_served_are_a_400_naming_them(mode_server, field, value):
    response = post(mode_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_vllm_defaults_spelled_out_are_accepted(mode_server):
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "prompt_logprobs": None,
                "spaces_between_special_tokens": True, "user": "u", "return_token_offsets": False}
    assert post(mode_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **defaults}).status_code == 200
    chat = post(mode_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                      "continue_final_message": False, **defaults})
    assert chat.status_code == 200, chat.text
    refused = post(mode_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "chat_template": "{{ messages }}"})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "chat_template")


def test_unknown_fields_are_logged_once_and_served(mode_server):
    for _ in range(2):
        response = post(mode_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "zz_unknown_field": 1,
                                                         "guided_json": {"type": "object"}})
        assert response.status_code == 200
    log = mode_server.log()
    assert log.count("'zz_unknown_field' is not one vLLM or EPD knows") == 1
    assert log.count("'guided_json' is not one vLLM or EPD knows") == 1


def test_custom_roles_are_rendered_by_the_template(client, mode_server):
    messages = [{"role": "narrator", "content": "It was a dark night."}, {"role": "user", "content": "Go on."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    tokens = post(mode_server, "/tokenize", {"messages": messages, "add_generation_prompt": True}).json()["tokens"]
    assert r.usage.prompt_tokens == len(tokens)
    text = post(mode_server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert "<|im_start|>narrator\nIt was a dark night." in text


def test_chat_echo_repeats_the_last_message_of_the_answers_role(client):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False, "ignore_eos": True})
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={"add_generation_prompt": False, "echo": True,
                                                        "ignore_eos": True})
    assert echoed.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    assert echoed.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"add_generation_prompt": False,
                                                                          "echo": True, "ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        echoed.choices[0].message.content
    no_echo = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2,
                                             extra_body={"echo": True})  # the answer's role is not the last one's
    assert not no_echo.choices[0].message.content.startswith("Tell me")


def test_image_parts_as_vllm_takes_them(mode_server):
    url = image_part(image_bytes(32, 32, seed=3))["image_url"]["url"]

    def chat(part):
        return post(mode_server, "/v1/chat/completions", {"max_tokens": 1, "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]})
    bare = chat({"type": "image_url", "image_url": url})  # a bare string: vLLM answers 400
    assert (bare.status_code, bare.json()["error"]["param"]) == (400, "messages[0].content[0].image_url")
    first = chat({"type": "image_url", "image_url": {"url": url}, "uuid": "img-1"})
    assert first.status_code == 200, first.text
    again = chat({"type": "image_url", "image_url": None, "uuid": "img-1"})  # vLLM: the image sent under it
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
    other = chat({"type": "image_url", "image_url": {"url": image_part(image_bytes(64, 64, seed=4))["image_url"]["url"]},
                  "uuid": "img-2"})
    assert other.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"]  # a bigger image
    by_uuid = chat({"type": "image_url", "uuid": "img-2"})
    assert by_uuid.json()["usage"]["prompt_tokens"] == other.json()["usage"]["prompt_tokens"]
    unknown = chat({"type": "image_url", "uuid": "never-sent"})
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (400, "messages")
    assert "never-sent" in unknown.json()["error"]["message"]


def test_continue_final_message_leaves_the_last_message_open(client, mode_server):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    opened = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(mode_server, "/tokenize", {"messages": messages, **opened}).json()["tokens"]
    text = post(mode_server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nOnce upon")  # no end-of-turn after it
    closed = post(mode_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert len(closed) > len(tokens)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                       extra_body={**opened, "ignore_eos": True, "echo": True})
    assert r.usage.prompt_tokens == len(tokens) and r.choices[0].message.content.startswith("Once upon")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})  # with a generation prompt
    assert info.value.body["param"] == "continue_final_message"


def test_return_tokens_as_token_ids(client, reference):
    r = complete(client, logprobs=2, extra={"return_tokens_as_token_ids": True, "return_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.choices[0].model_extra["token_ids"]]
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(len(lp.tokens)))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
