"""The multi-turn workload of `epd bench serve` (`--dataset multi-turn`): conversations
whose every turn resends the whole history, as a chat client does.

Named after vLLM's multi-turn benchmark (benchmarks/multi_turn: `num_conversations`,
`num_turns`, `--max-active-conversations`, the conversation id sent with each request):

* `--num-conversations` conversations of `--num-turns` turns. Turn t's request is the
  optional shared system prompt (`--system-prompt-len` tokens, the same for every
  conversation), then turns 1..t-1 as they went (each user message, images included,
  and the assistant's actual answer), then turn t's new user message of `--input-len`
  tokens; `--output-len` tokens are asked for each answer.
* Images: `--images-per-request` images in the first user message, each of a size of
  `--image-size`; with `--images-every-turn` every later user message brings as many new
  ones. Every later turn resends them all (the history does).
* A conversation's turns go one after another, the next sent when the answer is in.
  Conversations start on the `--request-rate` schedule (conversations/s, Poisson or
  gamma by `--burstiness`); `--max-concurrency` (alias `--max-active-conversations`)
  caps the conversations under way, so also the requests in flight.
* Every request carries its conversation's id as `user` and in an `x-session-id`
  header: what a session-affine or cache-aware router keys on.
* A turn whose request failed ends its conversation: its later turns are recorded as
  failed (never sent), so the result still has conversations x turns entries.

The result adds `ttft_by_turn` (completed count, mean and the `--percentiles` of TTFT
per turn index) and the per-request `conversation_ids` and `turn_indices`; the
prefix-cache hit rate is read from the server's /metrics (bench/prefix_cache_metrics.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, replace
from typing import Sequence

from epd.bench.client import RequestResult, user_message
from epd.bench.datasets import BenchRequest, data_url, make_image_bytes, random_prompt
from epd.bench.load import ProgressBar, SendFn
from epd.bench.metrics import percentile_key, summarize
from epd.bench.report import MULTI_TURN_FIELDS

NOT_SENT = "not sent: an earlier turn of its conversation failed"


@dataclass(frozen=True)
class Conversation:
    """One conversation before it is run: its id, the system prompt (None: none) and each
    turn's new user message (text, images, answer length); the history comes at run time."""

    conversation_id: str
    system_prompt: str | None
    turns: tuple[BenchRequest, ...]


def sample_conversations(num_conversations: int, num_turns: int, input_len: int, output_len: int, *,
                         system_prompt_len: int = 0, images_per_request: int = 0, images_every_turn: bool = False,
                         image_sizes: Sequence[tuple[int, int]] = ((1024, 1024),), image_format: str = "jpeg",
                         seed: int = 0, tokenizer=None) -> list[Conversation]:
    """The conversations of the workload, seeded: the same arguments give the same texts and image bytes."""
    for name, value, least in (("--num-conversations", num_conversations, 1), ("--num-turns", num_turns, 1),
                               ("--input-len", input_len, 1), ("--output-len", output_len, 1),
                               ("--system-prompt-len", system_prompt_len, 0),
                               ("--images-per-request", images_per_request, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if any(len(size) != 2 for size in image_sizes):
        raise ValueError("the multi-turn dataset sends images: give --image-size WxH (no video buckets)")
    if image_format not in ("jpeg", "png"):
        raise ValueError(f"image format must be jpeg or png, got {image_format!r}")
    system = (random_prompt(random.Random(f"system-{seed}"), system_prompt_len, tokenizer)
              if system_prompt_len else None)
    rng = random.Random(seed)
    conversations = []
    for c in range(num_conversations):
        turns = []
        for t in range(num_turns):
            num_images = images_per_request if t == 0 or images_every_turn else 0
            urls = []
            for i in range(num_images):
                w, h = rng.choice(list(image_sizes))
                image = make_image_bytes(w, h, seed=[seed, 2, c, t, i], fmt=image_format)  # apart from random-mm's
                urls.append(data_url(image, f"image/{image_format}"))
            turns.append(BenchRequest(random_prompt(rng, input_len, tokenizer), output_len, tuple(urls)))
        conversations.append(Conversation(f"conversation-{seed}-{c}", system, tuple(turns)))
    return conversations


@dataclass
class TurnResult:
    """What one turn's request sent and what came back."""

    conversation_id: str
    turn_index: int  # 1 for the first turn
    request: BenchRequest  # with its history and session id
    result: RequestResult


async def run_conversation(conversation: Conversation, send: SendFn, run_start_s: float) -> list[TurnResult]:
    """Every turn of `conversation` in order, each resending the history with the answers received."""
    history: list[dict] = [{"role": "system", "content": conversation.system_prompt}] \
        if conversation.system_prompt is not None else []
    out: list[TurnResult] = []
    for t, turn in enumerate(conversation.turns, start=1):
        request = replace(turn, history=tuple(history), session_id=conversation.conversation_id)
        if out and not out[-1].result.success:  # no answer to resend: the conversation ends here
            result = RequestResult(num_images=request.num_images, error=NOT_SENT)
        else:
            result = await send(request, run_start_s)
        out.append(TurnResult(conversation.conversation_id, t, request, result))
        history += [user_message(turn), {"role": "assistant", "content": result.generated_text}]
    return out


async def run_conversations(conversations: Sequence[Conversation], start_times_s: Sequence[float], send: SendFn,
                            *, max_concurrency: int | None = None,
                            progress: bool = True) -> tuple[list[TurnResult], float]:
    """Start each conversation at its time (at most `max_concurrency` under way) and run its turns;
    the turns' results in conversation order, then turn order, and the run's duration in seconds."""
    if len(conversations) != len(start_times_s):
        raise ValueError(f"{len(conversations)} conversations but {len(start_times_s)} start times")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = ProgressBar(sum(len(c.turns) for c in conversations)) if progress else None
    start = time.perf_counter()

    async def counted(request: BenchRequest, run_start_s: float) -> RequestResult:
        result = await send(request, run_start_s)
        if bar is not None:
            bar.advance()
        return result

    async def one(conversation: Conversation) -> list[TurnResult]:
        async with slots:
            return await run_conversation(conversation, counted, start)

    tasks = []
    for conversation, at_s in zip(conversations, start_times_s):
        delay_s = start + at_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(conversation)))
    turns = [turn for done in await asyncio.gather(*tasks) for turn in done]
    duration_s = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return turns, duration_s


def ttft_by_turn(turns: Sequence[TurnResult], percentiles: Sequence[float]) -> list[dict]:
    """Per turn index: completed requests, mean / median / `percentiles` of their TTFT (ms)."""
    rows = []
    for t in sorted({turn.turn_index for turn in turns}):
        done = [turn.result.ttft_s * 1e3 for turn in turns if turn.turn_index == t and turn.result.success]
        stats = summarize(done, "ttft", percentiles)
        rows.append({"turn": t, "completed": len(done), "mean_ttft_ms": stats["mean_ttft_ms"],
                     "median_ttft_ms": stats["median_ttft_ms"],
                     **{f"{percentile_key(q)}_ttft_ms": stats[f"{percentile_key(q)}_ttft_ms"] for q in percentiles}})
    return rows


def detailed_fields(turns: Sequence[TurnResult]) -> dict[str, list]:
    """The per-request arrays that say which conversation and turn each request was."""
    conversation_ids, turn_indices = MULTI_TURN_FIELDS
    return {conversation_ids: [turn.conversation_id for turn in turns],
            turn_indices: [turn.turn_index for turn in turns]}


def add_arguments(p) -> None:
    """The multi-turn dataset's own flags (its lengths, images, rate and cap are serve's)."""
    g = p.add_argument_group("--dataset multi-turn")
    g.add_argument("--num-conversations", type=int, default=16, help="conversations (vLLM's num_conversations)")
    g.add_argument("--num-turns", type=int, default=4,
                   help="turns a conversation (vLLM's num_turns); each resends the history")
    g.add_argument("--system-prompt-len", type=int, default=0,
                   help="tokens of one system prompt every conversation opens with (default: none)")
    g.add_argument("--images-every-turn", action="store_true",
                   help="new --images-per-request images in every user message, not only the first")


def build_conversations(args, tokenizer) -> list[Conversation]:
    """The conversations `args` describe (serve's `--input-len`, `--output-len`, `--images-per-request`,
    `--image-size`, `--image-format`, `--seed` and the flags above)."""
    return sample_conversations(
        args.num_conversations, args.num_turns, args.input_len, args.output_len,
        system_prompt_len=args.system_prompt_len, images_per_request=args.images_per_request,
        images_every_turn=args.images_every_turn, image_sizes=args.image_size, image_format=args.image_format,
        seed=args.seed, tokenizer=tokenizer)


def header_fields(args) -> dict:
    """The workload's description in the result JSON."""
    return {"num_conversations": args.num_conversations, "num_turns": args.num_turns,
            "system_prompt_len": args.system_prompt_len, "images_per_request": args.images_per_request,
            "images_every_turn": args.images_every_turn,
            "image_sizes": ["x".join(str(v) for v in size) for size in args.image_size],
            "image_format": args.image_format}
