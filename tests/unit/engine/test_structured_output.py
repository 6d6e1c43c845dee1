"""Structured outputs and logits controls on the tiny random checkpoint, offline
(`LLM`) and across a prefill -> decode hand-over: the constraint alone makes the
random model's output valid."""
from __future__ import annotations

import json
import re

import pytest
import torch
from testkit.media import image_bytes, image_part
from testkit.schemas import Invoice, Point

from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore
from epd.engine.request import Request
from epd.engine.sampler import Sampler, SamplingBatch, SamplingInput, unpack_bitmask
from epd.engine.structured_output import bad_words_token_ids, check_constraint
from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams as SO


SCHEMA = Invoice.model_json_schema()
PROMPT = [{"role": "user", "content": "Read the invoice."}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    # few KV blocks: eight requests together must preempt each other
    return LLM(tiny_model, num_kv_blocks=14, max_num_seqs=8, dtype="float32", device="cpu")


def _texts(llm, params: list[SamplingParams], messages=PROMPT) -> list:
    return [o.outputs[0] for o in llm.chat([messages] * len(params), params)]


def test_json_schema_holds_greedy_and_sampled_under_preemption(llm):
    before = llm.stats()["num_preemptions"]
    params = [SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=120,
                             structured_outputs=SO(json=SCHEMA)) for i in range(8)]
    outs = _texts(llm, params)
    assert llm.stats()["num_preemptions"] > before
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6  # the schema bounds every field, so outputs end
    for o in stopped:
        Invoice.model_validate_json(o.text)


def test_json_object_choice_regex(llm):
    # a random model writes endless strings: a bias on '"' and '}' ends them (the mask still rules)
    ends = {llm.tokenizer.convert_tokens_to_ids(c): 20.0 for c in ('"', "}")}
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=80, structured_outputs=SO(json_object=True),
                             logit_bias=ends),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs=SO(choice=["cat", "dog 🐕"])),
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex=r"[0-9]{3}-[a-z]{2}")),
              SamplingParams(temperature=0.0, max_tokens=20,
                             structured_outputs=SO(grammar='root ::= "yes" | "no" | "maybe"'))]
    obj, choice, regex, grammar = _texts(llm, params)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert choice.finish_reason == "stop" and choice.text in ("cat", "dog 🐕")
    assert regex.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text)
    assert grammar.finish_reason == "stop" and grammar.text in ("yes", "no", "maybe")


def test_image_prompt_json_schema(llm):
    messages = [{"role": "user", "content": [image_part(image_bytes(64, 48, seed=5)),
                                             {"type": "text", "text": "Extract the point."}]}]
    [out] = _texts(llm, [SamplingParams(temperature=0.0, max_tokens=40,
                                        structured_outputs=SO(json=Point.model_json_schema()))], messages)
    assert out.finish_reason == "stop"
    Point.model_validate_json(out.text)


def test_a_grammar_that_cannot_compile_fails_its_request_only(llm):
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    bad = SamplingParams(max_tokens=5, structured_outputs=SO(grammar="root ::= undefined_rule"))
    with pytest.raises(ValueError, match="undefined_rule"):
        check_constraint(bad.structured_outputs)
    core = llm.engine
    core.add_request(Request("bad", [1, 2, 3], bad))
    core.add_request(Request("good", [1, 2, 3], good))
    failed, tokens = {}, []
    while core.has_unfinished():
        result = core.step()
        failed.update(result.failed)
        tokens += [t for u in result.updates if u.request_id == "good" for t in u.new_token_ids]
    assert list(failed) == ["bad"] and "cannot be compiled" in failed["bad"]
    assert len(tokens) == 5


def test_grammar_survives_the_prefill_to_decode_hand_over(llm, tiny_model):
    """The prefill engine samples token 1 under the mask; the decode engine compiles the
    same schema, advances its matcher by that token and continues: valid JSON."""
    prompt = llm.inputs.prompts.build(PROMPT, []).token_ids
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=120, structured_outputs=SO(json=SCHEMA))
    config = EngineConfig.from_flat(num_kv_blocks=32, dtype="float32", device="cpu")
    prefill, decode = EngineCore(tiny_model, config, role="prefill"), EngineCore(tiny_model, config, role="decode")
    prefill.add_request(Request("r", list(prompt), params))
    updates = []
    while prefill.has_unfinished() and not updates:
        updates = prefill.step().updates
    [first] = updates
    assert first.is_prefilled
    k, v = prefill.export_kv("r")
    request = Request("r", list(prompt), params, eos_token_ids=prefill.info.eos_token_ids)
    request.output_token_ids.append(first.new_token_ids[0])
    while not decode.add_prefilled(request, k, v):  # False while its grammar compiles
        pass
    finish, tokens = None, list(first.new_token_ids)
    while decode.has_unfinished():
        for u in decode.step().updates:
            tokens += u.new_token_ids
            finish = u.finish_reason or finish
    assert finish == "stop"
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    Invoice.model_validate_json(text)


# -- logits controls ---------------------------------------------------------------------------

def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    free = _texts(llm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])[0].token_ids
    top = free[0]
    biased = _texts(llm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                         logit_bias={top: -100.0, 42: 100.0})])[0]
    assert biased.token_ids == [42] * 8
    allowed = _texts(llm, [SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                                          allowed_token_ids=[40, 41, 43])])[0]
    assert set(allowed.token_ids) <= {40, 41, 43} and len(allowed.token_ids) == 16
    word = llm.tokenizer.decode([top])
    banned = _texts(llm, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                         bad_words=[word])])[0]
    assert top not in banned.token_ids and banned.token_ids != free


def test_bad_words_of_several_tokens_ban_only_their_last_token_after_the_rest():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {"ab": [1, 2], " ab": [3, 1, 2]}[text]

    assert bad_words_token_ids(Tok(), ["ab"]) == [[1, 2], [3, 1, 2]]
    from epd.engine.model_runner import _bad_word_ends

    assert _bad_word_ends([[1, 2], [3, 1, 2]], [5, 3, 1]) == (2, 2)
    assert _bad_word_ends([[1, 2], [3, 1, 2]], [5, 1]) == (2,)
    assert _bad_word_ends([[1, 2]], [5, 6]) == ()


def test_sampler_applies_bitmask_allowed_ids_and_bias_per_row():
    vocab = 70
    logits = torch.zeros(3, vocab)
    logits[:, 0] = 5.0
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    bitmask[0, 2] = 1 << 1  # row 0 allows token 65 only
    inputs = [SamplingInput(SamplingParams(temperature=0), token_bitmask=bitmask[0]),
              SamplingInput(SamplingParams(temperature=0, allowed_token_ids=[7, 9], logit_bias={9: 1.0})),
              SamplingInput(SamplingParams(temperature=0, logit_bias={3: 6.0, 500: 1.0}))]
    out = Sampler()(logits, SamplingBatch.from_inputs(inputs))
    assert out.token_ids.tolist() == [65, 9, 3]
    assert unpack_bitmask(torch.tensor([[-1, 1]], dtype=torch.int32), 40)[0].tolist() == [True] * 33 + [False] * 7


def test_structured_outputs_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        SO(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{")
    with pytest.raises(ValueError, match="cannot be compiled: .*frob"):
        check_constraint(SO(json={"type": "frob"}))
    with pytest.raises(ValueError, match="cannot be compiled"):
        check_constraint(SO(regex="[a-"))
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 150})
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    assert SO.from_kind(*SO(choice=["a", "b"]).key) == SO(choice=["a", "b"])


def test_a_finished_grammar_masks_nothing_more_when_eos_is_ignored(llm):
    [out] = _texts(llm, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                        structured_outputs=SO(choice=["cat", "dog"]))])
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.text[:3] in ("cat", "dog")


def test_compiling_never_holds_back_other_requests(llm):
    """While the compiler thread is busy (held here by an event), a plain request
    steps to its end and the constrained one waits outside the scheduler."""
    import threading

    core, gate = llm.engine, threading.Event()
    core.grammars._executor.submit(gate.wait)  # the compiler thread is taken until set()
    so = SO(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["n"]})
    core.add_request(Request("constrained", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20,
                                                                      structured_outputs=so)))
    core.add_request(Request("plain", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    plain = []
    try:
        for _ in range(4):
            result = core.step()
            assert "constrained" not in result.requests
            plain += [t for u in result.updates for t in u.new_token_ids]
        assert len(plain) == 4 and core.has_unfinished()
    finally:
        gate.set()
    tokens = []
    while core.has_unfinished():
        tokens += [t for u in core.step().updates for t in u.new_token_ids]
    assert json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True))["n"] in range(10)
