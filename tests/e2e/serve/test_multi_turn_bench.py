"""`epd bench serve --dataset multi-turn` against the shared aggregated server of the tiny
model (tests/testkit/mode_servers.py): each turn resends the history with the answers the
server actually gave, and the result's prefix-cache hit rate (the workers' counters, read
from /metrics) is above 0 with prefix caching on, as it is by default."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from epd.bench.client import send_chat_request
from epd.bench.multi_turn import run_conversations, sample_conversations
from epd.bench.serve import add_arguments, main
from testkit.mode_servers import SERVED_MODEL

pytestmark = pytest.mark.parametrize("mode_server", ["aggregated"], indirect=True)  # one server is enough


def test_each_turn_resends_the_history_with_the_served_answers(mode_server, tiny_model):
    conversations = sample_conversations(2, 3, 8, 4, system_prompt_len=16, images_per_request=1,
                                         image_sizes=[(64, 48)], seed=5)
    sent: list[tuple[dict, dict]] = []

    async def record(request: httpx.Request) -> None:
        sent.append((json.loads(request.content), dict(request.headers)))

    async def run():
        async with httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120) as http:
            async def send(request, run_start_s):
                return await send_chat_request(http, mode_server.base_url + "/v1/chat/completions", SERVED_MODEL,
                                               request, run_start_s=run_start_s)
            return await run_conversations(conversations, [0.0, 0.0], send, progress=False)

    turns, _ = asyncio.run(run())
    assert all(t.result.success for t in turns), [t.result.error for t in turns]
    assert len(sent) == 6
    answers = {(t.conversation_id, t.turn_index): t.result.generated_text for t in turns}
    for (body, headers), turn in zip(sorted(sent, key=lambda s: (s[0]["user"], len(s[0]["messages"]))), turns):
        assert body["user"] == headers["x-session-id"] == turn.conversation_id
        messages = body["messages"]
        assert messages[0] == {"role": "system", "content": conversations[0].system_prompt}
        assert len(messages) == 2 * turn.turn_index  # system, (user, assistant) per earlier turn, user
        for earlier in range(1, turn.turn_index):  # each earlier answer, as the server gave it
            assert messages[2 * earlier] == {"role": "assistant",
                                             "content": answers[(turn.conversation_id, earlier)]}
        assert [p["type"] for p in messages[1]["content"]] == ["image_url", "text"]  # turn 1's image, resent
    assert all(answers.values())


def test_the_result_has_the_hit_rate_and_each_turns_ttft(mode_server, tiny_model):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = main(parser.parse_args([
        "--base-url", mode_server.base_url, "--model", SERVED_MODEL, "--tokenizer", tiny_model,
        "--dataset", "multi-turn", "--num-conversations", "3", "--num-turns", "3", "--input-len", "8",
        "--output-len", "4", "--system-prompt-len", "32", "--images-per-request", "1", "--image-size", "64x48",
        "--max-active-conversations", "3", "--seed", "11", "--no-progress"]))
    assert result["completed"] == 9 and result["failed"] == 0
    # every prompt token of the run looked up once; later turns find their history (counters, not times)
    assert result["prefix_cache_queries"] == sum(result["input_lens"])
    assert 0 < result["prefix_cache_hits"] < result["prefix_cache_queries"]
    assert result["prefix_cache_hit_rate"] == result["prefix_cache_hits"] / result["prefix_cache_queries"]
    assert [row["turn"] for row in result["ttft_by_turn"]] == [1, 2, 3]
    assert all(row["completed"] == 3 and 0 < row["p50_ttft_ms"] <= row["p99_ttft_ms"]
               for row in result["ttft_by_turn"])
