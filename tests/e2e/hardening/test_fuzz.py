"""Hypothesis-generated chat bodies, near valid so they reach past the schema
into media and sampling: never a 5xx, always an OpenAI error body."""
from __future__ import annotations

import json

from testkit.api_checks import ERROR_KEYS, IMG, MAX_TOKENS, MODEL, assert_still_serving, post
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.media import data_url


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                 st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def mostly(valid, junk=JUNK, one_in: int = 6):
    """`valid`, or one time in `one_in` junk of any JSON type."""
    return st.sampled_from([True] * (one_in - 1) + [False]).flatmap(lambda ok: valid if ok else junk)


def _mutate(drawn) -> dict:
    """A valid body with up to two fields set to junk and maybe one dropped;
    never unbounded (no max_tokens at all would run to the model length)."""
    body, junk, dropped = drawn
    body = {**body, **dict(junk)}
    for name in dropped:
        body.pop(name, None)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 1
    return body


def _fuzz_body(media_base: str):
    """Near-valid chat bodies, so the fuzz reaches past the schema into media and sampling."""
    urls = st.sampled_from([data_url(IMG), data_url(IMG[:40]), data_url(b"text"), "data:image/png;base64,%%%",
                            "data:,", f"{media_base}/img.png", f"{media_base}/text", f"{media_base}/missing.png",
                            "http://example.com/a.png", "file:///etc/passwd", "", "javascript:alert(1)"])
    part = mostly(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": mostly(st.text(max_size=20))}),
        st.fixed_dictionaries({"type": st.just("image_url"),
                               "image_url": mostly(st.fixed_dictionaries({"url": urls}))}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "input_audio", "video_url", ""])})))
    message = st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "user", "user", "system", "assistant", "developer", "tool"])),
         "content": mostly(st.text(max_size=30) | st.lists(part, min_size=1, max_size=3))},
        optional={"name": st.text(max_size=5)})
    small = st.integers(1, MAX_TOKENS)  # a good request stays short
    stop = st.text(min_size=1, max_size=3)
    fields = st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=3), "max_tokens": small},
        optional={"max_completion_tokens": small, "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
                  "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "n": st.integers(1, 3),
                  "seed": st.integers(-(2**63), 2**63 - 1), "stop": stop | st.lists(stop, max_size=4),
                  "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
                  "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 1),
                  "stop_token_ids": st.lists(st.integers(0, 200), max_size=3),
                  "ignore_eos": st.booleans(), "logit_bias": st.just({}), "response_format": st.just({"type": "text"}),
                  "tools": st.none(), "tool_choice": st.sampled_from([None, "none"]),
                  "skip_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                  "user": st.text(max_size=5)})
    names = st.sampled_from(["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                             "top_k", "min_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty",
                             "logprobs", "top_logprobs", "stream", "stream_options", "min_tokens",
                             "stop_token_ids", "logit_bias", "response_format", "tools", "tool_choice"])
    usage = st.fixed_dictionaries({"include_usage": st.booleans()})
    streams = st.one_of(st.just({}), st.fixed_dictionaries({"stream": st.booleans()}),
                        st.fixed_dictionaries({"stream": st.just(True)}, optional={"stream_options": usage}))
    logprobs = st.one_of(st.just({}), st.fixed_dictionaries({"logprobs": st.booleans()}), st.fixed_dictionaries(
        {"logprobs": st.just(True), "top_logprobs": st.integers(0, 20)}))
    valid = st.tuples(fields, streams, logprobs).map(lambda dicts: {k: v for d in dicts for k, v in d.items()})
    return st.tuples(valid, st.lists(st.tuples(names, JUNK), max_size=2), st.lists(names, max_size=1)).map(_mutate)


def test_fuzzed_chat_bodies_never_get_a_5xx(server, expected, media_host):
    statuses = []

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=_fuzz_body(media_host[0]))
    def check(body):
        content = json.dumps(body).encode()  # NaN and Infinity included, as Python's json reads them
        response = post(server, content=content)
        statuses.append(response.status_code)
        assert response.status_code < 500, (body, response.text)
        assert "server_error" not in response.text, (body, response.text)
        if response.status_code != 200:
            assert set(response.json()["error"]) == ERROR_KEYS

    check()
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)  # both sides were explored
    assert_still_serving(server, expected, "image")

