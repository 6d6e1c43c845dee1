"""The n-gram method's exactness checks (test_spec_decode_engine.py), run for every
proposer: n-gram, an EAGLE-3 head fitted to the target's greedy continuations
(testkit/eagle3_fit.py) and a draft model (the target's 2-layer truncation, `tiny_draft`).
With each, greedy output is the output without speculation: stop strings cut in the same
place, the logprobs are the target's, n > 1 gives n equal completions, and a
grammar-constrained output is the one without drafts (a rejected draft does not advance
the matcher). Each check also asserts that drafts were accepted meanwhile, so it is not
vacuous."""
from __future__ import annotations

import pytest
from testkit.engine_factories import cpu_llm

from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams as SO

PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300], list(range(500, 540)), [7, 8] * 12]
# prompts whose greedy continuations are whole text the 2-layer draft partly agrees with
TEXT_PROMPTS = [list(range(350, 370)), [760, 761] * 8, [820, 821] * 8]
METHODS = ["ngram", "eagle3", "draft_model"]


@pytest.fixture(scope="module")
def plain(tiny_model):
    return cpu_llm(tiny_model)


def _eagle3_head(tiny_model, plain, tmp_path_factory) -> str:
    from testkit.eagle3_fit import fit_eagle3

    from epd.tools.make_eagle3 import make_eagle3

    outs = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
    return str(fit_eagle3(make_eagle3(tmp_path_factory.mktemp("eagle3") / "head", "tiny-eagle3"),
                          tiny_model, sequences))


@pytest.fixture(scope="module", params=METHODS)
def spec(request, tiny_model, plain, tmp_path_factory):
    """An engine speculating with each method in turn (one engine a method, for the module)."""
    config = {"method": request.param, "num_speculative_tokens": 3}
    if request.param == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif request.param == "eagle3":
        config["model"] = _eagle3_head(tiny_model, plain, tmp_path_factory)
    else:
        config["model"] = request.getfixturevalue("tiny_draft")
    return cpu_llm(tiny_model, speculative_config=config)


def _both(plain, spec, params, prompts=PROMPTS):
    """(without, with speculation) completions of `generate`, and the drafts accepted meanwhile."""
    before = spec.stats()["spec_decode_num_accepted_tokens"]
    without, with_spec = plain.generate(prompts, params), spec.generate(prompts, params)
    accepted = spec.stats()["spec_decode_num_accepted_tokens"] - before
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks
    return [o.outputs for o in without], [o.outputs for o in with_spec], accepted


def test_stop_strings_end_where_they_end_without_speculation(plain, spec):
    reference = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in reference]  # text from the middle
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops]
    without, with_spec, accepted = _both(plain, spec, params)
    got = [(c.text, c.token_ids, c.finish_reason) for [c] in with_spec]
    assert got == [(c.text, c.token_ids, c.finish_reason) for [c] in without]
    assert any(reason == "stop" for _, _, reason in got) and accepted > 0


def test_logprobs_are_the_targets(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    without, with_spec, accepted = _both(plain, spec, params)
    assert accepted > 0
    for [a], [b] in zip(without, with_spec):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 16
        for x, y in zip(a.logprobs, b.logprobs):
            assert (y.token_id, y.rank, [t for t, _ in y.top]) == (x.token_id, x.rank, [t for t, _ in x.top])
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_n_greater_than_one(plain, spec):
    params = SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True)
    without, with_spec, accepted = _both(plain, spec, params)
    assert accepted > 0
    assert [[c.token_ids for c in o] for o in with_spec] == [[c.token_ids for c in o] for o in without]
    assert all(len({tuple(c.token_ids) for c in o}) == 1 for o in with_spec)


def _whole_text(tokenizer, token_ids: list[int]) -> str | None:
    """The text of the longest prefix of `token_ids` (2 tokens at least) that ends on a whole
    character, or None (the tiny vocabulary has lone-byte tokens)."""
    texts = [tokenizer.decode(token_ids[:m]) for m in range(2, len(token_ids) + 1)]
    whole = [t for t in texts if "\ufffd" not in t]
    return whole[-1] if whole else None


def test_structured_output_is_not_advanced_by_a_rejected_draft(plain, spec):
    """The proposers draft the unconstrained continuation. Each choice begins with that
    continuation's text (drafts accepted while the output follows it) and then turns away
    from it (drafts refused by the row's mask, the matcher rolled back); the other grammars
    refuse it at once. The output is the one without drafts."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    start = plain.generate(PROMPTS + TEXT_PROMPTS, greedy)
    followed = [(p, t) for p, o in zip(PROMPTS + TEXT_PROMPTS, start)
                if (t := _whole_text(plain.tokenizer, o.outputs[0].token_ids)) is not None]
    prefixes = [t for _, t in followed]
    assert len(followed) >= 4
    so = [SO(choice=[t + " red red red", t + " blue blue"]) for t in prefixes] + [
        SO(regex=r"(ab|cd|[0-9]){4,30}"), SO(choice=["red red red", "blue blue"]),
        SO(json={"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}}}})]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in so]
    prompts = [p for p, _ in followed] + PROMPTS[:3]
    drafts_before = spec.stats()["spec_decode_num_draft_tokens"]
    without, with_spec, accepted = _both(plain, spec, params, prompts)
    assert [(o[0].token_ids, o[0].finish_reason) for o in with_spec] == \
        [(o[0].token_ids, o[0].finish_reason) for o in without]
    assert all(o[0].text.startswith(t) for o, t in zip(with_spec, prefixes))
    drafts = spec.stats()["spec_decode_num_draft_tokens"] - drafts_before
    assert accepted > 0 and drafts > accepted  # some drafts accepted, some refused
