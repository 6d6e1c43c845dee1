"""Not only the presets: other Qwen3-VL shapes transformers can load give the
same greedy tokens — tied head, one KV head, no deepstack, another M-RoPE
split, a padded vocabulary, a different patch grid."""
from __future__ import annotations

import dataclasses

import pytest
from testkit.hf_reference import hf_greedy
from testkit.media import image_bytes, image_part

from epd.transport.wire.sampling import SamplingParams
from epd.families.qwen_vl.presets import PRESETS
from epd.tools.make_model import make_model

VARIANTS = {
    "tied_mqa_padded_vocab": dict(tie_word_embeddings=True, num_kv_heads=1, vocab_size=1100,
                                  mrope_section=(2, 3, 3)),
    "no_deepstack_wide_heads": dict(deepstack_indexes=(), head_dim=32, num_heads=2, num_kv_heads=2,
                                    vision_depth=2, num_position_embeddings=144),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_greedy_matches_transformers(tmp_path, name):
    from epd import LLM

    preset = dataclasses.replace(PRESETS["tiny"], **VARIANTS[name])
    model_dir = str(make_model(tmp_path / name, preset, seed=7))
    img = image_bytes(70, 110, seed=3)
    messages = [{"role": "user", "content": [image_part(img), {"type": "text", "text": "What is this?"}]}]
    expected = hf_greedy(model_dir, messages, [img], num_tokens=10)
    llm = LLM(model_dir, num_kv_blocks=32, dtype="float32", device="cpu")
    out = llm.chat([messages], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected
