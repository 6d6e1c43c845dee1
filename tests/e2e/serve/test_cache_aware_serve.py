"""`--router cache_aware` through a real `epd serve` of two aggregated workers: a
multi-turn exchange (each turn resends the history, an image in its first message)
lands every turn of a conversation on the worker that holds it, as the prefix-cache
hits the workers count show: every turn after the first finds the whole previous
prompt cached, and the router's index holds the blocks the workers reported. The
same exchange under round_robin, on a second server started beside it, finds
less of it. Counters, not times."""
from __future__ import annotations

import httpx
import pytest

from testkit.media import image_bytes, image_part
from testkit.server import ServerProcess, free_port

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the engine's default
NUM_TURNS = 3
CONVERSATIONS = ("a", "b", "c")  # interleaved turn by turn: round robin moves each to the other worker


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """{router: server}, both started at once (two aggregated workers each)."""
    log_dir = tmp_path_factory.mktemp("cache-aware")
    started = {}
    for router in ("cache_aware", "round_robin"):
        port = free_port()
        started[router] = ServerProcess(
            ["serve", tiny_model, "--mode", "aggregated", "--prefill", "2", "--router", router, "--port", str(port),
             "--num-kv-blocks", "256", "--dtype", "float32", "--device", "cpu", "--threads-per-worker", "1"],
            port, str(log_dir / f"server-{router}.log"))
    try:
        yield {router: srv.wait_ready() for router, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop()


def _user_turn(conversation: str, turn: int) -> str:
    return f"Conversation {conversation}, question {turn}: " + " ".join(f"{conversation}{turn}w{i}" for i in range(12))


def exchange(server: ServerProcess) -> dict[str, list[tuple[int, int]]]:
    """Every conversation's turns, in turn order across conversations: {conversation: [(prompt tokens,
    cached tokens)] per turn}."""
    histories = {c: [{"role": "user", "content": [image_part(image_bytes(48, 48, seed=ord(c))),
                                                    {"type": "text", "text": _user_turn(c, 0)}]}]
                 for c in CONVERSATIONS}
    usage = {c: [] for c in CONVERSATIONS}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for turn in range(NUM_TURNS):
            for c in CONVERSATIONS:
                r = client.post("/v1/chat/completions", json={
                    "model": client.get("/v1/models").json()["data"][0]["id"], "messages": histories[c],
                    "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                usage[c].append((body["usage"]["prompt_tokens"],
                                 body["usage"]["prompt_tokens_details"]["cached_tokens"]))
                histories[c] += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": _user_turn(c, turn + 1)}]
    return usage


def test_every_turn_lands_where_its_conversation_is_cached(servers):
    cache_aware = exchange(servers["cache_aware"])
    round_robin = exchange(servers["round_robin"])
    for c, turns in cache_aware.items():
        for (previous, _), (_, cached) in zip(turns, turns[1:]):
            assert cached >= previous // BLOCK_SIZE * BLOCK_SIZE, (c, turns)  # the whole previous prompt
    hits = {name: sum(cached for turns in usage.values() for _, cached in turns[1:])
            for name, usage in (("cache_aware", cache_aware), ("round_robin", round_robin))}
    assert hits["round_robin"] < hits["cache_aware"], (hits, cache_aware, round_robin)
    missed = [(c, t) for c, turns in round_robin.items() for t in range(1, NUM_TURNS)
              if turns[t][1] < turns[t - 1][0] // BLOCK_SIZE * BLOCK_SIZE]
    assert missed, round_robin  # round robin moved some turn away from its conversation's KV
    # the router knew from the workers' own reports, not only from what it had routed (never reported)
    assert servers["cache_aware"].metric_sum("epd:router_cached_blocks") >= max(
        cached for turns in cache_aware.values() for _, cached in turns) // BLOCK_SIZE
    assert not any(key.startswith("epd:router_cached_blocks") for key in servers["round_robin"].metrics())
