"""The scheduler and block manager with adapters (issue 28), on fake requests
(milliseconds): at most `max_loras` distinct adapters run at once, and a
block computed under one adapter (or none) is never a prefix hit for another."""
from __future__ import annotations

from testkit.engine_factories import assert_all_blocks_free, make_request, run_until_done

from epd.engine.block_manager import BlockManager
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from epd.transport.wire.lora_request import LoRARequest

SQL, CHAT = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")


def with_lora(request, lora):
    request.lora_request = lora
    return request


def test_at_most_max_loras_adapters_run_at_once():
    scheduler = Scheduler(SchedulerConfig(block_size=4), num_blocks=64, max_loras=1)
    requests = [with_lora(make_request(8, max_tokens=3), lora) for lora in (SQL, CHAT, None, SQL)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_until_done(scheduler)
    first = {s.request_id for s in outputs[0].scheduled}
    assert first == {requests[0].request_id, requests[2].request_id, requests[3].request_id}  # chat waits
    for out in outputs:
        assert len({s.request.lora_key for s in out.scheduled} - {None}) <= 1
    assert all(r.is_finished for r in requests)
    assert_all_blocks_free(scheduler)


def test_a_decode_worker_takes_a_second_adapter_only_when_the_first_has_left():
    scheduler = Scheduler(SchedulerConfig(block_size=4), num_blocks=64, role="decode", max_loras=1)
    first = with_lora(make_request(8, max_tokens=3), SQL)
    first.output_token_ids.append(7)
    assert scheduler.add_prefilled(first) is not None
    second = with_lora(make_request(8, max_tokens=3), CHAT)
    second.output_token_ids.append(7)
    assert scheduler.add_prefilled(second) is None  # no room for a second adapter: retried later
    run_until_done(scheduler)
    assert scheduler.add_prefilled(second) is not None


def test_blocks_are_shared_within_an_adapter_only():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # three full blocks

    def computed(lora) -> int:
        request = with_lora(make_request(prompt_token_ids=prompt), lora)
        block_ids, num_cached = manager.get_computed_blocks(request)
        manager.allocate(request, request.num_tokens - num_cached, block_ids)
        request.num_computed_tokens = request.num_tokens
        manager.cache_blocks(request)
        manager.free(request)
        return num_cached

    assert [computed(lora) for lora in (None, SQL, CHAT, None, SQL, CHAT)] == [0, 0, 0, 12, 12, 12]
    # the same name at another path is another adapter
    assert computed(LoRARequest("sql", 1, "/b/sql")) == 0


def test_an_adapter_read_again_with_new_files_misses_its_old_blocks():
    # the scheduler keys a request's KV by the weights the worker read when it starts
    # (`adapter_weights`, the digest of the files): after a retraining in place, the old blocks miss
    read = {SQL: "digest-1"}
    scheduler = Scheduler(SchedulerConfig(block_size=4), num_blocks=64, max_loras=1, adapter_weights=read.get)

    def run(lora) -> int:
        request = with_lora(make_request(prompt_token_ids=list(range(100, 113)), max_tokens=1), lora)
        scheduler.add_request(request)
        run_until_done(scheduler)
        return request.num_cached_tokens

    assert [run(SQL), run(SQL)] == [0, 12]
    waiting = with_lora(make_request(8), CHAT)  # not read: it waits, the others run
    scheduler.add_request(waiting)
    scheduler.schedule()
    assert waiting in scheduler.waiting and waiting.lora_weights is None
    read[CHAT] = "digest-c"
    read[SQL] = "digest-2"  # read again, other files
    assert [run(SQL), run(SQL)] == [0, 12]
    assert waiting.is_finished and waiting.lora_key == ("chat", "/a/chat", "digest-c")
    assert_all_blocks_free(scheduler)


def test_an_adapter_without_language_model_weights_runs_on_the_base_beside_another():
    # a tower-only adapter reads as "" (LoRAManager.weights_of): no slot among max_loras, the base's KV
    vit = LoRARequest("vit", 3, "/a/vit")
    scheduler = Scheduler(SchedulerConfig(block_size=4), num_blocks=64, max_loras=1,
                          adapter_weights={SQL: "digest-s", vit: ""}.get)
    base = make_request(prompt_token_ids=list(range(100, 113)), max_tokens=1)
    scheduler.add_request(base)
    run_until_done(scheduler)
    requests = [with_lora(make_request(8, max_tokens=3), SQL),
                with_lora(make_request(prompt_token_ids=list(range(100, 113)), max_tokens=3), vit)]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert {s.request_id for s in first.scheduled} == {r.request_id for r in requests}
    assert requests[1].lora_key is None and requests[1].num_cached_tokens == 12  # the base's blocks
