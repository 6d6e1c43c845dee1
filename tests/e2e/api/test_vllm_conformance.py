"""vLLM's own OpenAI-server tests, re-asked of EPD (issue 31, "Tests": vLLM's API
tests are the reference for behaviour). Each test names the vLLM test it mirrors
(vllm-project/vllm, tests/entrypoints/openai/...), read for what it checks, and
asks the same of a real `epd serve` of the tiny checkpoint with the official
`openai` client (httpx where the raw shape matters), in every mode: the shared
server of each mode (tests/testkit/mode_servers.py), many small requests. This
module: completions, the length limits and the server's routes; the chat tests
are in test_vllm_conformance_chat.py, the requests both make in
tests/testkit/vllm_conformance.py.

Where EPD deliberately answers otherwise (beam search; logprob counts past 20, -1
for the whole vocabulary) the test asserts EPD's answer and docs/vllm_fields.md
says why. Checks that hold only for vLLM's checkpoints (an exact token count of
zephyr's prompt, "1+1" answered "2") are asked in the form that holds for any
checkpoint (the count the tokenizer gives, string and parts giving one answer)."""
from __future__ import annotations

import httpx
import openai
import pytest
from testkit.mode_servers import MODES
from testkit.vllm_conformance import MESSAGES, MODEL, PROMPT, chat, client, complete, refused, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.parametrize("mode_server", MODES, indirect=True)


@pytest.fixture(scope="module")
def max_model_len(mode_server) -> int:
    return httpx.get(mode_server.base_url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]


# -- /v1/completions: completion/test_completion.py -------------------------------------------------

def test_single_completion(client, tokenizer):
    # completion/test_completion.py::test_single_completion
    r = complete(client)
    assert r.id and r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    num_prompt = len(tokenizer.encode(PROMPT))
    assert (r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.total_tokens) == (5, num_prompt, num_prompt + 5)
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)
    by_ids = complete(client, prompt=[0, 0, 0, 0, 0])
    assert by_ids.choices[0].text and by_ids.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("logprobs", [None, 0, 5])
def test_completion_logprobs_counts(client, logprobs):
    # completion/test_completion.py::test_no_logprobs, test_zero_logprobs, test_some_logprobs
    lp = complete(client, prompt=[0, 0, 0, 0, 0], logprobs=logprobs).choices[0].logprobs
    if logprobs is None:
        assert lp is None
        return
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 5
    assert all(max(logprobs, 1) <= len(step) <= logprobs + 1 for step in lp.top_logprobs)


def test_too_many_logprobs_then_still_serving(client):
    # completion/test_completion.py::test_too_many_completion_logprobs;
    # chat_completion/test_chat.py::test_too_many_chat_logprobs
    refused(lambda: complete(client, prompt=[0, 0, 0, 0, 0], logprobs=21))
    refused(lambda: list(complete(client, prompt=[0, 0, 0, 0, 0], logprobs=30, stream=True)))
    refused(lambda: list(chat(client, logprobs=True, top_logprobs=21, stream=True)))
    refused(lambda: chat(client, logprobs=True, top_logprobs=30))
    assert complete(client).choices[0].text and chat(client).choices[0].message.content is not None


@pytest.mark.parametrize("k", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, k):
    # completion/test_completion.py::test_prompt_logprobs_completion
    prompts = ["A robot may not injure another robot", "My name is"]
    if k is not None and k < 0:  # -1 (all the vocabulary) is past the default --max-logprobs 20 in vLLM too
        refused(lambda: complete(client, prompt=prompts, max_tokens=1, extra={"prompt_logprobs": k}))
        return
    r = complete(client, prompt=prompts, max_tokens=1, extra={} if k is None else {"prompt_logprobs": k})
    for choice in r.choices:
        steps = choice.model_extra["prompt_logprobs"]
        if k is None:
            assert steps is None
        else:
            assert steps and steps[0] is None and all(k <= len(s) <= k + 1 for s in steps[1:])


def test_completion_streaming(client):
    # completion/test_completion.py::test_completion_streaming
    prompt = "What is an LLM?"
    single = complete(client, prompt=prompt).choices[0].text
    chunks = list(complete(client, prompt=prompt, stream=True))
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1  # only in the last chunk
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == single


def test_parallel_sampling(client):
    # completion/test_completion.py::test_parallel_no_streaming, test_parallel_streaming (vLLM also asserts the
    # samples end at different lengths, which needs EOS from a trained model: here every sample runs to max_tokens)
    r = complete(client, prompt="What is an LLM?", max_tokens=8, n=3, temperature=1.0, logprobs=0, seed=42)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason for c in r.choices)
    assert len({c.text for c in r.choices}) == 3 and all(len(c.logprobs.tokens) == 8 for c in r.choices)
    texts, finished = ["", "", ""], 0
    for chunk in complete(client, prompt="What is an LLM?", max_tokens=8, n=3, temperature=1.0, seed=42, stream=True):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 3 and len(set(texts)) == 3


def test_completion_stream_options(client):
    # completion/test_completion.py::test_completion_stream_options
    def stream(options):
        return list(complete(client, prompt="What is the capital of France?", stream=True, stream_options=options))

    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):
        assert all(c.usage is None for c in stream(options))
    chunks = stream({"include_usage": True, "continuous_usage_stats": False})
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason is not None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    usage = chunks[-1].usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    chunks = stream({"include_usage": True, "continuous_usage_stats": True})
    for c in chunks:
        assert c.usage.prompt_tokens > 0 and c.usage.completion_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason is not None
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):  # not streamed: a 400
        refused(lambda: complete(client, stream=False, stream_options=options))


def test_batch_completions(client):
    # completion/test_completion.py::test_batch_completions (its n=2 half needs beam search: refused here)
    for prompts in ([PROMPT] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = complete(client, prompt=prompts)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        error = refused(lambda: complete(client, prompt=prompts, n=2, extra={"use_beam_search": True}))
        assert error.body["param"] == "use_beam_search"
        texts = ["", ""]
        for chunk in complete(client, prompt=prompts, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1] == batch.choices[0].text


@pytest.mark.parametrize("k", [1, 0])
def test_echo_logprob_completion(client, tokenizer, k):
    # completion/test_completion.py::test_echo_logprob_completion
    for prompt in (PROMPT, [0, 0, 0, 0, 0]):
        r = complete(client, prompt=prompt, echo=True, logprobs=k)
        prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert r.choices[0].text.startswith(prompt_text)
        lp = r.choices[0].logprobs
        assert len(lp.text_offset) > 5 and len(lp.tokens) > 5
        assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
        assert all(max(k, 1) <= len(step) <= k + 1 for step in lp.top_logprobs[1:])


def test_echo_with_max_tokens_zero_returns_the_prompt(client, tokenizer):
    # vLLM's completion/serving.py (`echo` and `max_tokens` 0: "only return the prompt", as OpenAI's legacy
    # API scores a prompt); without echo, max_tokens 0 is a 400 (SamplingParams: at least 1)
    r = complete(client, max_tokens=0, echo=True, logprobs=1)
    num_prompt = len(tokenizer.encode(PROMPT))
    assert r.choices[0].text == PROMPT and r.usage.prompt_tokens == num_prompt
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == num_prompt and lp.token_logprobs[0] is None
    streamed = list(complete(client, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == PROMPT
    assert refused(lambda: complete(client, max_tokens=0)).body["param"] == "max_tokens"


@pytest.mark.parametrize("constraint", [
    {"json": {"type": "object", "properties": {"foo": "bar"}}},  # test_invalid_json_schema
    {"regex": r"[.*"},  # test_invalid_regex
    {"grammar": "root ::= select_statementinvalidsyntax"},  # test_invalid_grammar
    {"grammar": ""},  # chat_completion/test_chat_completion.py::test_empty_grammar
])
def test_invalid_structured_outputs(client, constraint):
    # completion/test_completion.py::test_invalid_json_schema, test_invalid_regex, test_invalid_grammar;
    # chat_completion/test_chat.py::test_structured_outputs_type_error
    refused(lambda: complete(client, extra={"structured_outputs": constraint}))
    refused(lambda: chat(client, extra={"structured_outputs": {"regex": {1: "Python", 2: "C++"}}}))


def test_truncation_side(client):
    # completion/test_completion.py::test_completion_truncation_side_controls_prompt_truncation;
    # chat_completion/test_chat_completion.py::test_chat_completion_truncation_side_controls_prompt_truncation
    ids = list(range(8))
    messages = [{"role": "user", "content": "Summarize how prompt truncation works in one sentence."}]
    whole = chat(client, messages, max_tokens=1, extra={"return_token_ids": True}).model_extra["prompt_token_ids"]
    assert len(whole) > 4
    for side, kept, kept_chat in (("right", ids[:4], whole[:4]), ("left", ids[-4:], whole[-4:])):
        asked = {"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side}
        r = complete(client, prompt=ids, max_tokens=1, extra=asked)
        assert r.choices[0].model_extra["prompt_token_ids"] == kept
        assert chat(client, messages, max_tokens=1, extra=asked).model_extra["prompt_token_ids"] == kept_chat


def test_completion_request_validation(client):
    # completion/test_completion_error.py::test_json_schema_response_format_missing_schema,
    # test_negative_prompt_token_ids_nested, _flat; completion/test_empty_prompt_list.py;
    # completion/test_prompt_validation.py::test_empty_prompt, test_out_of_vocab_token_ids
    refused(lambda: complete(client, extra={"response_format": {"type": "json_schema"}}))
    for prompt in ([[-1]], [-1], [], ""):
        assert refused(lambda: complete(client, prompt=prompt)).body["param"] == "prompt"
    assert "out of vocabulary" in refused(lambda: complete(client, prompt=[999999])).body["message"]


def test_streamed_text_offset_equals_the_whole_answers(client):
    # completion/test_completion_text_offset.py::test_stream_text_offset_matches_non_stream_with_stop_holdback
    kwargs = dict(max_tokens=8, logprobs=0, stop=["\n\n"])
    whole = complete(client, **kwargs).choices[0].logprobs
    streamed = [o for c in complete(client, stream=True, **kwargs) for o in c.choices[0].logprobs.text_offset]
    assert streamed == whole.text_offset
    assert all(whole.text_offset[i + 1] == whole.text_offset[i] + len(whole.tokens[i]) for i in range(7))


def test_stop_string_ends_the_text(client):
    # stop strings as vLLM applies them (completion/test_completion_text_offset.py holds text back for one;
    # `stop_reason` names it: completion/protocol.py)
    text = complete(client, max_tokens=12).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    for stream in (False, True):
        if stream:
            chunks = list(complete(client, max_tokens=12, stop=[stop], stream=True))
            got, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
        else:
            last = complete(client, max_tokens=12, stop=[stop]).choices[0]
            got = last.text
        assert got == text[:text.index(stop)]
        assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", stop)


# -- return_token_ids: basic/test_return_token_ids.py ------------------------------------------------

def test_return_token_ids_completion(client, tokenizer):
    # basic/test_return_token_ids.py::test_basic_completion_with_emoji
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    r = complete(client, prompt=prompt, max_tokens=10, logprobs=1, extra={"return_token_ids": True})
    choice, encoded = r.choices[0], tokenizer.encode(prompt)
    ids = choice.model_extra["prompt_token_ids"]
    assert any(ids[i:i + len(encoded)] == encoded for i in range(len(ids) - len(encoded) + 1))
    assert choice.model_extra["token_ids"]
    assert tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True).startswith(choice.text)
    without = complete(client, prompt=prompt, max_tokens=10, logprobs=1, extra={"return_token_ids": False})
    extra = without.choices[0].model_extra
    assert extra["token_ids"] is None and extra["prompt_token_ids"] is None


def test_token_ids_agree_with_logprobs(client, tokenizer):
    # basic/test_return_token_ids.py::test_comparison_with_prompt_logprobs_and_logprobs
    asked = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    r = complete(client, prompt="Hello, world! How are you today?", max_tokens=8, echo=True, logprobs=1,
                 extra={**asked, "prompt_logprobs": 1})
    choice = r.choices[0]
    token_ids, extra = choice.model_extra["token_ids"], choice.model_extra
    assert extra["prompt_token_ids"] and extra["prompt_logprobs"] and choice.logprobs
    logprob_ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert len(token_ids) < len(logprob_ids) and logprob_ids[-len(token_ids):] == token_ids
    assert "Hello, world" in tokenizer.decode(extra["prompt_token_ids"])
    assert choice.text.endswith(tokenizer.decode(token_ids, skip_special_tokens=True))
    chunks = list(complete(client, prompt="Tell me a short fact about Python:", max_tokens=8, logprobs=1,
                           stream=True, extra=asked))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"]
    streamed = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == [int(t.removeprefix("token_id:")) for c in chunks for t in c.choices[0].logprobs.tokens]


# -- limits: vLLM's renderers/params.py (TokenizeParams) and serve/utils/api_utils.py (get_max_tokens) ----

def test_max_tokens_limits(client, max_model_len):
    # vLLM 0.32: max_tokens past max_model_len is a 400 naming the field; a prompt past it is a 400 "maximum
    # context length"; otherwise max_tokens is cut to what the context has room for (get_max_tokens)
    error = refused(lambda: complete(client, max_tokens=max_model_len + 1))
    assert error.body["param"] == "max_tokens" and f"max_model_len={max_model_len}" in error.message
    error = refused(lambda: chat(client, max_tokens=max_model_len + 1))
    assert error.body["param"] == "max_completion_tokens"
    fits = complete(client, max_tokens=max_model_len, extra={"allowed_token_ids": [0], "stop_token_ids": [0]})
    assert fits.choices[0].finish_reason == "stop"  # asked for the whole context: served, cut to the room
    error = refused(lambda: complete(client, prompt="hi " * (max_model_len + 8)))
    assert "maximum context length" in error.message and str(max_model_len) in error.message


# -- the server: basic/test_basic.py, test_tokenization.py ----------------------------------------------

def test_version_health_and_content_type(client, mode_server):
    # basic/test_basic.py::test_show_version, test_check_health, test_request_wrong_content_type
    version = httpx.get(mode_server.base_url + "/version", timeout=30)
    assert version.status_code == 200 and set(version.json()) == {"version"}
    assert httpx.get(mode_server.base_url + "/health", timeout=30).status_code == 200
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                       extra_headers={"Content-Type": "application/x-www-form-urlencoded"})


def test_tokenize_and_detokenize(mode_server, tokenizer, max_model_len):
    # test_tokenization.py::test_tokenize_completions, test_tokenize_chat, test_tokenize_with_return_token_strs,
    # test_detokenize (chat with add_special_tokens true is refused: EPD tokenizes a chat as its chat endpoint does)
    def post(path, body):
        response = httpx.post(mode_server.base_url + path, json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    prompt = "vllm1 This is a test prompt."
    for add_special in (False, True):
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        result = post("/tokenize", {"prompt": prompt, "add_special_tokens": add_special})
        assert result == {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len, "token_strs": None}
    conversation = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
                    {"role": "user", "content": "Can I ask a question? vllm1"}]
    for add_generation in (False, True):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation, tokenize=False)
        result = post("/tokenize", {"messages": conversation, "add_generation_prompt": add_generation})
        assert result["tokens"] == tokenizer.encode(text, add_special_tokens=False) and result["token_strs"] is None
    result = post("/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt))
    assert post("/detokenize", {"tokens": tokenizer.encode(prompt, add_special_tokens=False)}) == {"prompt": prompt}


def test_error_body_shape(mode_server):
    # vLLM's ErrorResponse ({"error": {message, type, param, code}}), read by the openai client in every test
    # above; an unknown model is a 404 "The model `...` does not exist." (models/serving.py)
    response = httpx.post(mode_server.base_url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": -1})
    error = response.json()["error"]
    assert response.status_code == 400 and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "temperature"
    response = httpx.post(mode_server.base_url + "/v1/completions", timeout=30,
                          json={"model": "no-such-model", "prompt": PROMPT, "max_tokens": 1})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The model `no-such-model` does not exist."
