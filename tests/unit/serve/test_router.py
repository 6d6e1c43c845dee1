"""Routers pick workers as documented."""
from __future__ import annotations

from collections import Counter

from epd.serve.router import (LeastLoadedRouter, LeastRequestsRouter, PrefixHashRouter, RoundRobinRouter,
                              idle_prefill_workers, make_router)
from epd.serve.registry import WorkerInfo
from epd.transport.wire.messages import WorkerStats


def _workers(loads):
    out = []
    for i, load in enumerate(loads):
        w = WorkerInfo(f"prefill-{i}", "prefill", f"ipc:///tmp/x/prefill-{i}.sock")
        w.stats = WorkerStats(w.worker_id, "prefill", num_running=load, num_waiting=0, num_free_blocks=0,
                              num_total_blocks=0, queue_depth=0)
        out.append(w)
    return out


def test_round_robin_cycles():
    workers = _workers([0, 0, 0])
    router = RoundRobinRouter()
    assert [router.choose(workers, [1]).worker_id for _ in range(6)] == \
        ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_least_loaded_prefers_the_idle_worker():
    workers = _workers([50, 0])
    router = LeastLoadedRouter(seed=1)
    picks = Counter(router.choose(workers, [1]).worker_id for _ in range(100))
    assert picks == {"prefill-1": 100}  # of two choices among two workers, the idle one always wins
    many = _workers([9, 9, 9, 0])
    picks = Counter(router.choose(many, [1]).worker_id for _ in range(300))
    assert picks.most_common(1)[0][0] == "prefill-3"


def test_prefix_hash_is_sticky_and_spreads():
    workers = _workers([0, 0, 0, 0])
    router = PrefixHashRouter()
    prompts = [[i] * 80 for i in range(200)]
    first = [router.choose(workers, p).worker_id for p in prompts]
    assert first == [router.choose(workers, p).worker_id for p in prompts]  # same prefix, same worker
    assert len(set(first)) == 4
    # Only the first block-aligned tokens matter: a different tail keeps the worker.
    assert router.choose(workers, [5] * 64 + [1, 2, 3]).worker_id == router.choose(workers, [5] * 64).worker_id
    # Removing a worker moves only the prompts that were on it (consistent hashing).
    fewer = [w for w in workers if w.worker_id != "prefill-0"]
    moved = sum(a != router.choose(fewer, p).worker_id for a, p in zip(first, prompts) if a != "prefill-0")
    assert moved == 0


def test_make_router_names():
    assert isinstance(make_router("prefix_hash"), PrefixHashRouter)


def test_least_requests_counts_what_it_sent_since_the_last_report():
    workers = _workers([3, 0, 1])
    router = LeastRequestsRouter()
    picks = [router.choose(workers, [1]).worker_id for _ in range(5)]
    # loads 3, 0, 1 plus what was sent since: 1 -> (3,1,1) -> ties in turn ... never the busiest first
    assert picks[0] == "prefill-1"
    assert Counter(picks) == {"prefill-1": 3, "prefill-2": 2}  # each ends at 3 requests, like prefill-0
    # a new report replaces the worker's count: prefill-1 now says it holds nothing
    workers[1].stats = WorkerStats("prefill-1", "prefill", num_running=0, num_waiting=0, num_free_blocks=0,
                                   num_total_blocks=0, queue_depth=0)
    assert router.choose(workers, [1]).worker_id == "prefill-1"


def test_a_short_text_prompt_goes_to_an_idle_prefill_worker_only_when_no_decode_worker_has_room_for_it():
    decoders = [WorkerInfo(f"decode-{i}", "decode", f"ipc:///tmp/x/decode-{i}.sock") for i in range(2)]
    prefills = _workers([0, 0])

    def target(pending, num_tokens=300):  # decode workers prefill at most 512 prompt tokens a step
        return [w.worker_id for w in idle_prefill_workers(decoders, prefills, pending, num_tokens, 512)]

    assert target({}) == []  # a decode worker is free: it prefills the prompt itself
    assert target({"decode-0": 400}) == []  # decode-1 still is
    assert target({"decode-0": 400, "decode-1": 200}) == []  # 200 + 300 fit decode-1's next step
    assert target({"decode-0": 400, "decode-1": 200}, num_tokens=400) == ["prefill-0", "prefill-1"]
    assert target({"decode-0": 400, "decode-1": 400, "prefill-0": 900}) == ["prefill-1"]
    assert target({"decode-0": 400, "decode-1": 400, "prefill-0": 900, "prefill-1": 1}) == []  # none idle
    assert idle_prefill_workers(decoders, [], {"decode-0": 400, "decode-1": 400}, 300, 512) == []  # none live


def test_a_worker_with_the_adapter_resident_is_preferred_when_loads_are_equal_ish():
    from epd.serve.router import prefer_adapter
    from epd.transport.wire.wire_values import LoRAState

    workers = _workers([4, 5, 6, 20])
    for w, resident in zip(workers, [(), ("sql",), ("chat", "sql"), ("sql",)]):
        w.stats.lora = LoRAState(resident=resident, max_lora=2)
    ids = lambda ws: [w.worker_id for w in ws]  # noqa: E731
    # within max(2, 4 // 4) requests of the least loaded (4): the two warm ones; the busy warm one is not
    assert ids(prefer_adapter(workers, "sql")) == ["prefill-1", "prefill-2"]
    assert ids(prefer_adapter(workers, "chat")) == ["prefill-2"]
    assert prefer_adapter(workers, "math") == workers  # resident nowhere: every worker
    assert prefer_adapter(workers, None) == workers  # the base model
    workers[2].stats.num_running = 7  # three more than the least loaded: too busy to be preferred
    assert prefer_adapter(workers, "chat") == workers
    # every router then chooses among them: the least loaded of the warm, not the least loaded of all
    assert LeastRequestsRouter().choose(prefer_adapter(workers, "sql"), [1]).worker_id == "prefill-1"
    big = _workers([40, 49, 51])
    big[1].stats.lora = big[2].stats.lora = LoRAState(resident=("sql",))
    assert ids(prefer_adapter(big, "sql")) == ["prefill-1"]  # a quarter of 40 is the slack past 2
