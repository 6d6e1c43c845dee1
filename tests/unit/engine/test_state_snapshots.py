"""Prefix caching for a model with per-request state, the scheduler's side (no torch): where
snapshots are taken (a prompt's last full block, the end of a shared prefix, the latest block
boundary past the prompt), that a hit is cut back to the longest boundary with a committed
snapshot and restores it, LRU eviction, and a failed step's snapshots given back."""
from __future__ import annotations

from testkit.engine_factories import assert_all_blocks_free, fake_run, make_request, run_until_done

from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig


def _scheduler(num_state_snapshots: int = 8, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, **config), num_blocks=64, num_state_snapshots=num_state_snapshots)


def _first_step(scheduler: Scheduler, request):
    """Add `request`, run one step; (its first chunk (start, end), the step's output)."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update(out, fake_run(out))
    (s,) = [s for s in out.scheduled if s.request_id == request.request_id]
    return (s.start, s.end), out


def _assert_pool_whole(scheduler: Scheduler) -> None:
    snapshots = scheduler.block_manager.snapshots
    assert snapshots.num_free + snapshots.num_cached == snapshots.num_snapshots  # nothing pending, nothing lost


def test_an_equal_prompt_resumes_from_the_snapshot_at_its_last_full_block():
    scheduler = _scheduler()
    prompt = list(range(100, 110))  # 10 tokens: full blocks end at 4 and 8
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=prompt, request_id="a"))
    assert chunk == (0, 8) and list(out.snapshots.saves) == ["a"]  # cut at the last full block, saved there
    saved = out.snapshots.saves["a"]
    run_until_done(scheduler)
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=prompt, request_id="b"))
    assert chunk == (8, 10) and out.snapshots.restores == {"b": saved}
    assert scheduler.get_request("b").num_cached_tokens == 8
    assert scheduler.block_manager.prefix_cache_hits == 8  # the counters count what was skipped
    run_until_done(scheduler)
    assert_all_blocks_free(scheduler)
    _assert_pool_whole(scheduler)


def test_a_hit_past_the_last_snapshot_is_cut_back_and_a_shared_prefix_is_snapshotted_where_it_ends():
    scheduler = _scheduler(max_num_batched_tokens=64)
    shared = list(range(100, 109))  # a system prompt: two full blocks and one token
    chunk, _ = _first_step(scheduler, make_request(prompt_token_ids=shared + [1, 2, 3, 4, 5], request_id="a"))
    assert chunk == (0, 12)  # its own last full block, past the shared part
    run_until_done(scheduler)
    # "b" shares blocks [0, 8) with "a", whose state no snapshot holds there: no hit, a snapshot at 8
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=shared + [6, 7, 8, 9, 10], request_id="b"))
    assert chunk == (0, 8) and "b" in out.snapshots.saves and not out.snapshots.restores
    saved = out.snapshots.saves["b"]
    run_until_done(scheduler)
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=shared + [11, 12, 13, 14], request_id="c"))
    assert chunk == (8, 12) and out.snapshots.restores == {"c": saved}
    run_until_done(scheduler)
    assert scheduler.block_manager.prefix_cache_hits == 8
    _assert_pool_whole(scheduler)


def test_the_next_turn_resumes_from_the_latest_snapshot_past_the_prompt():
    scheduler = _scheduler()
    turn1 = make_request(prompt_token_ids=list(range(100, 106)), request_id="t1", max_tokens=9)
    scheduler.add_request(turn1)
    saved_past_prompt = []
    for out in run_until_done(scheduler):
        saved_past_prompt += [s.end for s in out.scheduled if s.request_id in out.snapshots.saves and s.end >= 6]
    assert saved_past_prompt == [8, 12]  # computed up to 14 (the last token is sampled, never run)
    assert scheduler.block_manager.snapshots.num_cached == 2  # the prompt's at 4, the latest at 12 (8's replaced)
    turn2 = turn1.all_token_ids + [7, 8, 9]  # the answer and a new user message
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=turn2, request_id="t2"))
    assert chunk[0] == 12 and "t2" in out.snapshots.restores
    run_until_done(scheduler)
    _assert_pool_whole(scheduler)


def test_snapshots_are_evicted_least_recently_used():
    scheduler = _scheduler(num_state_snapshots=1)
    first, second = list(range(100, 110)), list(range(200, 210))
    for rid, prompt in (("a", first), ("b", second)):  # "b"'s snapshot at 8 takes the only index
        scheduler.add_request(make_request(prompt_token_ids=prompt, request_id=rid, max_tokens=1))
        run_until_done(scheduler)
    chunk, _ = _first_step(scheduler, make_request(prompt_token_ids=first, request_id="a2", max_tokens=1))
    assert chunk == (0, 8)  # its KV blocks are cached, its state's snapshot was evicted: computed again
    run_until_done(scheduler)
    _assert_pool_whole(scheduler)


def test_the_snapshots_of_a_step_that_failed_go_back_unwritten():
    scheduler = _scheduler(num_state_snapshots=2)
    first = list(range(100, 110))
    scheduler.add_request(make_request(prompt_token_ids=first, request_id="a", max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(make_request(prompt_token_ids=list(range(300, 310)), request_id="x", max_tokens=1))
    out = scheduler.schedule()  # the step fails: no update, its snapshot never written
    assert "x" in out.snapshots.saves
    scheduler.abort(["x"])
    scheduler.schedule()
    _assert_pool_whole(scheduler)
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=first, request_id="a3", max_tokens=1))
    assert chunk == (8, 10) and "a3" in out.snapshots.restores  # "a2"'s snapshot, not the failed one


def test_without_snapshots_nothing_is_cut_or_copied():
    scheduler = _scheduler(num_state_snapshots=0)
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=list(range(100, 110))))
    assert chunk == (0, 10) and not out.snapshots.saves and scheduler.block_manager.snapshots is None


def test_a_reset_prefix_cache_forgets_the_snapshots():
    scheduler = _scheduler()
    prompt = list(range(100, 110))
    scheduler.add_request(make_request(prompt_token_ids=prompt, request_id="a"))
    run_until_done(scheduler)
    scheduler.block_manager.reset_prefix_cache()
    assert scheduler.block_manager.snapshots.num_cached == 0
    chunk, out = _first_step(scheduler, make_request(prompt_token_ids=prompt, request_id="b"))
    assert chunk == (0, 8) and not out.snapshots.restores
    run_until_done(scheduler)
    _assert_pool_whole(scheduler)
