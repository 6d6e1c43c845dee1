"""Builders and a fake model for fast scheduler / block-manager tests."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from epd.engine.request import Request
from epd.transport.wire.mm_span import MMSpan
from epd.transport.wire.sampling import SamplingParams
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_config import SchedulerConfig
from epd.engine.scheduler_output import SchedulerOutput
from epd.engine.spec.decode import accept_greedy

ENTRY = object()  # an image's encoder output: opaque to the scheduler and the image ledger
IMAGE_PAD_ID = 151655  # Qwen's <|image_pad|>: every image's placeholders share it
EOS_ID = 2

_request_ids = itertools.count()


def make_request(num_prompt_tokens: int = 8, *, request_id: str | None = None,
                 prompt_token_ids: Sequence[int] | None = None,
                 mm_spans: Sequence[MMSpan] = (), eos_token_ids: Sequence[int] = (),
                 max_tokens: int | None = 4, **sampling: object) -> Request:
    """A request; by default a prompt of distinct ids 1000.. (never EOS)."""
    if prompt_token_ids is None:
        prompt_token_ids = list(range(1000, 1000 + num_prompt_tokens))
    for span in mm_spans:
        assert all(t == IMAGE_PAD_ID for t in prompt_token_ids[span.offset:span.end]), \
            "mm span must cover placeholder tokens"
    return Request(
        request_id=request_id or f"req-{next(_request_ids)}",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),
        mm_spans=list(mm_spans),
        eos_token_ids=tuple(eos_token_ids))


def make_image_prompt(num_text_before: int, num_image_tokens: int, num_text_after: int,
                      mm_hash: str) -> tuple[list[int], MMSpan]:
    """Prompt token ids text + placeholders + text, and the image's span."""
    token_ids = (list(range(1, num_text_before + 1)) + [IMAGE_PAD_ID] * num_image_tokens
                 + list(range(500, 500 + num_text_after)))
    span = MMSpan(offset=num_text_before, length=num_image_tokens, mm_hash=mm_hash,
                  meta={"grid_thw": (1, 2, 2 * num_image_tokens)})
    return token_ids, span


def make_scheduler(num_blocks: int = 64, *, block_size: int = 4, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                   max_model_len: int | None = None, role: str = "pd",
                   **config: object) -> Scheduler:
    """A scheduler with small blocks, so test prompts stay short; `config`:
    other SchedulerConfig fields (prefill_priority, ...)."""
    config = SchedulerConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching,
                             max_model_len=max_model_len, **config)
    return Scheduler(config, num_blocks=num_blocks, role=role)


def add_request(scheduler: Scheduler, request: Request, pending: Sequence[str] = ()) -> None:
    """As `EngineCore.add_request`: queue `request` and enter its images in the
    scheduler's ledger, those in `pending` still to come, the others here."""
    scheduler.add_request(request)
    scheduler.images.add(request, {h: ENTRY for h in request.mm_hashes if h not in pending}, pending)


def expected_outputs(num_prompt_tokens: int, num_output_tokens: int) -> list[int]:
    """What `fake_token` samples for a request run without interruption."""
    return [10_000 + num_prompt_tokens + i for i in range(num_output_tokens)]


def fake_token(request: Request) -> int:
    """Deterministic "model": the next token depends only on the token count,
    so a recomputed (preempted) request samples exactly what it would have."""
    return 10_000 + request.num_tokens


def fake_run(output: SchedulerOutput,
             model: Callable[[Request], int] = fake_token) -> dict[str, int | list[int]]:
    """Sample one token for every chunk that ends at its request's last token; a
    chunk with a draft gets what greedy verification keeps: the draft's prefix
    that `model` would have produced one token at a time, and the next token."""
    out: dict[str, int | list[int]] = {}
    for s in output.scheduled:
        if s.is_last_chunk and s.draft_token_ids:
            draft = list(s.draft_token_ids)
            targets = [model(dataclasses.replace(s.request, output_token_ids=s.request.output_token_ids + draft[:i]))
                       for i in range(len(draft) + 1)]
            out[s.request_id] = accept_greedy(targets, draft)
        elif s.is_last_chunk:
            out[s.request_id] = model(s.request)
    return out


def run_until_done(scheduler: Scheduler, max_steps: int = 1000,
                   model: Callable[[Request], int] = fake_token) -> list[SchedulerOutput]:
    """Step schedule -> fake model -> update until nothing is left; returns the outputs."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs
        output = scheduler.schedule()
        outputs.append(output)
        scheduler.update(output, fake_run(output, model))
    raise AssertionError(f"not done after {max_steps} steps")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def image_request(mm_hashes: Sequence[str], num_image_tokens: int = 4, num_text: int = 2, **kwargs) -> Request:
    """`num_text` text tokens, then each image's placeholders followed by two text tokens."""
    token_ids, spans = list(range(1, num_text + 1)), []
    for mm_hash in mm_hashes:
        spans.append(MMSpan(len(token_ids), num_image_tokens, mm_hash, {"grid_thw": (1, 2, 2 * num_image_tokens)}))
        token_ids += [IMAGE_PAD_ID] * num_image_tokens + [500, 501]
    return make_request(prompt_token_ids=token_ids, mm_spans=spans, **kwargs)


def step(scheduler: Scheduler):
    """One schedule + fake run + update: (the step's output, what update returned)."""
    output = scheduler.schedule()
    return output, scheduler.update(output, fake_run(output))


def cpu_llm(model_dir: str, **settings):
    """The offline `LLM` on the CPU in float32 with 128 KV blocks (`settings` override),
    as the speculative-decoding tests build each engine they compare."""
    from epd import LLM

    return LLM(model_dir, **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 128, **settings})
