"""The cache-aware router (epd/serve/cache_aware_router.py) on its prefix index
(epd/serve/prefix_index.py), fed real event batches: a scheduler's block manager
records its prefix cache's changes, they cross the wire as KVBlocks, and the
index, which computes a request's hashes with the block manager's own function,
finds exactly the blocks the worker can hit."""
from __future__ import annotations

import pytest

from epd.engine.block_hash import prompt_block_hashes, root_block_hash
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from epd.serve.cache_aware_router import IMBALANCE_ABS, CacheAwareRouter, RouteQuery, is_imbalanced
from epd.serve.prefix_index import PrefixIndex
from epd.serve.registry import WorkerInfo
from epd.transport.wire.kv_events import external_block_hash
from epd.transport.wire.messages import KVBlocks, WireError, WorkerStats, decode_message

from testkit.engine_factories import fake_run, image_request, make_request

BLOCK_SIZE = 4


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scheduler(num_blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=512,
                             enable_prefix_caching=True)
    return Scheduler(config, num_blocks, kv_events=True)


class Worker:
    """One engine's scheduler and the KVBlocks its worker would send (session, seq)."""

    def __init__(self, worker_id: str, session: str = "aa", num_blocks: int = 64):
        self.worker_id, self.session, self.seq = worker_id, session, 0
        self.scheduler = _scheduler(num_blocks)

    def run(self, request) -> list[KVBlocks]:
        """Runs `request` to its end; the batches sent, one per step that changed the cache, decoded off the wire."""
        self.scheduler.add_request(request)
        sent = []
        while self.scheduler.has_unfinished():
            output = self.scheduler.schedule()
            self.scheduler.update(output, fake_run(output))
            events = self.scheduler.block_manager.kv_events.take()
            if events:
                msg = KVBlocks.of_events(self.worker_id, self.seq, events, self.session)
                self.seq += 1
                sent.append(decode_message(msg.to_wire()))
        return sent


def api_hashes(request) -> list[int]:
    """The request's block hashes as the API computes them (placement.py's rule)."""
    token_ids = request.prompt_token_ids
    num_blocks = (len(token_ids) - 1) // BLOCK_SIZE
    return [external_block_hash(h) for h in prompt_block_hashes(token_ids, request.mm_spans, BLOCK_SIZE,
                                                                num_blocks, root_block_hash(None))]


def _apply(index: PrefixIndex, batches: list[KVBlocks]) -> None:
    for msg in batches:
        index.apply(msg)


def test_the_index_finds_what_the_workers_block_manager_can_hit():
    worker, index = Worker("w0"), PrefixIndex()
    first = image_request(["ab" * 32], num_image_tokens=6, num_text=3, max_tokens=3)
    _apply(index, worker.run(first))
    again = image_request(["ab" * 32], num_image_tokens=6, num_text=3, max_tokens=3)
    hashes = api_hashes(again)
    computed, _ = worker.scheduler.block_manager.get_computed_blocks(again)
    assert index.match("w0", hashes) == len(computed) == len(hashes) > 0  # the same hash, one implementation
    other_image = image_request(["cd" * 32], num_image_tokens=6, num_text=3)
    assert index.match("w0", api_hashes(other_image)) == 0  # same tokens, another image: its first block differs
    assert index.match("w1", hashes) == 0


def test_evictions_and_a_reset_leave_the_index():
    worker, index = Worker("w0", num_blocks=6), PrefixIndex()
    a = make_request(prompt_token_ids=list(range(1, 18)), max_tokens=2)
    _apply(index, worker.run(a))
    assert index.match("w0", api_hashes(a)) == 4
    _apply(index, worker.run(make_request(prompt_token_ids=list(range(100, 118)), max_tokens=2)))  # evicts a's
    assert index.match("w0", api_hashes(a)) == len(worker.scheduler.block_manager.get_computed_blocks(a)[0]) < 4
    worker.scheduler.block_manager.reset_prefix_cache()
    index.apply(KVBlocks.of_events("w0", worker.seq, worker.scheduler.block_manager.kv_events.take(), "aa"))
    assert index.num_blocks("w0") == 0


def test_a_restart_or_a_gap_clears_what_the_index_knew_of_a_worker():
    worker, index = Worker("w0"), PrefixIndex()
    a = make_request(prompt_token_ids=list(range(1, 18)), max_tokens=1)
    _apply(index, worker.run(a))
    assert index.num_blocks("w0") == 4
    b = make_request(prompt_token_ids=list(range(50, 60)), max_tokens=8)
    batches = worker.run(b)
    assert len(batches) >= 2
    _apply(index, batches[1:])  # the first batch lost: what the worker holds is unknown
    assert index.num_gaps == 1 and index.match("w0", api_hashes(a)) == 0
    restarted = Worker("w0", session="bb")  # a new process under the same id: its cache starts empty
    _apply(index, restarted.run(make_request(prompt_token_ids=list(range(70, 80)), max_tokens=1)))
    assert index.match("w0", api_hashes(b)) == 0 and index.num_blocks("w0") == 2
    index.forget("w0")
    assert index.num_blocks("w0") == 0


def test_a_speculative_insert_expires_unless_an_event_confirms_it():
    clock = Clock()
    index = PrefixIndex(speculative_ttl_s=5.0, clock=clock)
    worker = Worker("w0")
    a = make_request(prompt_token_ids=list(range(1, 18)), max_tokens=1)
    b = make_request(prompt_token_ids=list(range(30, 48)), max_tokens=1)
    index.insert_speculative("w0", api_hashes(a))
    index.insert_speculative("w0", api_hashes(b))
    assert index.match("w0", api_hashes(a)) == 4 and index.match("w0", api_hashes(b)) == 4
    _apply(index, worker.run(a))  # a's blocks confirmed, b's never computed
    clock.now += 5.0
    assert index.match("w0", api_hashes(a)) == 4
    assert index.match("w0", api_hashes(b)) == 0


def _workers(loads, free=(100, 100, 100)):
    out = []
    for i, load in enumerate(loads):
        w = WorkerInfo(f"w{i}", "aggregated", f"ipc:///tmp/x/w{i}.sock")
        w.stats = WorkerStats(w.worker_id, "aggregated", num_running=load, num_waiting=0, num_free_blocks=free[i],
                              num_total_blocks=100, queue_depth=0)
        out.append(w)
    return out


def test_the_longest_cached_prefix_wins_and_a_burst_sticks_before_any_event():
    index = PrefixIndex()
    router = CacheAwareRouter(index)
    workers = _workers([0, 0, 0])
    index.insert_speculative("w2", [1, 2, 3])
    index.insert_speculative("w1", [1])
    assert router.choose(workers, [], RouteQuery([1, 2, 3, 4])).worker_id == "w2"
    # nothing cached anywhere: the least loaded (the sent request counts until the next stats)
    first = router.choose(workers, [], RouteQuery([7, 8, 9]))
    assert first.worker_id != "w2"
    assert [router.choose(workers, [], RouteQuery([7, 8, 9, 10])).worker_id for _ in range(3)] == [first.worker_id] * 3
    assert router.num_choices == {"imbalance": 0, "session": 0, "least_loaded": 1, "cache": 4}


def test_a_short_hit_goes_to_the_least_loaded_a_long_one_to_its_holder():
    index = PrefixIndex()
    router = CacheAwareRouter(index)
    index.insert_speculative("w0", [1])
    workers = _workers([6, 0], free=(10, 100))  # w0: a quarter of the prefix, busy and its KV nearly full
    assert router.choose(workers, [], RouteQuery([1, 2, 3, 4])).worker_id == "w1"
    index.insert_speculative("w0", [11, 12, 13, 14])  # most of it, one request more than w1
    workers = _workers([1, 0])
    assert router.choose(workers, [], RouteQuery([11, 12, 13, 14, 15])).worker_id == "w0"


def test_a_shared_system_prompt_does_not_pull_new_conversations_onto_its_holder():
    index = PrefixIndex()
    router = CacheAwareRouter(index)
    workers, seqs = _workers([0, 0, 0, 0], free=(100,) * 4), {}
    system = [1, 2]  # every conversation's first two blocks

    def route(blocks, session_id):
        worker = router.choose(workers, [], RouteQuery(blocks, session_id))
        # the turn runs and ends: its worker's events confirm the blocks, its next stats show it idle
        index.apply(KVBlocks(worker.worker_id, seqs.get(worker.worker_id, 0), [("stored", blocks)], "ab"))
        seqs[worker.worker_id] = seqs.get(worker.worker_id, 0) + 1
        worker.stats = WorkerStats(worker.worker_id, "aggregated", 0, 0, 100, 100, 0)
        return worker.worker_id

    first_turns = {f"chat-{c}": system + [100 * c + k for k in range(4)] for c in range(8)}
    homes = {chat: route(blocks, chat) for chat, blocks in first_turns.items()}
    assert sorted(list(homes.values()).count(w.worker_id) for w in workers) == [2, 2, 2, 2]
    assert router.num_choices["least_loaded"] == 8  # 2 of 6 blocks cached is not enough to follow
    for chat, blocks in first_turns.items():  # each follow-up (the history and a new message) sticks
        assert route(blocks + [7000, 7001], chat) == homes[chat]
    for chat, blocks in first_turns.items():  # no session named, a long new message (8 of 18 blocks cached):
        # the cached part is the whole previous prompt, so the conversation still goes home
        assert route(blocks + [7000, 7001] + list(range(8000, 8010)), None) == homes[chat]
    assert router.num_choices == {"imbalance": 0, "session": 8, "least_loaded": 8, "cache": 8}


def test_the_imbalance_guard_sends_to_the_least_loaded():
    assert not is_imbalanced([IMBALANCE_ABS, 0]) and is_imbalanced([IMBALANCE_ABS + 1, 0])
    assert not is_imbalanced([200, 150])  # far apart, but less than 1.5 x
    index = PrefixIndex()
    router = CacheAwareRouter(index)
    index.insert_speculative("w0", [1, 2])
    workers = _workers([100, 10])
    assert router.choose(workers, [], RouteQuery([1, 2], session_id="s")).worker_id == "w1"
    assert router.num_choices["imbalance"] == 1


def test_a_session_stays_on_its_worker_while_it_lives():
    index = PrefixIndex()
    router = CacheAwareRouter(index)
    workers = _workers([0, 0, 0])
    home = router.choose(workers, [], RouteQuery([5], session_id="chat-1"))  # new, nothing cached: least loaded
    holder = next(w for w in workers if w is not home)
    index.insert_speculative(holder.worker_id, [6, 7])
    assert router.choose(workers, [], RouteQuery([6, 7], session_id="chat-1")) is home
    assert router.choose(workers, [], RouteQuery([6, 7], session_id="chat-2")) is holder
    gone = [w for w in workers if w is not home]  # its worker gone: the cache decides, and the session moves
    assert router.choose(gone, [], RouteQuery([6, 7], session_id="chat-1")) is holder
    assert router.choose(workers, [], RouteQuery([6, 7], session_id="chat-1")) is holder
    assert router.num_choices == {"imbalance": 0, "session": 2, "least_loaded": 1, "cache": 2}


def test_kv_blocks_that_no_worker_could_send_are_refused():
    good = KVBlocks("w0", 0, [("stored", [1, 2**64 - 1]), ("removed", [1]), ("cleared", [])], "ab")
    assert decode_message(good.to_wire()) == good
    for bad in (KVBlocks("w0", -1, []), KVBlocks("w0", 0, [("kept", [1])]), KVBlocks("w0", 0, [("stored", [-1])]),
                KVBlocks("w0", 0, [("stored", ["x"])])):
        with pytest.raises(WireError):
            decode_message(bad.to_wire())


def _placement(model: str, router: str):
    """A real Placement of an e-p-d deployment (one prefill, two decode workers, registered as their
    Ready and stats register them), text prompts up to 32 new tokens prefilled on a decode worker."""
    from epd.config import ServeConfig
    from epd.engine.config import EngineConfig
    from epd.engine.scheduler_config import SchedulerConfig
    from epd.serve.placement import Placement
    from epd.serve.registry import WorkerRegistry
    from epd.serve.worker_metrics import WorkerMetrics
    from epd.transport.wire.messages import Ready

    config = ServeConfig(model=model, mode="e-p-d", num_decode=2, router=router,
                         engine=EngineConfig(scheduler=SchedulerConfig(max_local_prefill_tokens=32)))
    registry = WorkerRegistry()
    for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        registry.on_ready(Ready(worker_id, role, f"ipc:///tmp/x/{worker_id}.sock", "host", None, "ab"))
        registry.on_stats(WorkerStats(worker_id, role, 0, 0, 100, 100, 0, session="ab"))
    return Placement(config, None, registry, WorkerMetrics(registry), {}, "/nonexistent")


@pytest.mark.parametrize("router", ["cache_aware", "least_loaded"])
def test_e_p_d_a_chats_next_turn_is_prefilled_where_its_kv_is(tiny_model, router):
    import asyncio

    from epd.serve.preparer import Prepared

    placement = _placement(tiny_model, router)
    first = Prepared(list(range(1000, 1100)), [], [])  # 100 tokens: a prefill worker's
    placed = asyncio.run(placement.place(first, [], 0, deadline=float("inf"), session_id="chat"))
    assert placed.prefill.worker_id == "prefill-0"
    # the decode worker's events confirm it holds the prompt's 6 full blocks (its KV arrived, was cached)
    if placement.prefix_index is not None:
        query = placement._route_query(first, [], None, None)
        placement.prefix_index.apply(KVBlocks(placed.decode.worker_id, 0, [("stored", query.block_hashes)], "ab"))
    follow_up = Prepared(first.token_ids + list(range(5000, 5024)), [], [])  # 124 tokens, 28 past its blocks
    again = asyncio.run(placement.place(follow_up, [], 0, deadline=float("inf"), session_id="chat"))
    if router == "cache_aware":  # prefilled where the conversation's KV is: no prefill worker, no KV moved
        assert again.prefill is placed.decode and again.decode is None
    else:  # 124 tokens are not short: the whole prompt again on the prefill worker
        assert again.prefill.worker_id == "prefill-0"


def test_a_requests_session_is_its_x_session_id_else_its_user():
    from epd.api.generate_route import session_id
    from epd.api.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], user="alice")
    assert session_id({"headers": [(b"x-session-id", b"chat-7")]}, body) == "chat-7"
    assert session_id({"headers": []}, body) == "alice"
    assert session_id({"headers": []}, body.model_copy(update={"user": None})) is None


def test_an_adapters_blocks_never_match_the_base_models(tiny_model):
    from epd.serve.preparer import Prepared

    placement = _placement(tiny_model, "cache_aware")
    prep = Prepared(list(range(1000, 1100)), [], [])
    base = placement._route_query(prep, [], None, None).block_hashes
    adapter = placement._route_query(prep, [], "sql", None).block_hashes
    assert len(base) == len(adapter) == 6 and not set(base) & set(adapter)
    assert placement._route_query(prep, [7], None, None).block_hashes == base  # a retry: prompt + emitted
