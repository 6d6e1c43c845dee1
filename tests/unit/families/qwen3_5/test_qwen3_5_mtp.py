"""MTP speculation on Qwen3.5 (dense and MoE): the checkpoint's own `mtp.*` layers (the presets
write them, as the releases ship them) draft through the EAGLE-3 proposer's paged KV; the tokens are the ones
without speculation while the random layers' drafts are mostly rejected (the state rolled back),
and all of them accepted when the layers agree with the target (`write_mtp_layers(agree=True)`).
A checkpoint without MTP layers is refused by name at start-up; vLLM's older spellings parse;
`epd make-model --mtp-agree` takes a dense Qwen3.5 preset only."""
from __future__ import annotations

import shutil

import pytest
from testkit.engine_factories import cpu_llm

from epd.transport.wire.sampling import SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [[11, 12, 13, 14, 15] * 4, [300, 301, 302] * 6 + [300]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
DENSE = pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-tiny"], indirect=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _counts(llm) -> tuple[int, int]:
    stats = llm.stats()
    return stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]


# MoE here (its MTP layer's routed experts); the dense preset's random layers: test_qwen3_5_spec.py's hand-over
@pytest.mark.parametrize("qwen3_5_model", ["qwen3.5-moe-tiny"], indirect=True)
def test_random_mtp_layers_draft_and_the_tokens_stay_the_targets(qwen3_5_model):
    expected = _tokens(cpu_llm(qwen3_5_model))
    spec = cpu_llm(qwen3_5_model, speculative_config=MTP)
    assert _tokens(spec) == expected
    accepted, drafted = _counts(spec)
    assert drafted > accepted, "random MTP layers were meant to be rejected"
    assert drafted >= 3 * len(PROMPTS)
    assert spec.engine.runner.state_cache.usage == 0 and spec.engine.num_free_blocks() == spec.engine.num_blocks


@DENSE
def test_mtp_layers_that_agree_with_the_target_are_all_accepted(qwen3_5_model, tmp_path):
    from pathlib import Path

    from epd.families.qwen3_5.presets import write_mtp_layers

    agreeing = Path(shutil.copytree(qwen3_5_model, tmp_path / "agreeing"))
    write_mtp_layers(agreeing, seed=0, agree=True)
    expected = _tokens(cpu_llm(str(agreeing)))
    spec = cpu_llm(str(agreeing), speculative_config=MTP)
    assert _tokens(spec) == expected
    accepted, drafted = _counts(spec)
    assert accepted == drafted > 0


@DENSE
def test_a_checkpoint_without_mtp_layers_is_refused_by_name(qwen3_5_model, tmp_path):
    import json

    from epd import LLM

    plain = shutil.copytree(qwen3_5_model, tmp_path / "no-mtp")
    config = json.loads((plain / "config.json").read_text())
    del config["text_config"]["mtp_num_hidden_layers"]
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="method mtp needs the checkpoint's MTP layers"):
        LLM(str(plain), dtype="float32", speculative_config=MTP)


@DENSE
def test_vllms_older_spellings_are_mtp(qwen3_5_model):
    from epd.engine.spec.config import SpeculativeConfig

    for method in ("mtp", "qwen3_5_mtp", "qwen3_next_mtp"):
        assert SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 2}).method == "mtp"


@DENSE
def test_make_model_mtp_agree_takes_a_dense_qwen3_5_preset_only(qwen3_5_model, tmp_path, capsys):
    from epd.cli import build_parser

    args = build_parser().parse_args(["make-model", str(tmp_path / "m"), "--preset", "qwen3.5-moe-tiny", "--mtp-agree"])
    assert args.func(args) == 2 and "--mtp-agree takes a dense qwen3.5 preset" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
