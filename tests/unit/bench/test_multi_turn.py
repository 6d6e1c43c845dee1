"""`epd bench serve --dataset multi-turn` against the fake streaming server (conftest.py):
the conversations it draws and the request sequence it sends (tests/e2e/serve/test_multi_turn_bench.py
runs it against a real served model and reads the prefix cache's counters)."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from epd.bench.client import send_chat_request
from epd.bench.datasets import BenchRequest
from epd.bench.multi_turn import NOT_SENT, Conversation, run_conversations, sample_conversations
from epd.bench.prefix_cache_metrics import hit_rate_fields, parse_prefix_counters
from epd.bench.report import format_table
from epd.bench.serve import add_arguments, main

from testkit.fake_openai_server import MODEL_NAME


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_conversations_are_seeded_share_the_system_prompt_and_carry_images_where_asked():
    draw = dict(system_prompt_len=6, images_per_request=2, image_sizes=[(32, 24)], image_format="png", seed=3)
    first = sample_conversations(3, 4, 5, 2, **draw)
    assert first == sample_conversations(3, 4, 5, 2, **draw)
    assert first != sample_conversations(3, 4, 5, 2, **{**draw, "seed": 4})
    assert len({c.system_prompt for c in first}) == 1 and len(first[0].system_prompt.split()) == 6
    assert len({c.conversation_id for c in first}) == 3
    for c in first:
        assert [t.num_images for t in c.turns] == [2, 0, 0, 0]
        assert all(len(t.prompt.split()) == 5 and t.output_len == 2 for t in c.turns)
    every = sample_conversations(2, 3, 5, 2, **draw, images_every_turn=True)
    urls = [u for c in every for t in c.turns for u in t.image_urls]
    assert len(urls) == 12 and len(set(urls)) == 12  # new images each turn, none repeated
    assert sample_conversations(1, 2, 5, 2)[0].system_prompt is None


def test_bad_multi_turn_flags_are_refused_by_name(fake_server):
    with pytest.raises(ValueError, match="--num-turns must be >= 1"):
        sample_conversations(2, 0, 5, 2)
    with pytest.raises(ValueError, match="no video buckets"):
        sample_conversations(2, 2, 5, 2, images_per_request=1, image_sizes=[(32, 32, 4)])
    common = ("--base-url", fake_server.base_url, "--model", MODEL_NAME, "--dataset", "multi-turn")
    with pytest.raises(ValueError, match="not --num-prompts"):
        main(parse(*common, "--num-prompts", "4"))
    with pytest.raises(ValueError, match="multi-turn needs the chat endpoint"):
        main(parse(*common, "--backend", "openai"))
    with pytest.raises(ValueError, match="does not take --random-prefix-len, --text-only-ratio"):
        main(parse(*common, "--random-prefix-len", "8", "--text-only-ratio", "0.5"))


def test_each_turn_resends_the_history_with_the_answers_and_the_session_id(fake_server, tmp_path):
    out = tmp_path / "result.json"
    result = main(parse(
        "--base-url", fake_server.base_url, "--model", MODEL_NAME, "--dataset", "multi-turn",
        "--num-conversations", "3", "--num-turns", "3", "--input-len", "4", "--output-len", "2",
        "--system-prompt-len", "5", "--images-per-request", "1", "--image-size", "32x32",
        "--max-active-conversations", "2", "--no-progress", "--save-result", str(out), "--save-detailed"))
    bodies, headers = fake_server.payloads[1:], fake_server.headers[1:]  # the ready probe first
    assert len(bodies) == 9 and result["completed"] == 9 and result["num_prompts"] == 9
    by_conversation: dict[str, list[tuple[dict, dict]]] = {}
    for body, header in zip(bodies, headers):
        assert header["x-session-id"] == body["user"]
        by_conversation.setdefault(body["user"], []).append((body, header))
    assert sorted(by_conversation) == sorted(set(result["conversation_ids"]))
    for turns in by_conversation.values():
        system = turns[0][0]["messages"][0]
        assert system["role"] == "system" and len(system["content"].split()) == 5
        for t, (body, _) in enumerate(turns):
            messages = body["messages"]
            assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * t + ["user"]
            if t:  # the previous request's messages, then the answer it got, then the new user message
                assert messages[:-2] == turns[t - 1][0]["messages"]
                assert messages[-2] == {"role": "assistant", "content": "t0 t1 "}
            images = [p for m in messages if isinstance(m["content"], list) for p in m["content"]
                      if p["type"] == "image_url"]
            assert len(images) == 1  # the first turn's image, resent every turn
    assert [row["turn"] for row in result["ttft_by_turn"]] == [1, 2, 3]
    assert all(row["completed"] == 3 and row["p99_ttft_ms"] > 0 for row in result["ttft_by_turn"])
    assert sorted(result["turn_indices"]) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert "prefix_cache_hit_rate" not in result  # the fake server has no /metrics
    saved = json.loads(out.read_text())
    assert saved["ttft_by_turn"] == result["ttft_by_turn"] and saved["conversation_ids"] == result["conversation_ids"]
    assert "TTFT, turn 3" in format_table(result, [50.0, 99.0])


def test_a_failed_turn_ends_its_conversation_and_the_rest_are_recorded_unsent(fake_server):
    ok, failing = BenchRequest("hello there", 2), BenchRequest("FAIL now", 2)
    conversations = [Conversation("a", None, (ok, failing, ok)), Conversation("b", None, (ok, ok, ok))]

    async def run():
        async with httpx.AsyncClient() as http:
            async def send(request, run_start_s):
                return await send_chat_request(http, fake_server.base_url + "/v1/chat/completions", MODEL_NAME,
                                               request, run_start_s=run_start_s)
            return await run_conversations(conversations, [0.0, 0.0], send, progress=False)

    turns, _ = asyncio.run(run())
    assert [(t.conversation_id, t.turn_index, t.result.success) for t in turns] == [
        ("a", 1, True), ("a", 2, False), ("a", 3, False), ("b", 1, True), ("b", 2, True), ("b", 3, True)]
    assert "bad prompt FAIL" in turns[1].result.error and turns[2].result.error == NOT_SENT
    assert len(fake_server.payloads) == 5  # a's third turn was never sent


def test_hit_rate_comes_from_the_prefix_cache_counters_of_every_worker():
    epd = ('# TYPE epd:prefix_cache_hits_total counter\n'
           'epd:prefix_cache_queries_total{role="pd",worker="w0"} 100.0\n'
           'epd:prefix_cache_queries_total{role="pd",worker="w1"} 60.0\n'
           'epd:prefix_cache_hits_total{role="pd",worker="w0"} 48.0\n'
           'epd:prefix_cache_hits_created{role="pd",worker="w0"} 17.0\n')
    vllm = 'vllm:prefix_cache_queries_total{engine="0"} 10.0\nvllm:prefix_cache_hits_total{engine="0"} 5.0\n'
    assert parse_prefix_counters(epd) == {"queries": 160.0, "hits": 48.0}
    assert parse_prefix_counters(vllm) == {"queries": 10.0, "hits": 5.0}
    assert parse_prefix_counters("epd:num_preemptions_total 3.0\n") is None
    before, after = {"queries": 160.0, "hits": 48.0}, {"queries": 360.0, "hits": 198.0}
    assert hit_rate_fields(before, after) == {"prefix_cache_queries": 200, "prefix_cache_hits": 150,
                                              "prefix_cache_hit_rate": 0.75}
    assert hit_rate_fields(before, before)["prefix_cache_hit_rate"] is None
    assert hit_rate_fields(None, after) == {}
