"""/tokenize, /detokenize, /version and /v1/models/{id}.

The app runs under a real uvicorn in this process, in front of
tests/testkit/fake_api.py's `FakeOrchestrator` (what its prompts steer is said there)."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.fake_api import API_KEY, AUTH, FakeOrchestrator, MODEL, serve_app


def test_tokenize_a_prompt(base_url, fake):
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "one two three"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 4, "max_model_len": 4096, "tokens": [100, 101, 102, 1], "token_strs": None}
    r = httpx.post(f"{base_url}/tokenize", json={"prompt": "one two", "add_special_tokens": False,
                                                 "return_token_strs": True}, headers=AUTH)  # model: optional
    assert r.json() == {"count": 2, "max_model_len": 4096, "tokens": [100, 101], "token_strs": ["w100", "w101"]}
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": ""}, headers=AUTH).json()["tokens"] == []


def test_tokenize_a_chat_counts_what_the_chat_costs(client, base_url, fake):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "what is this"}]}]
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    request = fake.requests[-1]
    assert (request.prompt, request.add_generation_prompt) == (None, True)
    usage = client.chat.completions.create(model=MODEL, messages=messages).usage
    assert r.json()["count"] == usage.prompt_tokens == len(r.json()["tokens"])
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, headers=AUTH)
    assert r.status_code == 200 and fake.requests[-1].add_generation_prompt is False
    # a video's sampling, as the chat request's (tests/e2e/serve/test_video_serve.py counts real videos)
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "mm_processor_kwargs": {"fps": 4}},
                   headers=AUTH)
    assert r.status_code == 200 and fake.requests[-1].mm_processor_kwargs == {"fps": 4}


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "BAD"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, 400, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"max_frame_count": 8}}, 400,
     "mm_processor_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, 400, "chat_template"),
])
def test_tokenize_refuses_bad_input_with_an_openai_error(base_url, body, status, param):
    r = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_bodies_that_are_not_json_objects(base_url):
    for content in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{base_url}/tokenize", content=content, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text


def test_tokenize_bodies_are_bounded_as_generation_bodies_are(base_url):
    from epd.api.generate_route import max_json_items

    items = max_json_items(FakeOrchestrator.max_model_len)
    body = b'{"prompt": "x", "pad": [' + b"0," * items + b'0]}'
    r = httpx.post(f"{base_url}/tokenize", content=body, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_detokenize(base_url):
    r = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": [5, 6]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": " w5 w6"}
    for tokens, message in (([5, 1000], "token id 1000 is outside the vocabulary [0, 1000)"),
                            ([-1], "greater than or equal to 0")):
        r = httpx.post(f"{base_url}/detokenize", json={"tokens": tokens}, headers=AUTH)
        assert r.status_code == 400 and message in r.json()["error"]["message"]
        assert r.json()["error"]["param"].startswith("tokens")
    r = httpx.post(f"{base_url}/detokenize", json={"model": MODEL}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["message"] == "tokens: field required"


def test_tokenizer_endpoints_need_the_key_and_version_does_not(base_url):
    from epd import __version__

    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": [1]}).status_code == 401
    r = httpx.get(f"{base_url}/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}


def test_a_path_model_id_is_retrieved_as_listed():
    """`epd serve ./ckpt` lists the id "./ckpt": the official client sends it percent-encoded,
    plain HTTP clients resolve its dot segment; both find the model, another name does not."""
    for served in ("./ckpt", "/models/Qwen3-VL-4B.v2"):
        for url, _ in serve_app(FakeOrchestrator(), served_model_name=served):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            [listed] = client.models.list().data
            assert listed.id == served and client.models.retrieve(listed.id).id == served
            plain = httpx.get(f"{url}/v1/models/{served}", headers=AUTH)
            assert plain.status_code == 200 and plain.json()["id"] == served
            with pytest.raises(openai.NotFoundError):
                client.models.retrieve("./other")
