"""Quantized checkpoints: the release formats read, and written for tests and benchmarks.

quant_config.py   a checkpoint's quantization_config -> the format and scheme, or a refusal naming them
int_packing.py    4-bit integers packed eight to an int32 (compressed-tensors', GPTQ's and AWQ's orders)
dequantize.py     a quantized linear's tensors -> one record in the checkpoint's tensor stream, and its float weight
int8_linear.py    INT8 W8A8 on the CPU: the checkpoint's int8 weights, per-token int8 activations, int32 products
weight_only_linear.py  weight-only schemes on the CPU: int4 / int8 / fp8 weights kept in their bits, float activations
weight_only_cpu.c its C kernel: a tile of weights dequantized into L1, then multiplied
"""
