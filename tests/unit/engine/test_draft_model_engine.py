"""Speculative decoding with a draft model (`{"method": "draft_model", ...}`) on the
tiny checkpoint, drafted by its 2-layer truncation (`tiny_draft`): greedy output
is the output without speculation, token for token, while drafts are accepted;
with images and M-RoPE, preemption and chunked prefill (against transformers);
prefilled by a prefill engine and decoded by a decode engine that runs the
draft's prefill itself (e-p-d), with the combined engine's tokens and
acceptance; a draft that disagrees changes nothing but the counters; a
draft with another tokenizer is refused at load."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from testkit.engine_factories import cpu_llm
from testkit.hf_reference import hf_greedy
from testkit.media import MIXED_BATCH, images_of

from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.transport.wire.sampling import SamplingParams

PROMPTS = [[11, 12, 13, 14, 15] * 5, list(range(500, 540)), [7, 8] * 12, [3, 901, 77, 250, 18, 640, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _spec(draft: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain(tiny_model):
    return cpu_llm(tiny_model)


@pytest.fixture(scope="module")
def spec(tiny_model, tiny_draft):
    return cpu_llm(tiny_model, speculative_config=_spec(tiny_draft))


def _counts(llm) -> tuple[int, int, int]:
    s = llm.stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_greedy_tokens_are_the_same_and_drafts_are_accepted(plain, spec):
    before = _counts(spec)
    assert _tokens(spec.generate(PROMPTS, GREEDY)) == _tokens(plain.generate(PROMPTS, GREEDY))
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_counts(spec), before))
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 3 * drafts
    stats = spec.stats()
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert spec.engine.num_free_blocks() == spec.engine.num_blocks
    spec.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(spec.engine.proposer._states) == 1  # finished requests' draft state is dropped


def test_images_preemption_and_chunked_prefill_match_transformers(tiny_model, tiny_draft, plain):
    """The draft reads the image placeholders as tokens at the target's M-RoPE positions; a tiny
    KV budget preempts requests (their draft KV starts again), a small token budget chunks the
    prompts and the draft's own catch-up."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = cpu_llm(tiny_model, num_kv_blocks=16, max_num_batched_tokens=24, max_num_seqs=8,
                  speculative_config=_spec(tiny_draft, k=4))
    outs = [o.outputs[0].token_ids for o in llm.chat(MIXED_BATCH, params)]
    assert outs == [o.outputs[0].token_ids for o in plain.chat(MIXED_BATCH, params)]
    assert outs[1] == hf_greedy(tiny_model, MIXED_BATCH[1], images_of(MIXED_BATCH[1]), num_tokens=20)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def _core(tiny_model, role: str, spec: dict | None) -> EngineCore:
    config = EngineConfig.from_flat(num_kv_blocks=64, dtype="float32", device="cpu", speculative_config=spec)
    return EngineCore(tiny_model, config, role=role)


def _run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for u in core.step().updates:
            tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
    return tokens


def test_e_p_d_decodes_with_the_combined_engines_tokens_and_acceptance(tiny_model, tiny_draft):
    """The decode engine never ran the prompt: the draft's first forward is its prefill."""
    combined = _core(tiny_model, "pd", _spec(tiny_draft))
    for i, prompt in enumerate(PROMPTS):
        combined.add_request(Request(f"r{i}", list(prompt), GREEDY))
    expected = _run(combined)

    prefill, decode = _core(tiny_model, "prefill", _spec(tiny_draft)), _core(tiny_model, "decode", _spec(tiny_draft))
    assert prefill.proposer is None  # it samples one token a request: nothing to verify
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(Request(f"r{i}", list(prompt), GREEDY))
    first = _run(prefill)
    for i, prompt in enumerate(PROMPTS):
        request = Request(f"r{i}", list(prompt), GREEDY, eos_token_ids=decode.info.eos_token_ids)
        request.output_token_ids += first[f"r{i}"]
        assert decode.add_prefilled(request, *prefill.export_kv(f"r{i}"))
        assert prefill.release(f"r{i}")
    decoded = _run(decode)
    assert {rid: first[rid] + decoded[rid] for rid in first} == expected
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos")
    assert {k: decode.stats()[k] for k in keys} == {k: combined.stats()[k] for k in keys}
    assert decode.stats()["spec_decode_num_accepted_tokens"] > 0
    assert prefill.stats()["spec_decode_num_draft_tokens"] == 0


def test_a_draft_that_never_agrees_changes_no_token(tiny_model, tmp_path, plain):
    from epd.tools.make_draft import make_draft

    draft = make_draft(tiny_model, tmp_path / "wrong", num_layers=2, disagree=True)
    llm = cpu_llm(tiny_model, speculative_config=_spec(str(draft)))
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == _tokens(plain.generate(PROMPTS, GREEDY))
    _, draft_tokens, accepted = _counts(llm)
    assert draft_tokens > 0 and accepted <= draft_tokens // 10


def test_sampled_requests_get_drafts_and_draw_nothing_from_the_default_generator(spec):
    """Seeded sampled requests: every draw is their own generator's; the runner no longer
    samples the rows of a drafted request (their tokens are the verifier's), so the
    default generator never moves."""
    params = SamplingParams(temperature=0.05, seed=7, max_tokens=24, ignore_eos=True)
    before, rng = _counts(spec), torch.random.get_rng_state()
    outs = spec.generate(PROMPTS, params)
    assert torch.equal(torch.random.get_rng_state(), rng)
    drafts, _, accepted = (a - b for a, b in zip(_counts(spec), before))
    assert drafts > 0 and accepted > 0
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    again = spec.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    assert again == outs[0].outputs[0].token_ids


def test_a_draft_with_another_tokenizer_is_refused(tiny_model, tmp_path):
    from epd.families.qwen_vl.presets import PRESETS
    from epd.tools.make_model import make_model

    other = make_model(tmp_path / "other", dataclasses.replace(PRESETS["tiny"], num_layers=1, tokenizer_vocab=900))
    with pytest.raises(ValueError, match="another vocabulary than the target's"):
        cpu_llm(tiny_model, speculative_config=_spec(str(other)))


def test_make_model_draft_of_checks_the_layer_count(tiny_model, tmp_path, capsys):
    from epd.cli import build_parser

    args = build_parser().parse_args(["make-model", str(tmp_path / "d"), "--draft-of", tiny_model,
                                      "--num-layers", "4"])
    assert args.func(args) == 2
    assert "--num-layers must be in 1..3" in capsys.readouterr().err
    args = build_parser().parse_args(["make-model", str(tmp_path / "d"), "--draft-of", tiny_model])
    assert args.func(args) == 0
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(tmp_path / "d")).text_config.num_hidden_layers == 1
