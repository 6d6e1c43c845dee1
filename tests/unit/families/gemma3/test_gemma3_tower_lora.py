"""Tower LoRA (--enable-tower-lora) covers the Qwen towers only: on Gemma 3 an adapter with
SigLIP tensors is refused by name where it is loaded (the API's check of --lora-modules and
of runtime loads; the encoder, for an image of the offline LLM), never served with its
tower part dropped. A language-only adapter, or the flag off (vLLM's default: the tower's
tensors ignored with a warning), serves as before."""
from __future__ import annotations

import pytest
from testkit.lora_adapters import make_adapter
from testkit.media import describe, image_bytes

from epd.lora_modules import LoRAModule, check_lora_modules
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

BOTH = ("q_proj", "k_proj", "v_proj")  # PEFT finds these in SigLIP too
LANGUAGE_ONLY = ("o_proj", "gate_proj")  # SigLIP has out_proj and fc1, fc2: none of these


@pytest.fixture(scope="module")
def adapters(gemma3_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("tower-lora")
    return {"both": make_adapter(gemma3_model, out / "both", BOTH, r=4, seed=1),
            "text": make_adapter(gemma3_model, out / "text", LANGUAGE_ONLY, r=4, seed=2)}


def _check(gemma3_model, name: str, path: str, enable_tower_lora: bool) -> None:
    from transformers import AutoConfig

    check_lora_modules((LoRAModule(name, path),), "gemma", AutoConfig.from_pretrained(gemma3_model), 8,
                       enable_tower_lora)


def test_the_api_refuses_an_adapter_of_the_tower_by_name(gemma3_model, adapters):
    with pytest.raises(ValueError, match=r"LoRA adapter 'both' .*vision_tower.*adapts Gemma 3's vision tower"):
        _check(gemma3_model, "both", adapters["both"], enable_tower_lora=True)
    _check(gemma3_model, "text", adapters["text"], enable_tower_lora=True)  # no tower tensor: served
    _check(gemma3_model, "both", adapters["both"], enable_tower_lora=False)  # tower tensors ignored, as vLLM


def test_the_encoder_refuses_it_for_an_image(gemma3_model, adapters):
    from epd import LLM

    llm = LLM(gemma3_model, dtype="float32", enable_lora=True, enable_tower_lora=True, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=r"LoRA adapter 'both'.*Gemma 3's vision tower"):
        llm.chat([describe(image_bytes(40, 30))], params, lora_request=LoRARequest("both", 1, adapters["both"]))
    out = llm.chat([describe(image_bytes(40, 30))], params, lora_request=LoRARequest("text", 2, adapters["text"]))
    assert len(out[0].outputs[0].token_ids) == 2
