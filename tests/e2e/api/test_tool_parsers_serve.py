"""`--tool-call-parser pythonic` and `glm45` through `epd serve` with the official `openai`
client: a test-only regex makes the random model write the format, and tool_choice
"auto" answers its calls, the same streamed and whole, and cut short by max_tokens
as far as they got. (hermes: tests/e2e/api/test_structured_serve.py.) One aggregated
server per parser: the parser lives in the API process, the same in every mode."""
from __future__ import annotations

import json

import openai
import pytest
from testkit.server import start_server

TEXT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}}}}]
# what each format's regex makes the model write, and the content before the calls
FORMATS = {
    "pythonic": (r'\[get_weather\(city="(Paris|Rome)", days=[1-7]\), get_time\(zone="UTC"\)\]', None),
    "glm45": (r"Let me check\.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>(Paris|Rome)"
              r"</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1-7]</arg_value>\n</tool_call>\n"
              r"<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
              "Let me check."),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(request, tiny_model, tmp_path_factory):
    name = request.param
    srv = start_server(tiny_model, tmp_path_factory.mktemp(f"tools-{name}"), "aggregated",
                       "--enable-auto-tool-choice", "--tool-call-parser", name)
    yield name, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert srv.stop() == 0, srv.log()


def _tool_calls(client, stream: bool, **kwargs) -> tuple[list[tuple[str, str]], str | None, str]:
    """[(name, arguments)], content, finish_reason; streamed deltas concatenated by index."""
    model = client.models.list().data[0].id
    kwargs = dict(dict(model=model, messages=TEXT, tools=TOOLS, tool_choice="auto", temperature=0), **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.id is not None:
                assert call.type == "function" and call.id.startswith("call_")
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content or None, finish


def test_auto_answers_the_formats_calls_streamed_and_whole(served):
    name, client = served
    regex, content = FORMATS[name]
    body = dict(max_tokens=600, extra_body={"structured_outputs": {"regex": regex}})
    calls, got_content, reason = _tool_calls(client, False, **body)
    assert reason == "tool_calls" and got_content == content
    [(weather, arguments), time_call] = calls
    assert weather == "get_weather" and time_call == ("get_time", '{"zone": "UTC"}')
    parsed = json.loads(arguments)  # city a string (its schema type), days an integer
    assert parsed["city"] in ("Paris", "Rome") and parsed["days"] in range(1, 8)
    assert _tool_calls(client, True, **body) == (calls, got_content, reason)

    # cut short, inside the first call and inside the second: finish_reason stays "length",
    # a call begun carries its arguments so far
    num_tokens = client.chat.completions.create(model=client.models.list().data[0].id, messages=TEXT, tools=TOOLS,
                                                temperature=0, **body).usage.completion_tokens
    for max_tokens in (num_tokens * 2 // 5, num_tokens - 4):
        cut = dict(body, max_tokens=max_tokens)
        cut_calls, _, cut_reason = _tool_calls(client, False, **cut)
        assert cut_reason == "length" and cut_calls
        assert _tool_calls(client, True, **cut) == _tool_calls(client, False, **cut)
        for (cut_name, cut_arguments), (whole_name, whole_arguments) in zip(cut_calls, calls):
            assert cut_name == whole_name and whole_arguments.startswith(cut_arguments)
