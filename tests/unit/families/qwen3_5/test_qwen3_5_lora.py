"""LoRA on Qwen3.5's hybrid layers: one PEFT adapter on the full-attention layers' q/k/v/o
(q_proj's rows each head's query and its output gate), gate/up/down (the dense MLP's; on
Qwen3.5-MoE the shared expert's, which PEFT's names reach there) and the Gated DeltaNet layers'
in_proj_qkv/z/b/a and out_proj gives transformers + peft's greedy tokens and top-5 logprobs
(float32), beside the base model in one batch, over prompts prefilled in several chunks through
their state slots. The Gated DeltaNet's causal convolution (PEFT adapts a Conv1d) is refused
by name; the API process's shapes (from the config, no torch) are the engine's."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import assert_greedy_matches
from testkit.lora_adapters import make_adapter

from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.sampling import SamplingParams

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
NUM_TOKENS = 5


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(16, 1000, (n,), generator=gen).tolist() for n in (9, 30)]


@torch.no_grad()
def _peft_reference(model, ids: list[int]) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """The peft model's greedy (tokens, top-5 ids per token, their logprobs [NUM_TOKENS, 5])."""
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    top = logprobs.topk(5)
    return out.sequences[0, len(ids):].tolist(), top.indices.tolist(), top.values


def test_an_adapter_on_both_layer_kinds_gives_peft_tokens_and_logprobs(qwen3_5_model, qwen3_5_reference,
                                                                        tmp_path):
    from peft import PeftModel
    from safetensors import safe_open

    from epd import LLM

    adapter = make_adapter(qwen3_5_model, tmp_path / "adapter", ATTENTION + LINEAR_ATTENTION + MLP, r=4, seed=5)
    with safe_open(f"{adapter}/adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
        q_b = next(f.get_tensor(k) for k in keys if ".self_attn.q_proj.lora_B" in k)
    assert any(".linear_attn.in_proj_qkv." in k for k in keys) and any(".linear_attn.out_proj." in k for k in keys)
    is_moe = "moe" in qwen3_5_model
    assert any(".mlp.shared_expert.up_proj." in k for k in keys) == is_moe  # PEFT's up_proj on a MoE layer
    cfg = qwen3_5_reference.config.text_config
    assert q_b.shape[0] == 2 * cfg.num_attention_heads * cfg.head_dim  # query and gate rows
    prompts = _prompts()
    hf_model = type(qwen3_5_reference).from_pretrained(qwen3_5_model, dtype=torch.float32)  # the session's untouched
    peft_model = PeftModel.from_pretrained(hf_model, adapter, adapter_name="sql").eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is many times faster than several on a shared CPU
    try:
        with_adapter = [_peft_reference(peft_model, ids) for ids in prompts]
        with peft_model.disable_adapter():
            base = [_peft_reference(peft_model, ids) for ids in prompts]
    finally:
        torch.set_num_threads(threads)
    assert [t for t, *_ in with_adapter] != [t for t, *_ in base], "the adapter was meant to change the answers"
    llm = LLM(qwen3_5_model, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=32,
              max_num_batched_tokens=16)
    lora = LoRARequest("sql", 1, adapter)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts * 2],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5),
                        lora_request=[None, None, lora, lora])
    # atol 5e-4: the CPU kernel runs the rule token by token where transformers runs it chunked, and
    # this adapted MoE model carries that float32 rounding to ~3e-4 in a logprob (the torch ops: 3e-5)
    assert_greedy_matches(outs, base + with_adapter, atol=5e-4)
    assert llm.engine.runner.state_cache.usage == 0  # every slot back


def test_the_api_sees_the_engines_shapes_and_refuses_the_convolution(tmp_path):
    from transformers import AutoConfig

    from epd.engine.lora.adapter import LoRAAdapterError, ProjectionShapes, read_adapter
    from epd.families.qwen3_5.text_model import TextConfig
    from epd.tools.make_model import make_model

    model_dir = make_model(tmp_path / "ckpt", "qwen3.5-moe-tiny", seed=0)
    config = AutoConfig.from_pretrained(model_dir)
    shapes = ProjectionShapes.from_hf(config)
    assert shapes == ProjectionShapes.of(TextConfig.from_hf(config))
    assert shapes.linear_layer_ids == {0, 1, 2} and shapes.moe_layer_ids == {0, 1, 2, 3}
    ok = make_adapter(model_dir, tmp_path / "all", ATTENTION + LINEAR_ATTENTION + MLP, r=2, seed=1)
    assert {module for _, module in read_adapter("ok", ok, shapes, 8).tensors} == \
        set(ATTENTION + LINEAR_ATTENTION) | {f"shared_expert.{m}" for m in MLP}
    dense = ProjectionShapes.from_hf(AutoConfig.from_pretrained(make_model(tmp_path / "dense", "qwen3.5-tiny")))
    with pytest.raises(LoRAAdapterError, match="adapts a shared expert, which this model's language model lacks"):
        read_adapter("shared", ok, dense, 8)
    # the depthwise conv: PEFT adapts it with a rank its groups divide (conv_dim = 2 x 32 + 64 = 128)
    conv = make_adapter(model_dir, tmp_path / "conv", ("conv1d",), r=128, seed=1)
    with pytest.raises(LoRAAdapterError, match="EPD does not adapt the Gated DeltaNet layers' causal convolution"):
        read_adapter("conv", conv, shapes, 128)
