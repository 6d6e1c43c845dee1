"""EAGLE-3 speculation in the engine (engine/spec/eagle3_proposer.py), offline `LLM`, on the
tiny checkpoint with a head fitted to its greedy continuations (testkit/eagle3_fit.py):
greedy output is the output without speculation, token for token, while drafts are
accepted; with images (and transformers), preemption and chunked prefill; a prefix-cache
hit drafts exactly as the first run did (the head's entries live in the shared blocks);
sampled requests go on. A random head's drafts (mostly rejected) leave the output exact."""
from __future__ import annotations

import pytest
from testkit.eagle3_fit import fit_eagle3
from testkit.engine_factories import cpu_llm
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, images_of

from epd.transport.wire.sampling import SamplingParams

PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300], list(range(500, 540)),
           [40, 41, 42, 43, 44, 45, 46, 47] * 3 + [40, 41]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def _spec(head: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain(tiny_model):
    return cpu_llm(tiny_model)


@pytest.fixture(scope="module")
def head(tiny_model, plain, tmp_path_factory) -> str:
    """A head fitted to the greedy continuations of PROMPTS (and of the image batch's text)."""
    from epd.tools.make_eagle3 import make_eagle3

    outs = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    sequences = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
    path = make_eagle3(tmp_path_factory.mktemp("eagle3") / "head", "tiny-eagle3")
    return str(fit_eagle3(path, tiny_model, sequences))


@pytest.fixture(scope="module")
def spec(tiny_model, head):
    return cpu_llm(tiny_model, speculative_config=_spec(head))


def _counters(llm) -> dict[str, int]:
    stats = llm.stats()
    return {name: stats[name] for name in SPEC_COUNTERS}


def _delta(llm, run) -> tuple[object, dict[str, int]]:
    before = _counters(llm)
    result = run()
    return result, {name: value - before[name] for name, value in _counters(llm).items()}


def test_greedy_tokens_are_the_same_and_drafts_are_accepted(plain, spec):
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    outs, delta = _delta(spec, lambda: spec.generate(PROMPTS, GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert delta["spec_decode_num_accepted_tokens"] > 0 and delta["spec_decode_num_drafts"] > 0
    stats = spec.stats()
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks


def test_a_prefix_cache_hit_drafts_as_the_first_run(tiny_model, head, plain):
    """The second run finds every full prompt block cached, the head's entries with them:
    it must draft (and accept) exactly as the first run, which computed them."""
    llm = cpu_llm(tiny_model, speculative_config=_spec(head))
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    first, first_delta = _delta(llm, lambda: llm.generate(PROMPTS, GREEDY))
    hits = llm.stats()["prefix_cache_hits"]
    second, second_delta = _delta(llm, lambda: llm.generate(PROMPTS, GREEDY))
    assert llm.stats()["prefix_cache_hits"] > hits
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second] == expected
    assert second_delta == first_delta and first_delta["spec_decode_num_accepted_tokens"] > 0


def test_images_preemption_and_chunked_prefill_match_transformers(tiny_model, head, plain):
    """A tiny KV budget preempts requests with drafts in flight (their recompute rebuilds the
    head's entries); a small token budget chunks prompts beside them."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chats = MIXED_BATCH[:4]  # text, one image, two images, text
    llm = cpu_llm(tiny_model, num_kv_blocks=10, max_num_batched_tokens=24, max_num_seqs=8,
                  speculative_config=_spec(head))
    outs = [o.outputs[0].token_ids for o in llm.chat(chats, params)]
    assert outs == [o.outputs[0].token_ids for o in plain.chat(chats, params)]
    assert outs[1] == hf_greedy(tiny_model, chats[1], images_of(chats[1]), num_tokens=16)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_chunked_prompts_draft_as_whole_ones(tiny_model, head, spec):
    """Chunks of 9 tokens (2 to 5 a prompt): a chunk ending at e writes the head's entries up to
    e - 1 and keeps the features of e - 1 for the next chunk, so the drafts, and the acceptance,
    are the same. (No prompt leaves a last chunk of one token: that one would be scheduled as a
    decode and draft, which the whole prompt's prefill does not.)"""
    assert all(len(p) % 9 > 1 for p in PROMPTS)
    llm = cpu_llm(tiny_model, max_num_batched_tokens=9, max_num_seqs=1, speculative_config=_spec(head))
    one_by_one = cpu_llm(tiny_model, max_num_seqs=1, speculative_config=_spec(head))
    outs, delta = _delta(llm, lambda: llm.generate(PROMPTS, GREEDY))
    ref, ref_delta = _delta(one_by_one, lambda: one_by_one.generate(PROMPTS, GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert delta == ref_delta and delta["spec_decode_num_accepted_tokens"] > 0


def test_a_random_heads_drafts_leave_the_output_exact(tiny_model, plain, tmp_path):
    from epd.tools.make_eagle3 import make_eagle3

    llm = cpu_llm(tiny_model, speculative_config=_spec(str(make_eagle3(tmp_path / "random", "tiny-eagle3")), k=2))
    outs, delta = _delta(llm, lambda: llm.generate(PROMPTS, GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert 0 < delta["spec_decode_num_drafts"] <= delta["spec_decode_num_draft_tokens"] \
        <= 2 * delta["spec_decode_num_drafts"]  # k = 2, cut near max_tokens


def test_sampled_requests_speculate_and_finish(spec):
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7)
    outs, delta = _delta(spec, lambda: spec.generate(PROMPTS, params))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert delta["spec_decode_num_drafts"] > 0
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, 'needs "model"'),
    ({"method": "eagle3", "model": "/nonexistent/head", "num_speculative_tokens": 3}, "EAGLE-3 head"),
])
def test_bad_heads_are_refused_at_start(tiny_model, config, message):
    with pytest.raises(ValueError, match=message):
        cpu_llm(tiny_model, speculative_config=config)


def _core(tiny_model, head: str, role: str):
    from epd.engine.config import EngineConfig
    from epd.engine.engine_core import EngineCore

    config = EngineConfig.from_flat(num_kv_blocks=64, dtype="float32", device="cpu", speculative_config=_spec(head))
    return EngineCore(tiny_model, config, role=role)


def _decode_all(core) -> list[int]:
    tokens = []
    while core.has_unfinished():
        tokens += [t for u in core.step().updates for t in u.new_token_ids]
    return tokens


def test_the_hand_over_carries_the_heads_state(tiny_model, head):
    """Engines of the three roles: the decode engine given the prefill engine's head state
    (KVTransfer.draft_state) accepts what the combined engine accepts; one given none (a
    prefill worker without the head) decodes the same tokens, drafting without the prompt."""
    from epd.engine.request import Request

    prompt = PROMPTS[0]
    combined = _core(tiny_model, head, "pd")
    combined.add_request(Request("c", list(prompt), GREEDY))
    expected = _decode_all(combined)
    assert combined.stats()["spec_decode_num_accepted_tokens"] > 0
    prefill = _core(tiny_model, head, "prefill")
    prefill.add_request(Request("r", list(prompt), GREEDY))
    first = _decode_all(prefill)
    assert first == expected[:1] and prefill.stats()["spec_decode_num_drafts"] == 0
    k, v = prefill.export_kv("r")
    state = prefill.export_draft_state("r")
    assert state is not None and state[2].shape == (combined.runner.eagle3.cfg.hidden_size,)
    for draft_state in (state, None):
        decode = _core(tiny_model, head, "decode")
        request = Request("r", list(prompt), GREEDY, eos_token_ids=decode.info.eos_token_ids)
        request.output_token_ids.append(first[0])
        assert decode.add_prefilled(request, k, v, draft_state)
        assert first + _decode_all(decode) == expected
        if draft_state is not None:
            assert {n: decode.stats()[n] for n in SPEC_COUNTERS} == {n: combined.stats()[n] for n in SPEC_COUNTERS}
