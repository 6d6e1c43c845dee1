"""BlockManager: allocation, ref counts, prefix caching, LRU eviction."""
from __future__ import annotations

import subprocess
import sys

from epd.engine.block_hash import hash_block
from epd.engine.block_manager import BlockManager
from epd.transport.wire.mm_span import MMSpan

from testkit.engine_factories import make_image_prompt, make_request


def computed(manager: BlockManager, request, num_tokens: int) -> None:
    """Pretend the model computed `num_tokens` tokens of `request`."""
    request.num_computed_tokens = num_tokens
    manager.cache_blocks(request)


def first_allocate(manager: BlockManager, request) -> int:
    """Admit like the scheduler: prefix lookup, allocate the rest, compute it all."""
    block_ids, num_cached_tokens = manager.get_computed_blocks(request)
    assert manager.allocate(request, request.num_tokens - num_cached_tokens, block_ids)
    computed(manager, request, request.num_tokens)
    return num_cached_tokens


def assert_all_free(manager: BlockManager) -> None:
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def test_allocate_and_free_track_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(10)
    assert manager.allocate(request, 10, [])
    assert len(request.block_ids) == 3  # ceil(10 / 4)
    assert len(set(request.block_ids)) == 3
    assert [manager.ref_count(b) for b in request.block_ids] == [1, 1, 1]
    assert manager.num_free_blocks == 5
    assert manager.usage == 3 / 8

    manager.free(request)
    assert request.block_ids == []
    manager.free(request)  # idempotent
    assert_all_free(manager)
    assert manager.usage == 0.0


def test_allocate_grows_from_num_computed_tokens():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request(4)
    assert manager.allocate(request, 4, [])
    computed(manager, request, 4)
    request.output_token_ids.append(7)
    assert manager.allocate(request, 1)  # token 5 needs a second block
    assert len(request.block_ids) == 2
    computed(manager, request, 5)
    request.output_token_ids.append(8)
    assert manager.allocate(request, 1)  # token 6 fits in block 2
    assert len(request.block_ids) == 2
    manager.free(request)
    assert_all_free(manager)


def test_failed_allocation_changes_nothing():
    manager = BlockManager(num_blocks=2, block_size=4)
    request = make_request(9)
    assert not manager.can_allocate(request, 9, [])
    assert not manager.allocate(request, 9, [])
    assert request.block_ids == []
    assert manager.num_free_blocks == 2
    assert manager.prefix_cache_queries == 0
    assert manager.allocate(request, 8, [])  # a chunk that fits
    assert manager.num_free_blocks == 0
    manager.free(request)
    assert_all_free(manager)


def test_repeated_prefix_shares_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_request(prompt_token_ids=list(range(100, 110)))
    assert first_allocate(manager, first) == 0
    second = make_request(prompt_token_ids=list(range(100, 108)) + [1, 2, 3])

    block_ids, num_cached_tokens = manager.get_computed_blocks(second)
    assert block_ids == first.block_ids[:2]
    assert num_cached_tokens == 8
    assert manager.allocate(second, second.num_tokens - 8, block_ids)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert [manager.ref_count(b) for b in second.block_ids] == [2, 2, 1]
    assert manager.prefix_cache_queries == 10 + 11
    assert manager.prefix_cache_hits == 8

    manager.free(first)
    assert [manager.ref_count(b) for b in second.block_ids] == [1, 1, 1]
    manager.free(second)
    assert_all_free(manager)


def test_only_full_computed_blocks_are_cached():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_request(prompt_token_ids=list(range(100, 110)))
    assert manager.allocate(first, 10, [])
    same = make_request(prompt_token_ids=list(range(100, 110)))
    assert manager.get_computed_blocks(same) == ([], 0)  # allocated, not computed yet
    computed(manager, first, 6)  # one full block + half of the second
    assert manager.get_computed_blocks(same) == (first.block_ids[:1], 4)
    computed(manager, first, 10)
    assert manager.get_computed_blocks(same) == (first.block_ids[:2], 8)
    manager.free(first)
    manager.free(same)
    assert_all_free(manager)


def test_prefix_lookup_leaves_at_least_one_token_to_compute():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_request(8)
    first_allocate(manager, first)
    twin = make_request(8)  # identical 8 tokens = exactly two full blocks
    block_ids, num_cached_tokens = manager.get_computed_blocks(twin)
    assert num_cached_tokens == 4  # not 8: the last block is recomputed to sample
    assert block_ids == first.block_ids[:1]
    manager.free(first)
    assert_all_free(manager)


def test_same_tokens_different_image_never_match():
    manager = BlockManager(num_blocks=16, block_size=4)
    token_ids, cat = make_image_prompt(2, 9, 3, mm_hash="cat")
    _, dog = make_image_prompt(2, 9, 3, mm_hash="dog")
    first = make_request(prompt_token_ids=token_ids, mm_spans=[cat])
    first_allocate(manager, first)

    other_image = make_request(prompt_token_ids=token_ids, mm_spans=[dog])
    assert other_image.prompt_token_ids == first.prompt_token_ids
    assert manager.get_computed_blocks(other_image) == ([], 0)
    same_image = make_request(prompt_token_ids=token_ids, mm_spans=[cat])
    assert manager.get_computed_blocks(same_image) == (first.block_ids[:3], 12)
    manager.free(first)
    assert_all_free(manager)


def test_block_hash_is_stable_and_covers_image_overlap():
    span = MMSpan(offset=2, length=8, mm_hash="cat", meta={"grid_thw": (1, 4, 8)})
    token_ids = [5, 5, 9, 9]
    digest = hash_block(b"", token_ids, 0, [span])
    assert digest == hash_block(b"", list(token_ids), 0, [span])  # not salted per process
    assert len(digest) == 32
    assert digest != hash_block(b"", token_ids, 0, [])
    assert digest != hash_block(b"x", token_ids, 0, [span])  # chained on the parent
    # Same tokens and image, but the block sees other placeholder rows.
    shifted = MMSpan(offset=1, length=8, mm_hash="cat", meta={"grid_thw": (1, 4, 8)})
    assert digest != hash_block(b"", token_ids, 0, [shifted])
    # Same tokens and image at the same place, but another run of it: other rows of its entry.
    later_run = MMSpan(offset=2, length=8, mm_hash="cat", meta={"grid_thw": (1, 4, 8)}, first_row=8)
    assert digest != hash_block(b"", token_ids, 0, [later_run])


def test_cached_free_blocks_are_evicted_least_recently_used():
    manager = BlockManager(num_blocks=4, block_size=4)
    prompts = {name: [base + i for i in range(5)] for name, base in
               (("a", 100), ("b", 200), ("c", 300))}
    for name in ("a", "b", "c"):  # each leaves one cached full block
        request = make_request(prompt_token_ids=prompts[name])
        first_allocate(manager, request)
        manager.free(request)
    assert_all_free(manager)

    # A hit on "a" makes it the most recently used; "b" is now the oldest.
    again = make_request(prompt_token_ids=prompts["a"])
    assert first_allocate(manager, again) == 4
    manager.free(again)

    # Three fresh blocks: the one never-hashed block first, then LRU "b", "c".
    big = make_request(prompt_token_ids=list(range(900, 912)))
    assert first_allocate(manager, big) == 0
    manager.free(big)
    hits = {name: manager.get_computed_blocks(make_request(prompt_token_ids=p))[1]
            for name, p in prompts.items()}
    assert hits == {"a": 4, "b": 0, "c": 0}
    assert_all_free(manager)


def test_prefix_hit_on_cached_free_block_counts_against_free_pool():
    manager = BlockManager(num_blocks=2, block_size=4)
    first = make_request(prompt_token_ids=list(range(100, 105)))
    first_allocate(manager, first)
    manager.free(first)
    second = make_request(prompt_token_ids=list(range(100, 112)))  # needs 3 blocks
    block_ids, num_cached_tokens = manager.get_computed_blocks(second)
    assert num_cached_tokens == 4
    # The hit reuses one block, but the two missing ones cannot come from a pool of 1.
    assert not manager.allocate(second, 8, block_ids)
    assert second.block_ids == [] and manager.num_free_blocks == 2
    assert manager.allocate(second, 4, block_ids)
    assert manager.num_free_blocks == 0
    manager.free(second)
    assert_all_free(manager)


def test_reset_and_disabled_prefix_cache_give_no_hits():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_request(9)
    first_allocate(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request(9))[1] == 8
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request(9)) == ([], 0)
    assert_all_free(manager)

    disabled = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    for _ in range(2):
        request = make_request(9)
        assert first_allocate(disabled, request) == 0
        disabled.free(request)
    assert disabled.prefix_cache_queries == 0 and disabled.prefix_cache_hits == 0
    assert_all_free(disabled)


def test_scheduler_and_block_manager_do_not_import_torch():
    code = ("import sys, epd.engine.block_manager, epd.engine.scheduler, epd.engine.scheduler_output; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
