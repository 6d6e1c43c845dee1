"""quantization_config read into a format and scheme, the refusals by name, and the 4-bit packing orders."""
from __future__ import annotations

import pytest
import torch

from epd.transport.weights.checkpoint_error import CheckpointError
from epd.transport.weights.quant.int_packing import AWQ_ORDER, pack_int4, unpack_int4
from epd.transport.weights.quant.quant_config import read_quant_config


def _ct(weights: dict, acts: dict | None = None, fmt: str = "int-quantized", **top) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*visual.*"],
                                    **top}}


INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
INT4_GROUP = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def test_a_float_checkpoint_has_no_quant_config():
    assert read_quant_config({"model_type": "qwen3_vl"}) is None


@pytest.mark.parametrize("config, scheme", [
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                              "weight_block_size": [128, 128]}}, "fp8-block"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "fp8-tensor"),
    (_ct(INT8_CHANNEL, INT8_TOKEN), "w8a8"),
    (_ct(INT8_CHANNEL), "w8a16"),
    (_ct(FP8_CHANNEL, {**INT8_TOKEN, "type": "float"}, fmt="float-quantized"), "fp8-dynamic"),
    (_ct(INT4_GROUP, fmt="pack-quantized"), "w4a16"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                              "version": "gemm", "modules_to_not_convert": ["visual"]}}, "awq"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                              "sym": True}}, "gptq"),
])
def test_each_release_format_is_named(config, scheme):
    assert read_quant_config(config).scheme == scheme


def test_block_size_group_size_and_symmetry_are_read():
    fp8 = read_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}})
    assert fp8.block_size == (64, 32) and fp8.weight_bits == 8
    w4 = read_quant_config(_ct({**INT4_GROUP, "symmetric": False, "group_size": 32}, fmt="pack-quantized"))
    assert (w4.weight_bits, w4.group_size, w4.symmetric, w4.activation_bits) == (4, 32, False, 0)
    assert read_quant_config(_ct(INT8_CHANNEL, INT8_TOKEN)).activation_bits == 8


@pytest.mark.parametrize("config, named", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "gguf"}}, "'gguf'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fp8 fmt e5m2"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size [128]"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}},
     "awq version gemv"),
    ({"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}}, "8-bit"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}},
     "desc_act true"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}}, "3-bit"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                              "checkpoint_format": "gptq_v2"}}, "gptq_v2"),
    (_ct(INT8_CHANNEL, {**INT8_TOKEN, "dynamic": False}), "static"),
    (_ct(INT8_CHANNEL, {**INT8_TOKEN, "symmetric": False}), "int8 activations"),
    (_ct({**INT8_CHANNEL, "symmetric": False}), "int8 weights (channel)"),
    (_ct({**INT4_GROUP, "actorder": "group"}, fmt="pack-quantized"), "actorder"),
    (_ct(INT4_GROUP, INT8_TOKEN, fmt="pack-quantized"), "int4 weights"),
    (_ct({**INT4_GROUP, "num_bits": 2}, fmt="pack-quantized"), "int2 weights"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, fmt="nvfp4-pack-quantized"),
     "nvfp4-pack-quantized float4"),
    (_ct(INT8_CHANNEL, INT8_TOKEN, sparsity_config={"format": "sparse-24-bitmask"}), "sparse-24-bitmask"),
    (_ct(INT8_CHANNEL, INT8_TOKEN, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                              "config_groups": {"group_0": {"targets": ["re:.*q_proj"], "weights": INT8_CHANNEL}}}},
     "targets"),
])
def test_what_is_not_served_is_refused_by_name(config, named):
    with pytest.raises(CheckpointError, match="quantization_config") as info:
        read_quant_config(config)
    assert named in str(info.value)


def test_mixed_schemes_are_refused():
    config = _ct(INT8_CHANNEL, INT8_TOKEN)
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = {"targets": ["Linear"], "weights": INT4_GROUP, "format": "pack-quantized"}
    with pytest.raises(CheckpointError, match="mixed schemes"):
        read_quant_config(config)


def test_ignore_names_modules_by_dotted_name_or_pattern():
    quant = read_quant_config(_ct(INT8_CHANNEL, INT8_TOKEN, ignore=["lm_head", "re:.*visual.*", "re:.*mlp.gate$"]))
    assert quant.is_ignored("lm_head")
    assert quant.is_ignored("model.visual.blocks.0.attn.qkv")
    assert quant.is_ignored("model.language_model.layers.1.mlp.gate")
    assert not quant.is_ignored("model.language_model.layers.1.mlp.gate_proj")
    awq = read_quant_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                     "modules_to_not_convert": ["visual"]}})
    assert awq.is_ignored("visual.blocks.0.mlp.fc1") and not awq.is_ignored("model.layers.0.mlp.down_proj")


def test_int4_fields_in_order_and_in_awq_order():
    values = torch.arange(1, 9).view(1, 8)  # 1..8 along dim 1
    assert pack_int4(values, dim=1).item() & 0xFFFFFFFF == 0x87654321  # value i in bits 4i..4i+3
    awq = pack_int4(values, dim=1, order=AWQ_ORDER).item() & 0xFFFFFFFF
    assert awq == 0x86427531  # fields 0..7 hold values 0, 2, 4, 6, 1, 3, 5, 7
    negative = pack_int4(torch.full((1, 8), 15), dim=1)
    assert negative.dtype == torch.int32 and negative.item() == -1  # 0xFFFFFFFF
    big = torch.randint(0, 16, (16, 24))
    for dim, order in ((0, None), (1, None), (1, AWQ_ORDER)):
        assert torch.equal(unpack_int4(pack_int4(big, dim, order), dim, order), big.to(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 6), dim=1)
