"""Turns one step's logits into next tokens (and logprobs) for a batch of sequences.

Order of processing, as in vLLM V1:

    raw logits ──▶ logprobs (log_softmax of the raw logits, when asked)
               ──▶ grammar mask, allowed_token_ids, banned ids (-inf) ──▶ logit_bias
               ──▶ repetition / frequency / presence penalties
               ──▶ greedy rows: argmax
               ──▶ temperature ──▶ min-p ──▶ top-k ──▶ top-p ──▶ random rows: sample

Random rows sample with the exponential race, argmax(probs / q) with q ~ Exp(1)
per token, which draws a token from `probs` exactly. Each seeded row draws its
q from its own `torch.Generator`, so a seeded request gets the same tokens
whatever else shares the batch; unseeded rows share the default generator.
Every per-row operation reads only that row, so neighbours never change a row's
result.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epd.transport.wire.sampling import SamplingParams, TokenLogprobs

# Below this temperature a row is greedy: dividing by it would overflow float32.
_SAMPLING_EPS = 1e-5
_PAD_ID = -1  # padding in the [num_seqs, max_len] token-id tensors


def is_greedy_params(params: SamplingParams) -> bool:
    """Whether a sequence takes the argmax (no random draw): its temperature is below
    what dividing by is safe for. Speculative decoding verifies these only."""
    return params.temperature < _SAMPLING_EPS


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded sequence; keep it for the request's lifetime."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingInput:
    """What the sampler needs to know about one sequence at this step.

    `banned_token_ids` are never sampled this step; the runner passes the EOS
    and stop-token ids here while the sequence is short of `min_tokens`, and
    the last token of any bad word the output is about to complete.
    `token_bitmask` ([ceil(vocab / 32)] int32, bit t set = token t allowed) is
    the grammar's mask for this step (structured outputs).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    banned_token_ids: Sequence[int] = ()
    token_bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    # One entry per row, None for rows that did not ask; None when no row asked.
    logprobs: list[TokenLogprobs | None] | None = None


def _pad(rows: list[Sequence[int]]) -> torch.Tensor:
    """[num_seqs, max_len] int64, padded with _PAD_ID."""
    max_len = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [_PAD_ID] * (max_len - len(r)) for r in rows],
                        dtype=torch.int64).reshape(len(rows), max_len)


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for a batch; optional parts are None when unused.

    Build with `SamplingBatch.from_inputs`: one Python pass over the sequences
    (never over the vocab). Penalties work on the penalized rows only: their
    token ids and penalty values are indexed by position in `penalty_rows`.
    """

    num_seqs: int
    is_all_greedy: bool
    is_greedy: torch.Tensor  # [num_seqs] bool
    temperature: torch.Tensor  # [num_seqs] float32, 1.0 on greedy rows
    generators: list[torch.Generator | None]
    top_k: torch.Tensor | None = None  # [num_seqs] int64, 0 = disabled
    top_p: torch.Tensor | None = None  # [num_seqs] float32, 1.0 = disabled
    min_p: torch.Tensor | None = None  # [num_seqs] float32, 0.0 = disabled
    # Penalties: all six set together, or all None.
    penalty_rows: torch.Tensor | None = None  # [num_penalized] int64, rows of the batch
    prompt_token_ids: torch.Tensor | None = None  # [num_penalized, max_prompt_len], -1 pad
    output_token_ids: torch.Tensor | None = None  # [num_penalized, max_output_len], -1 pad
    presence_penalty: torch.Tensor | None = None  # [num_penalized] float32
    frequency_penalty: torch.Tensor | None = None  # [num_penalized] float32
    repetition_penalty: torch.Tensor | None = None  # [num_penalized] float32
    banned_rows: torch.Tensor | None = None  # [num_banned] int64
    banned_ids: torch.Tensor | None = None  # [num_banned] int64
    num_logprobs: list[int | None] | None = None  # per row, None when no row asks
    bitmask_rows: torch.Tensor | None = None  # [num_masked] int64
    bitmask: torch.Tensor | None = None  # [num_masked, ceil(vocab / 32)] int32
    allowed_rows: torch.Tensor | None = None  # [num_allowed_rows] int64
    allowed_pairs: tuple[torch.Tensor, torch.Tensor] | None = None  # (index into allowed_rows, token id)
    bias_rows: torch.Tensor | None = None  # [num_biases] int64
    bias_ids: torch.Tensor | None = None  # [num_biases] int64
    bias_values: torch.Tensor | None = None  # [num_biases] float32

    @classmethod
    def from_inputs(cls, inputs: Sequence[SamplingInput],
                    device: torch.device | str = "cpu") -> SamplingBatch:
        params = [x.params for x in inputs]
        is_greedy = [is_greedy_params(p) for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        batch = cls(
            num_seqs=len(inputs),
            is_all_greedy=all(is_greedy),
            is_greedy=torch.tensor(is_greedy, dtype=torch.bool, device=device),
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, is_greedy)]),
            # Greedy rows draw nothing, so their generators stay untouched.
            generators=[None if g else x.generator for x, g in zip(inputs, is_greedy)],
        )
        # Filters only matter on random rows.
        random = [p for p, g in zip(params, is_greedy) if not g]
        if any(p.top_k > 0 for p in random):
            batch.top_k = torch.tensor([0 if g else max(p.top_k, 0) for p, g in zip(params, is_greedy)],
                                       dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in random):
            batch.top_p = floats([1.0 if g else p.top_p for p, g in zip(params, is_greedy)])
        if any(p.min_p > 0.0 for p in random):
            batch.min_p = floats([0.0 if g else p.min_p for p, g in zip(params, is_greedy)])

        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if rows:
            penalized = [params[i] for i in rows]
            batch.penalty_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            # The prompt only matters to the repetition penalty.
            batch.prompt_token_ids = _pad([inputs[i].prompt_token_ids if p.repetition_penalty != 1.0
                                           else () for i, p in zip(rows, penalized)]).to(device)
            batch.output_token_ids = _pad([inputs[i].output_token_ids for i in rows]).to(device)
            batch.presence_penalty = floats([p.presence_penalty for p in penalized])
            batch.frequency_penalty = floats([p.frequency_penalty for p in penalized])
            batch.repetition_penalty = floats([p.repetition_penalty for p in penalized])

        if any(x.banned_token_ids for x in inputs):
            rows = [i for i, x in enumerate(inputs) for _ in x.banned_token_ids]
            ids = [t for x in inputs for t in x.banned_token_ids]
            batch.banned_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            batch.banned_ids = torch.tensor(ids, dtype=torch.int64, device=device)

        if any(p.logprobs is not None for p in params):
            batch.num_logprobs = [p.logprobs for p in params]
        batch._add_constraints(inputs, device)
        return batch

    def _add_constraints(self, inputs: Sequence[SamplingInput], device: torch.device | str) -> None:
        """Grammar masks, allowed_token_ids and logit_bias of the rows that have them."""
        rows = [i for i, x in enumerate(inputs) if x.token_bitmask is not None]
        if rows:
            self.bitmask_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.bitmask = torch.stack([inputs[i].token_bitmask for i in rows]).to(device)
        rows = [i for i, x in enumerate(inputs) if x.params.allowed_token_ids is not None]
        if rows:
            self.allowed_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            index = [j for j, i in enumerate(rows) for _ in inputs[i].params.allowed_token_ids]
            ids = [t for i in rows for t in inputs[i].params.allowed_token_ids]
            self.allowed_pairs = (torch.tensor(index, dtype=torch.int64, device=device),
                                  torch.tensor(ids, dtype=torch.int64, device=device))
        if any(x.params.logit_bias for x in inputs):
            pairs = [(i, t, b) for i, x in enumerate(inputs) for t, b in (x.params.logit_bias or {}).items()]
            self.bias_rows = torch.tensor([r for r, _, _ in pairs], dtype=torch.int64, device=device)
            self.bias_ids = torch.tensor([t for _, t, _ in pairs], dtype=torch.int64, device=device)
            self.bias_values = torch.tensor([b for _, _, b in pairs], dtype=torch.float32, device=device)

    def choice_rows(self, rows: Sequence[int]) -> SamplingBatch:
        """The batch of `rows` only, as `Sampler.choose` reads it (greedy flags, temperature,
        filters, generators) for logits already `process`ed: speculative decoding chooses
        the rows without a draft and leaves the drafted ones to the verifier."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.temperature.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        is_greedy = self.is_greedy[index]
        return SamplingBatch(num_seqs=len(rows), is_all_greedy=bool(is_greedy.all()), is_greedy=is_greedy,
                             temperature=self.temperature[index], generators=[self.generators[r] for r in rows],
                             top_k=pick(self.top_k), top_p=pick(self.top_p), min_p=pick(self.min_p))

    @property
    def has_penalties(self) -> bool:
        return self.penalty_rows is not None

    @property
    def has_logit_edits(self) -> bool:
        """Anything that changes logits before argmax besides penalties."""
        return (self.banned_ids is not None or self.bitmask is not None or self.allowed_rows is not None
                or self.bias_ids is not None)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_seqs, max_len] ids, -1 padded → [num_seqs, vocab_size] float32 counts."""
    ids = torch.where(token_ids >= 0, token_ids, vocab_size)  # padding → spare column
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=ids.device))
    return counts[:, :vocab_size]


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_seqs, max_len] ids, -1 padded → [num_seqs, vocab_size] bool "occurs"."""
    ids = torch.where(token_ids >= 0, token_ids, vocab_size)
    mask = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                    output_token_ids: torch.Tensor, presence_penalty: torch.Tensor,
                    frequency_penalty: torch.Tensor, repetition_penalty: torch.Tensor) -> torch.Tensor:
    """Returns penalized float32 logits [num_seqs, vocab]; token ids are -1 padded.

    Repetition (HF/vLLM): a token seen in prompt or output has its logit divided
    by the penalty when positive, multiplied when not. Then, OpenAI-style, on
    output tokens only: logit -= frequency * count + presence * (count > 0).
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size)  # [num_seqs, vocab]
    is_in_output = output_counts > 0
    is_seen = is_in_output | _token_mask(prompt_token_ids, vocab_size)
    rep = torch.where(is_seen, repetition_penalty.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= frequency_penalty.unsqueeze(1) * output_counts
    logits -= presence_penalty.unsqueeze(1) * is_in_output
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p × the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps the k largest logits (ties kept) and the smallest nucleus of mass >= p.

    `top_k` 0 (or >= vocab) and `top_p` 1.0 disable the filter for a row.
    """
    vocab_size = logits.shape[-1]
    if top_k is not None:
        is_on = (top_k > 0) & (top_k < vocab_size)
        if bool(is_on.any()):
            k = torch.where(is_on, top_k, 1)
            top_values = logits.topk(int(k.max()), dim=-1).values  # [num_seqs, max_k]
            kth = top_values.gather(1, (k - 1).unsqueeze(1))  # [num_seqs, 1]
            kth = torch.where(is_on.unsqueeze(1), kth, float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        is_on = top_p < 1.0
        if bool(is_on.any()):
            rows = is_on.nonzero().squeeze(1)
            sub = logits[rows]  # [num_on, vocab]
            sorted_logits, order = sub.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending probs
            drop = cum <= 1.0 - top_p[rows].unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            sub = sub.masked_fill(drop.scatter(1, order, drop), float("-inf"))
            logits = logits.index_copy(0, rows, sub)
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 (bit j of word w = token 32 w + j) -> [rows, vocab] bool allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_constraints(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place on float32 logits [num_seqs, vocab]: the grammar mask, allowed_token_ids
    and banned ids set -inf, then logit_bias is added. Ids past the logits' width
    (a vocabulary padded differently) are ignored."""
    vocab_size = logits.shape[-1]
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    if batch.bitmask is not None:
        allowed = unpack_bitmask(batch.bitmask, vocab_size)  # [num_masked, vocab]
        rows = logits.index_select(0, batch.bitmask_rows)
        logits.index_copy_(0, batch.bitmask_rows, rows.masked_fill(~allowed, float("-inf")))
    if batch.allowed_rows is not None:
        index, ids = batch.allowed_pairs
        keep = ids < vocab_size
        allowed = torch.zeros(len(batch.allowed_rows), vocab_size, dtype=torch.bool, device=logits.device)
        allowed[index[keep], ids[keep]] = True
        rows = logits.index_select(0, batch.allowed_rows)
        logits.index_copy_(0, batch.allowed_rows, rows.masked_fill(~allowed, float("-inf")))
    if batch.banned_ids is not None:
        keep = batch.banned_ids < vocab_size
        logits.index_put_((batch.banned_rows[keep], batch.banned_ids[keep]), neg_inf)
    if batch.bias_ids is not None:
        keep = batch.bias_ids < vocab_size
        logits.index_put_((batch.bias_rows[keep], batch.bias_ids[keep]), batch.bias_values[keep], accumulate=True)


def exponential_noise(generators: Sequence[torch.Generator | None], shape: torch.Size,
                      device: torch.device) -> torch.Tensor:
    """[num_seqs, vocab] Exp(1) noise; seeded rows draw from their own generator."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if not all(generators):
        q.exponential_()  # default generator; seeded rows are overwritten below
    for i, generator in enumerate(generators):
        if generator is not None:
            q[i].exponential_(generator=generator)
    return q.clamp_min_(torch.finfo(torch.float32).tiny)  # no division by zero


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: list[int | None]) -> list[TokenLogprobs | None]:
    """Logprobs of the raw model output (vLLM's default), for rows that asked."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [num_rows, vocab]
    chosen = token_ids.index_select(0, index).unsqueeze(1)  # [num_rows, 1]
    chosen_logprob = logprobs.gather(1, chosen)  # [num_rows, 1]
    ranks = (logprobs > chosen_logprob).sum(dim=-1) + 1
    max_k = max(num_logprobs[i] for i in rows)
    top = logprobs.topk(max_k, dim=-1) if max_k > 0 else None

    chosen_l, lp_l, rank_l = chosen.squeeze(1).tolist(), chosen_logprob.squeeze(1).tolist(), ranks.tolist()
    top_ids_l = top.indices.tolist() if top is not None else None
    top_lp_l = top.values.tolist() if top is not None else None
    out: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for j, i in enumerate(rows):
        k = num_logprobs[i]
        pairs = list(zip(top_ids_l[j][:k], top_lp_l[j][:k])) if k else []
        out[i] = TokenLogprobs(token_id=chosen_l[j], logprob=lp_l[j], rank=rank_l[j], top=pairs)
    return out


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[num_rows, vocab] the distribution random rows sample from: temperature,
    min-p, top-k, top-p and softmax over `Sampler.process`'s logits (divided in
    place). Greedy rows get a distribution at temperature 1 that nobody should
    read. Shared with the speculative verifier (engine/spec/sampling.py)."""
    logits.div_(batch.temperature.unsqueeze(1))
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits.softmax(dim=-1)


class Sampler:
    """`Sampler()(logits, batch)`: logits [num_seqs, vocab], any float dtype."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_seqs, logits.shape
        if (batch.is_all_greedy and not batch.has_penalties and not batch.has_logit_edits
                and batch.num_logprobs is None):
            return SamplerOutput(token_ids=logits.argmax(dim=-1))  # fast path

        token_ids = self.choose(self.process(logits, batch), batch)
        logprobs = None
        if batch.num_logprobs is not None:
            logprobs = gather_logprobs(logits, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def process(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 copy of `logits` with the grammar masks, allowed / banned ids,
        logit_bias and penalties applied: what greedy rows take the argmax of and
        random rows filter and sample from (speculative decoding verifies a
        draft against these, engine/spec/verify.py)."""
        logits = logits.to(torch.float32, copy=True)  # ours to edit in place
        if batch.has_logit_edits:
            apply_constraints(logits, batch)
        if batch.has_penalties:
            rows = batch.penalty_rows
            logits.index_copy_(0, rows, apply_penalties(
                logits.index_select(0, rows), batch.prompt_token_ids, batch.output_token_ids,
                batch.presence_penalty, batch.frequency_penalty, batch.repetition_penalty))
        return logits

    def choose(self, processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[num_seqs] token ids from `process`'s logits: the argmax on greedy rows,
        a draw on random rows (which edits `processed` in place)."""
        token_ids = processed.argmax(dim=-1)
        if not batch.is_all_greedy:
            sampled = self._sample(processed, batch)
            token_ids = torch.where(batch.is_greedy, token_ids, sampled)
        return token_ids

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[num_seqs] sampled ids; greedy rows get a value that the caller discards."""
        probs = sampling_probs(logits, batch)
        q = exponential_noise(batch.generators, probs.shape, probs.device)
        return (probs / q).argmax(dim=-1)
