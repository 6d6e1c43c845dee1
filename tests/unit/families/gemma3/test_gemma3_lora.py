"""LoRA on Gemma 3's language model: a peft adapter on transformers' Gemma3ForConditionalGeneration
(its language model's projections only, targeted by a regex as users target it: SigLIP has
q/k/v projections too) gives peft's greedy tokens, beside the base model in one batch."""
from __future__ import annotations

import pytest
import torch

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
PROMPTS = [list(range(10, 30)), [5, 900, 33, 7, 512, 64, 3, 3, 8] * 5]  # the second longer than the window
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(gemma3_model, tmp_path_factory) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    base = Gemma3ForConditionalGeneration.from_pretrained(gemma3_model, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)  # peft starts B at zero, which would change nothing
    out = tmp_path_factory.mktemp("lora") / "gemma3-all"
    model.save_pretrained(str(out))
    return str(out)


@torch.no_grad()
def _peft_greedy(gemma3_model: str, adapter: str | None, prompt: list[int]) -> list[int]:
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_model, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def test_an_adapter_and_the_base_in_one_batch_give_peft_tokens(gemma3_model, adapter):
    from epd import LLM

    expected = [_peft_greedy(gemma3_model, a, p) for a in (None, adapter) for p in PROMPTS]
    assert expected[:2] != expected[2:], "the adapter was meant to change the answers"
    llm = LLM(gemma3_model, dtype="float32", enable_lora=True, max_loras=1, num_kv_blocks=64)
    lora = LoRARequest("all", 1, adapter)
    outs = llm.generate(PROMPTS * 2, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                        lora_request=[None, None, lora, lora])
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_the_shapes_from_the_config_are_the_models(gemma3_model):
    """The API process checks adapters against the config's shapes (no torch): they are our model's."""
    from transformers import AutoConfig

    from epd.engine.lora.adapter import ProjectionShapes
    from epd.families.gemma3.text_model import TextConfig

    config = AutoConfig.from_pretrained(gemma3_model)
    assert ProjectionShapes.from_hf(config) == ProjectionShapes.of(TextConfig.from_hf(config))
