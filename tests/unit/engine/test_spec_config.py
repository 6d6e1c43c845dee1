"""--speculative-config: vLLM's keys and defaults, parsed into SpeculativeConfig; the
CLI flag and `LLM(speculative_config=...)` reach `EngineConfig.speculative_config`."""
from __future__ import annotations

import pytest

from epd.cli import build_parser, serve_config
from epd.engine.config import EngineConfig
from epd.engine.spec.config import SpeculativeConfig


@pytest.mark.parametrize("given, expected", [
    ({"method": "ngram", "num_speculative_tokens": 3}, (3, 5, 5)),  # vLLM: 5 and 5 when neither is given
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}, (2, 4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, (2, 2, 2)),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, (4, 1, 3)),
    ({"model": "[ngram]", "num_speculative_tokens": 1}, (1, 5, 5)),  # the method inferred, as vLLM does
])
def test_ngram_configs_take_vllm_defaults(given, expected):
    config = SpeculativeConfig.parse(given)
    assert config.method == "ngram"
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == expected
    assert SpeculativeConfig.parse(config.to_json()) == config


@pytest.mark.parametrize("given, message", [
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "eagle3.*needs \"model\""),
    ('{"method": "eagle", "model": "/heads/x", "num_speculative_tokens": 3}', "eagle.*not served by EPD yet"),
    ('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}', "'/m' is not a checkpoint directory"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', 'draft_model" needs "model"'),
    ('{"model": "/some/dir", "num_speculative_tokens": 3}', "draft model"),  # vLLM's inference: a draft model
    ('{"method": "lookahead", "num_speculative_tokens": 3}', "not a speculative method"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer from 1 to 32"),
    ('{"method": "ngram", "num_speculative_tokens": 100000}', "num_speculative_tokens must be .* to 32, got 100000"),
    ('{"method": "ngram", "num_speculative_tokens": 33}', "num_speculative_tokens must be .* to 32, got 33"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1000000}',
     "prompt_lookup_max must be an integer from 1 to 64, got 1000000"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 65, "prompt_lookup_max": 64}',
     "prompt_lookup_min must be an integer from 1 to 64, got 65"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}',
     "does not read disable_by_batch_size"),
    ('{"method": ngram}', "not valid JSON"),
    ('[1, 2]', "takes a JSON object"),
])
def test_refusals_name_the_problem(given, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(given)


def test_a_draft_model_config_names_a_checkpoint(tiny_model):
    config = SpeculativeConfig.parse({"model": tiny_model, "num_speculative_tokens": 2})  # method inferred
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", tiny_model, 2)
    assert SpeculativeConfig.parse(config.to_json()) == config


def test_the_flag_and_llm_settings_reach_the_engine_config(tiny_model):
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    engine = serve_config(build_parser().parse_args(["serve", tiny_model, "--speculative-config", flag])).engine
    assert engine.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    assert serve_config(build_parser().parse_args(["serve", tiny_model])).engine.speculative_config is None
    assert EngineConfig.from_flat(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 4}).speculative_config == \
        engine.speculative_config
    with pytest.raises(ValueError, match="eagle3"):
        EngineConfig.from_flat(speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
