"""Verifies speculative drafts: rejection sampling that keeps the target's distribution.

A proposer (n-gram, EAGLE-3, a draft model) guesses k tokens d_1..d_k for a
sequence; the target model scores the k+1 positions in one forward (the last
real token followed by the drafts). This module decides how many drafts to keep
and draws the one token after them, so that the emitted tokens are distributed
exactly as if the target had sampled them one by one (Leviathan et al. 2023,
Chen et al. 2023):

    for j = 1..k:  accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
    first rejection at j: emit a token from the residual norm(max(0, p_j - q_j)), stop
    all accepted:  emit a bonus token from p_{k+1}

p_j is the target's distribution at position j *after* the request's
processing (grammar mask, allowed/banned ids, logit_bias, penalties,
temperature, min-p, top-k, top-p): engine/sampler.py's `Sampler.process` and
`sampling_probs`, the same code the plain sampler runs. q_j is the
distribution d_j was drawn from; a deterministic proposer (n-gram, an argmax
draft) passes no q: it is one-hot on d_j, every draft is accepted with
probability p_j(d_j), and the residual is p_j with d_j taken out. Greedy
requests (temperature 0) accept d_j iff it is the argmax of the edited logits
and then emit that argmax: exactly the tokens greedy decoding without
speculation gives.

API for the engine (the runner calls it after the verification forward):

    rows = verification_inputs(inputs, draft_token_ids)   # k_i + 1 SamplingInputs per sequence
    #   (pass banned_token_ids= / token_bitmasks= per position where min_tokens,
    #    bad words or a grammar make them differ along the drafts)
    batch = SamplingBatch.from_inputs(rows)               # rows padded to max_k + 1 per sequence
    out = SpecSampler()(target_logits, batch, drafts)     # target_logits [num_seqs, max_k + 1, vocab]
    out.token_ids[i, :out.num_emitted[i]]                 # accepted drafts + the correction / bonus token

with `drafts = DraftBatch.from_lists(draft_token_ids, probs)` (probs: None, or per draft
[k_i, vocab] / None, or one [num_seqs, max_k, vocab]). On the runner's flat layout (each
sequence's k_i + 1 rows anywhere in the step's rows, plain decodes between them):

    processed = Sampler.process(logits, batch)            # [num_rows, vocab], the step's rows
    out = verify(processed, batch, first_rows, drafts)    # first_rows[i]: sequence i's first row

`num_emitted - 1` drafts were accepted (the metric). The KV slots of the
rejected drafts (positions num_emitted.. of the k+1) are the caller's to roll
back. Logprobs of emitted tokens are the target's: `gather_logprobs` on the
raw logits of the emitted tokens' rows.

Randomness: a seeded request draws its k_i acceptance uniforms and one Exp(1)
vector for its last token from its own generator (`make_generator`), so its
tokens do not depend on its neighbours; unseeded rows share the default one.
Greedy rows draw nothing. The two rules are exposed (`acceptance_probs`,
`residual_probs`) so tests can check the emitted distribution analytically.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from epd.engine.sampler import Sampler, SamplingBatch, SamplingInput, exponential_noise, sampling_probs

_PAD_ID = -1


@dataclass
class DraftBatch:
    """Drafts of one step, padded: a sequence may propose fewer than max_k (or none)."""

    token_ids: torch.Tensor  # [num_seqs, max_k] int64, -1 padded
    num_tokens: torch.Tensor  # [num_seqs] int64
    # [num_seqs, max_k, vocab] the distributions the drafts were drawn from; None: one-hot (deterministic)
    probs: torch.Tensor | None = None

    @classmethod
    def from_lists(cls, draft_token_ids: Sequence[Sequence[int]],
                   probs: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
                   device: torch.device | str = "cpu") -> DraftBatch:
        """`probs`: one [num_seqs, max_k, vocab] tensor, or per draft its [k_i, vocab]
        distributions or None (deterministic: one-hot), or None for all."""
        max_k = max((len(d) for d in draft_token_ids), default=0)
        ids = [list(d) + [_PAD_ID] * (max_k - len(d)) for d in draft_token_ids]
        token_ids = torch.tensor(ids, dtype=torch.int64, device=device).reshape(len(ids), max_k)
        if probs is not None and not isinstance(probs, torch.Tensor):
            probs = _padded_probs(token_ids, list(probs)) if any(q is not None for q in probs) else None
        return cls(token_ids=token_ids, probs=probs,
                   num_tokens=torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64, device=device))

    @property
    def max_k(self) -> int:
        return self.token_ids.shape[1]


def _padded_probs(token_ids: torch.Tensor, probs: list[torch.Tensor | None]) -> torch.Tensor:
    """[num_seqs, max_k, vocab]: each draft's [k_i, vocab] rows, one-hot where it gave None."""
    vocab_size = next(q for q in probs if q is not None).shape[-1]
    out = one_hot_probs(token_ids, vocab_size)
    for i, q in enumerate(probs):
        if q is not None:
            out[i, :q.shape[0]] = q
    return out


@dataclass
class SpecSamplerOutput:
    token_ids: torch.Tensor  # [num_seqs, max_k + 1] int64: accepted drafts, then the last token; -1 after
    num_emitted: torch.Tensor  # [num_seqs] int64, 1..k_i + 1 (accepted drafts + 1)


def verification_inputs(inputs: Sequence[SamplingInput], draft_token_ids: Sequence[Sequence[int]],
                        banned_token_ids: Sequence[Sequence[Sequence[int]]] | None = None,
                        token_bitmasks: Sequence[Sequence[torch.Tensor | None]] | None = None,
                        ) -> list[SamplingInput]:
    """One SamplingInput per scored position, max_k + 1 per sequence (padding
    positions repeat the last real one; they are never read).

    Position j of sequence i sees the output so far plus drafts 0..j-1, so the
    penalties count them as the plain sampler would one step at a time.
    `banned_token_ids[i][j]` and `token_bitmasks[i][j]` override the sequence's
    own per position (min_tokens, bad words and grammars change along the
    drafts; computing them is the caller's: it owns the stop ids and grammar).
    """
    max_k = max((len(d) for d in draft_token_ids), default=0)
    rows: list[SamplingInput] = []
    for i, (x, drafts) in enumerate(zip(inputs, draft_token_ids, strict=True)):
        for j in range(max_k + 1):
            jj = min(j, len(drafts))
            row = replace(x, output_token_ids=list(x.output_token_ids) + list(drafts[:jj]))
            if banned_token_ids is not None:
                row.banned_token_ids = banned_token_ids[i][jj]
            if token_bitmasks is not None:
                row.token_bitmask = token_bitmasks[i][jj]
            rows.append(row)
    return rows


def acceptance_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor) -> torch.Tensor:
    """[num_seqs, k] min(1, p(d) / q(d)) for target_probs [num_seqs, >= k, vocab],
    draft_probs [num_seqs, k, vocab] (None: one-hot, q(d) = 1) and ids [num_seqs, k]
    (-1 padding gives 0). A draft with q(d) = 0 is accepted iff p(d) > 0."""
    k = draft_token_ids.shape[1]
    ids = draft_token_ids.clamp_min(0).unsqueeze(-1)  # [num_seqs, k, 1]
    p = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    if draft_probs is None:
        accept = p.clamp(max=1.0)
    else:
        q = draft_probs.gather(-1, ids).squeeze(-1)
        ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), (p > 0).to(p.dtype))
        accept = ratio.clamp(max=1.0)
    return torch.where(draft_token_ids >= 0, accept, 0.0)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; p itself where p <= q everywhere
    (only float noise gets there: then rejection had probability 0)."""
    residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), target_probs)


def one_hot_probs(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_seqs, k, vocab] float32 one-hot of the drafts (zero rows for -1 padding)."""
    ids = draft_token_ids.clamp_min(0)
    q = torch.zeros(*ids.shape, vocab_size, dtype=torch.float32, device=ids.device)
    q.scatter_(-1, ids.unsqueeze(-1), 1.0)
    return q * (draft_token_ids >= 0).unsqueeze(-1)


def rejection_sample(target_probs: torch.Tensor, drafts: DraftBatch, uniforms: torch.Tensor,
                     exponentials: torch.Tensor) -> SpecSamplerOutput:
    """The random-row rule, given its noise: target_probs [num_seqs, max_k + 1, vocab],
    uniforms [num_seqs, max_k] in [0, 1), exponentials [num_seqs, vocab] Exp(1)."""
    num_seqs, max_k = drafts.token_ids.shape
    is_draft = drafts.token_ids >= 0  # padding never passes (its uniforms may be unset)
    accept = (uniforms < acceptance_probs(target_probs, drafts.probs, drafts.token_ids)) & is_draft
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepted drafts
    # The last token's distribution: the residual at the first rejection, or p after
    # the last draft (bonus); q is zero past the drafts, so both are norm(max(0, p - q)).
    q = one_hot_probs(drafts.token_ids, target_probs.shape[-1]) if drafts.probs is None else drafts.probs
    q = q * is_draft.unsqueeze(-1)
    q = torch.cat([q, q.new_zeros(num_seqs, 1, q.shape[-1])], dim=1)  # [num_seqs, max_k + 1, vocab]
    at = num_accepted.view(num_seqs, 1, 1).expand(num_seqs, 1, target_probs.shape[-1])
    final = residual_probs(target_probs.gather(1, at).squeeze(1), q.gather(1, at).squeeze(1))
    last = (final / exponentials).argmax(dim=-1)  # exponential race: a draw from `final`
    return _emit(drafts.token_ids, num_accepted, last)


def greedy_verify(target_argmax: torch.Tensor, drafts: DraftBatch) -> SpecSamplerOutput:
    """target_argmax [num_seqs, max_k + 1]: keep drafts while they equal it, then emit it."""
    max_k = drafts.max_k
    match = (drafts.token_ids == target_argmax[:, :max_k]) & (drafts.token_ids >= 0)
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    last = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _emit(drafts.token_ids, num_accepted, last)


def _emit(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> SpecSamplerOutput:
    num_seqs, max_k = draft_token_ids.shape
    positions = torch.arange(max_k + 1, device=draft_token_ids.device).unsqueeze(0)  # [1, max_k + 1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((num_seqs, 1), _PAD_ID)], dim=1)
    token_ids = torch.where(positions < num_accepted.unsqueeze(1), padded, _PAD_ID)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    return SpecSamplerOutput(token_ids=token_ids, num_emitted=num_accepted + 1)


def draw_noise(generators: Sequence[torch.Generator | None], drafts: DraftBatch, vocab_size: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [num_seqs, max_k], exponentials [num_seqs, vocab]). A seeded
    sequence draws exactly its own k_i uniforms, then one Exp(1) vector, from its
    generator: what it draws never depends on the batch's max_k."""
    num_seqs, max_k = drafts.token_ids.shape
    uniforms = torch.rand(num_seqs, max_k, device=device) if not all(generators) else \
        torch.empty(num_seqs, max_k, device=device)
    counts = drafts.num_tokens.tolist()
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i, :counts[i]].uniform_(generator=generator)
    return uniforms, exponential_noise(generators, torch.Size((num_seqs, vocab_size)), device)


def verify(processed: torch.Tensor, batch: SamplingBatch, first_rows: Sequence[int],
           drafts: DraftBatch) -> SpecSamplerOutput:
    """The verifier on the runner's flat layout: `processed` [num_rows, vocab] is
    `Sampler.process` of the verification forward's rows, `batch` those rows'
    SamplingBatch, and sequence i's k_i + 1 rows start at `first_rows[i]` (row
    first_rows[i] + j sees the output plus drafts 0..j-1). Rows of sequences
    without a draft may sit in between (plain decodes): only the named rows are
    read. Random rows' `processed` is divided in place (as `Sampler.choose`)."""
    num_seqs, max_k = drafts.token_ids.shape
    device = processed.device
    first = torch.tensor(list(first_rows), dtype=torch.int64, device=device)  # [num_seqs]
    offsets = torch.arange(max_k + 1, device=device).unsqueeze(0)  # [1, max_k + 1]
    index = first.unsqueeze(1) + torch.minimum(offsets, drafts.num_tokens.unsqueeze(1))  # padding: last real row
    out = greedy_verify(processed.argmax(dim=-1)[index], drafts)
    is_greedy = batch.is_greedy[first]
    if bool(is_greedy.all()):
        return out
    random_rows = (~is_greedy).nonzero().squeeze(1)  # sequences, not rows
    probs = sampling_probs(processed, batch)[index[random_rows]]  # [num_random, max_k + 1, vocab]
    sub = DraftBatch(drafts.token_ids[random_rows], drafts.num_tokens[random_rows],
                     None if drafts.probs is None else drafts.probs[random_rows])
    generators = [batch.generators[first_rows[i]] for i in random_rows.tolist()]
    uniforms, exponentials = draw_noise(generators, sub, processed.shape[-1], device)
    sampled = rejection_sample(probs, sub, uniforms, exponentials)
    out.token_ids[random_rows] = sampled.token_ids
    out.num_emitted[random_rows] = sampled.num_emitted
    return out


class SpecSampler:
    """`SpecSampler()(target_logits, batch, drafts)` on a padded layout.

    target_logits [num_seqs, max_k + 1, vocab] (any float dtype) are the raw
    scores of the verification forward; `batch` has num_seqs * (max_k + 1) rows
    in that order (`verification_inputs`). Greedy sequences follow
    `greedy_verify`, the others `rejection_sample` (`verify` does both).
    """

    def __call__(self, target_logits: torch.Tensor, batch: SamplingBatch, drafts: DraftBatch) -> SpecSamplerOutput:
        num_seqs, num_positions, vocab_size = target_logits.shape
        assert num_positions == drafts.max_k + 1 and batch.num_seqs == num_seqs * num_positions, \
            (target_logits.shape, drafts.token_ids.shape, batch.num_seqs)
        processed = Sampler.process(target_logits.reshape(-1, vocab_size), batch)  # [num_rows, vocab]
        return verify(processed, batch, range(0, num_seqs * num_positions, num_positions), drafts)
