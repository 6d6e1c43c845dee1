"""The shared layers a language model is built from (engine/models/ holds the models).

    forward_batch.py  ForwardBatch: what one forward pass needs besides token ids
    attention.py      paged attention: fused qkv, optional q/k norms or q/k/v biases, rotary, GQA,
                      a sliding window and a logit soft-cap per layer
    rotary.py         the rotary embedding for 1 or 3 position rows (or plain 1-D with its own base and
                      "linear" scaling), apply_rotary, rotate_half
    softcap.py        soft-capping (a final-logit cap in a model's compute_logits)
    norm.py           RMSNorm
    mlp.py            the dense SwiGLU MLP, and pack_cpu_linears for CPU float32
    moe.py            the sparse mixture-of-experts MLP, routed experts only (on CPU bfloat16 packed
                      for oneDNN, pack_experts); add_mlp, a layer's residual plus its MLP, dense or MoE
    triton_moe.py     fused MoE in Triton (GPU)
    gated_delta.py    the gated delta rule of a Gated DeltaNet layer: chunked (prefill, from a carried
                      state) and recurrent (decode), torch
    causal_conv1d.py  the short causal depthwise conv of a Gated DeltaNet layer, with its carried conv state
    gated_deltanet.py the Gated DeltaNet layer (Qwen3.5's linear attention) over per-request state slots
    gated_delta_cpu.py  the layer's fused CPU kernel (gated_delta_cpu.c: conv, gates, recurrent rule,
                      gated norm, in place in the slots), built once, loaded with ctypes
"""
