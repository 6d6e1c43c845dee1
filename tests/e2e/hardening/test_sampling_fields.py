"""Every sampling field, out of range, oversized, negative, NaN and wrong-typed:
each is a 400 naming the field, each is followed by a normal request that
must give the undisturbed answer, and no worker is lost on the way.

(A stop token id past the vocabulary together with `min_tokens` used to reach
the sampler and kill the worker; an integer too large for msgpack gave a 500.)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.api_checks import (MODEL, TEXT_MESSAGES, answer_text, assert_error, chat_body, group_processes,
                        plain_server_model, post)

HUGE = 10**20  # past int64
NAN = float("nan")

# field -> values the API must refuse with a 400 naming that field
BAD_VALUES = {
    "temperature": [-0.5, 2.5, NAN, float("inf"), "hot", [1]],
    "top_p": [0, -0.1, 1.5, NAN, "x"],
    "top_k": [-2, HUGE, -HUGE, 1.5, "ten"],
    "min_p": [-0.1, 1.5, NAN, {}],
    "presence_penalty": [-3, 3, NAN, float("-inf")],
    "frequency_penalty": [-3, 3, NAN],
    "repetition_penalty": [0, -1, NAN, float("inf")],
    "max_tokens": [0, -1, HUGE, 2.5, "four"],
    "max_completion_tokens": [0, HUGE],
    "min_tokens": [-1, HUGE],
    "n": [0, 17, HUGE],
    "seed": [HUGE, -HUGE, 0.5],
    "stop_token_ids": ["VOCAB", "VOCAB+5", [HUGE], [-1], ["a"], 7],
    "stop": [[""], ["a"] * 5, 3],
    "logprobs": ["maybe"],
    "top_logprobs": [-1, 21, HUGE],
}


HEADERS = {"authorization": "Bearer sk-hardening"}  # the aggregated server's key; the other has none


def _serving(request, which: str):
    """The server fixture and a body maker for the model name it serves."""
    srv = request.getfixturevalue(which)
    model = MODEL if which == "server" else plain_server_model(srv)
    return srv, lambda **fields: {**chat_body(TEXT_MESSAGES, **fields), "model": model}


def vocab_size(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["text_config"]["vocab_size"]


def _post_raw(srv, body: dict):
    """JSON with NaN / Infinity literals: Python's json module, and so the
    server's parser, accepts them."""
    return post(srv, content=json.dumps(body, allow_nan=True).encode(), headers=HEADERS)


@pytest.mark.parametrize("which", ["server", "plain_server"])
def test_every_bad_sampling_field_is_a_400_and_loses_no_worker(which, request, expected, tiny_model):
    srv, body_with = _serving(request, which)
    vocab = vocab_size(tiny_model)
    processes = group_processes(srv)
    checked = 0
    for field, values in BAD_VALUES.items():
        for value in values:
            if isinstance(value, str) and value.startswith("VOCAB"):  # just past the last token id
                value = [vocab + (5 if value.endswith("+5") else 0)]
            body = body_with(**{field: value})
            if field in ("top_logprobs",):
                body["logprobs"] = True
            if field == "stop_token_ids":
                body["min_tokens"] = 2  # the combination that used to reach the sampler
            response = _post_raw(srv, body)
            error = assert_error(response, 400)
            assert error["param"] is not None and error["param"].split("[")[0].split(".")[0] == field, \
                (field, value, error)
            checked += 1
        # the server still answers exactly as before
        good = post(srv, body_with(), headers=HEADERS)
        assert answer_text(good) == expected["text"], field
    assert checked == sum(len(v) for v in BAD_VALUES.values())
    assert group_processes(srv) == processes  # no worker died (and none was restarted)


@pytest.mark.parametrize("which", ["server", "plain_server"])
def test_extreme_but_valid_values_are_served(which, request, expected, tiny_model):
    """Large within the wire's range is not an error: top_k past the vocabulary
    disables the filter, a stop token id at the vocabulary's last id is legal."""
    srv, body_with = _serving(request, which)
    for extra in ({"top_k": 2**63 - 1}, {"stop_token_ids": [vocab_size(tiny_model) - 1], "min_tokens": 2},
                  {"seed": 2**63 - 1, "temperature": 0}, {"min_tokens": 0, "ignore_eos": True}):
        response = post(srv, body_with(**extra), headers=HEADERS)
        assert response.status_code == 200, (extra, response.text)
    assert answer_text(post(srv, body_with(), headers=HEADERS)) == expected["text"]
