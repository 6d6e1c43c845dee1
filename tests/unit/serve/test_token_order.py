"""The API puts a request's token deltas back in output order: the prefill
worker's first token and the decode worker's next ones travel on two pipes,
and under load a later delta arrives first (seen in the 200-request test)."""
from __future__ import annotations

import asyncio

from epd.serve.token_order import TokenOrder
from epd.transport.wire.messages import TokenOutput


def _drain(arrivals: list[TokenOutput], count: int) -> list[TokenOutput]:
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for out in arrivals:
            queue.put_nowait(out)
        order = TokenOrder(queue)
        return [await asyncio.wait_for(order.next(), 1) for _ in range(count)]
    return asyncio.run(run())


def test_a_delta_that_overtook_the_first_token_waits_for_it():
    first = TokenOutput("r", [11], index=0)
    second = TokenOutput("r", [12, 13], index=1)
    last = TokenOutput("r", [14], finished=True, finish_reason="length", index=3)
    assert _drain([second, last, first], 3) == [first, second, last]
    assert _drain([first, second, last], 3) == [first, second, last]


def test_an_error_is_passed_on_at_once():
    error = TokenOutput("r", [], finished=True, finish_reason="error", error="could not be encoded")
    assert _drain([TokenOutput("r", [12], index=1), error], 1) == [error]


def test_an_event_that_is_no_token_output_passes_at_once():
    event = object()  # e.g. the orchestrator's "worker lost"
    assert _drain([TokenOutput("r", [7], index=1), event], 1) == [event]  # token 7 waits for index 0


def test_an_event_met_while_taking_accumulated_tokens_is_handed_out_next():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        event = object()  # e.g. a worker lost, queued after two tokens
        error = TokenOutput("r", [], finished=True, finish_reason="error", error="failed")
        for out in (TokenOutput("r", [5], index=0), TokenOutput("r", [6], index=1), event, error):
            queue.put_nowait(out)
        order = TokenOrder(queue)
        taken = [await order.next(), order.next_tokens_nowait()]
        assert [t.token_ids for t in taken] == [[5], [6]]
        assert order.next_tokens_nowait() is None  # the event is kept, not taken as tokens
        assert await asyncio.wait_for(order.next(), 1) is event
        assert order.next_tokens_nowait() is None and await asyncio.wait_for(order.next(), 1) is error
        assert order.next_tokens_nowait() is None  # nothing more here
    asyncio.run(run())
