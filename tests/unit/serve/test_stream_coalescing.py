"""Outputs that accumulate while a stream's reader is behind leave as one Delta.

A real `Orchestrator` (tiny checkpoint's tokenizer, its real collector
socket); the test plays one aggregated worker over real ZeroMQ sockets: it
registers with `Ready`, takes the PrefillRequest and answers with one
TokenOutput per token, as engine workers do.
"""
from __future__ import annotations

import asyncio
import socket
import time

from epd.api.protocol import GenerateRequest
from epd.config import ServeConfig
from epd.detokenizer import IncrementalDetokenizer
from epd.serve.orchestrator import Orchestrator
from epd.transport.wire.channels import Receiver, Sender
from epd.transport.wire.messages import PrefillRequest, Ready, TokenOutput
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs

TOKENS = [300 + 7 * i for i in range(20)]  # 20 output tokens, clear of the special ones


async def _until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _run(tiny_model: str, tmp_path, sampling: SamplingParams, tokens: list[int]) -> tuple[list, str]:
    """Streams one completion whose outputs after the first all arrive before the
    reader looks again; returns its Deltas and the prompt's token ids."""
    collector = f"ipc://{tmp_path}/api.sock"
    orch = Orchestrator(ServeConfig(model=tiny_model, mode="aggregated"), collector, str(tmp_path / "cache"))
    await orch.start()
    inbox = Receiver(f"ipc://{tmp_path}/aggregated-0.sock")
    to_api = Sender(collector)
    try:
        to_api.send(Ready("aggregated-0", "aggregated", inbox.address, socket.gethostname(), None))
        await orch.wait_for_workers(1, timeout_s=20)
        prompt = [400, 401, 402]
        stream = orch.generate(GenerateRequest("cmpl-1", None, prompt, sampling))
        first = asyncio.ensure_future(anext(stream))
        await _until(lambda: inbox.poll(0))
        request = inbox.recv()
        assert isinstance(request, PrefillRequest) and request.request_id == "cmpl-1"
        def send(i: int) -> None:
            logprobs = [TokenLogprobs(tokens[i], -0.5 - i, 1, [])] if sampling.logprobs is not None else None
            last = i + 1 == len(tokens)
            to_api.send(TokenOutput("cmpl-1", [tokens[i]], finished=last, finish_reason="length" if last else None,
                                    num_prompt_tokens=len(prompt), logprobs=logprobs, index=i))

        send(0)
        deltas = [await first]
        for i in range(1, len(tokens)):  # one message per token, all at once
            send(i)
        # everything after the first token is queued for the reader before it reads again
        await _until(lambda: orch.attempts["cmpl-1"].queue.qsize() == len(tokens) - 1)
        deltas += [d async for d in stream]
        return deltas, prompt
    finally:
        await orch.stop()
        inbox.close()
        to_api.close()


def test_accumulated_outputs_leave_as_one_delta_with_the_same_text_tokens_and_logprobs(tiny_model, tmp_path):
    sampling = SamplingParams(temperature=0, max_tokens=len(TOKENS), logprobs=0)
    deltas, prompt = asyncio.run(_run(tiny_model, tmp_path, sampling, TOKENS))
    assert [len(d.token_ids) for d in deltas] == [1, len(TOKENS) - 1]  # not one Delta per token
    assert [t for d in deltas for t in d.token_ids] == TOKENS
    assert [e.token_id for d in deltas for e in d.logprobs] == TOKENS  # one entry per token, in order
    assert [e.logprob for d in deltas for e in d.logprobs] == [-0.5 - i for i in range(len(TOKENS))]
    assert [d.finish_reason for d in deltas] == [None, "length"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    one_by_one = IncrementalDetokenizer(tokenizer, prompt)
    expected = "".join(one_by_one.push([t]) for t in TOKENS) + one_by_one.finish()
    assert "".join(d.text for d in deltas) == expected
    assert expected  # the tokens make text


def test_a_stop_string_inside_accumulated_outputs_ends_the_text_there(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    full = tokenizer.decode(TOKENS, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a stop string in the middle of the accumulated text
    assert stop.strip() and full.index(stop) > 0
    sampling = SamplingParams(temperature=0, max_tokens=len(TOKENS), stop=[stop])
    deltas, _ = asyncio.run(_run(tiny_model, tmp_path, sampling, TOKENS))
    assert len(deltas) == 2 and deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == full[:full.index(stop)]
    assert len(deltas[-1].token_ids) < len(TOKENS) - 1  # the tokens after the stop are not taken

