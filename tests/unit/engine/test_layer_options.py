"""The shared layers' per-layer options a family may need: plain 1-D rotary with its own base and
"linear" scaling (against transformers' rope init functions), soft-capping (against Gemma 3's
own final-logit code), and the attention layer's sliding window and soft-cap."""
from __future__ import annotations

import math

import pytest
import torch

from epd.engine.attention import AttentionMetadata, get_backend
from epd.engine.layers.attention import Attention
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.rotary import RotaryEmbedding, apply_rotary, rotate_half
from epd.engine.layers.softcap import softcap


def _gemma3_rope_reference(rope_parameters: dict, layer_type: str, head_dim: int, positions: torch.Tensor):
    """transformers' Gemma3RotaryEmbedding for one layer type: cos, sin [N, head_dim]."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    cfg = Gemma3TextConfig(head_dim=head_dim, num_attention_heads=2, hidden_size=64, rope_parameters=rope_parameters)
    rope = Gemma3RotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rope(x, positions[None], layer_type)
    return cos[0], sin[0]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_plain_rotary_of_rope_parameters_matches_transformers(layer_type):
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    head_dim = 32
    positions = torch.tensor([0, 1, 5, 77, 1000, 40_000])
    rope = RotaryEmbedding.from_rope_parameters(head_dim, params[layer_type])
    cos, sin = rope(positions[None])  # [N, 1, half]
    ref_cos, ref_sin = _gemma3_rope_reference(params, layer_type, head_dim, positions)
    assert torch.equal(torch.cat((cos, cos), -1)[:, 0], ref_cos) and torch.equal(torch.cat((sin, sin), -1)[:, 0], ref_sin)
    # and the rotation transformers applies with them
    x = torch.randn(len(positions), 3, head_dim)
    expected = x * ref_cos[:, None] + rotate_half(x) * ref_sin[:, None]
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, atol=1e-6, rtol=1e-6)


def test_linear_scaling_is_transformers_linear_init():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Qwen3Config(head_dim=64, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500_000.0})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    rope = RotaryEmbedding.from_rope_parameters(64, cfg.rope_parameters)
    assert torch.equal(rope.inv_freq, inv_freq) and attention_factor == 1.0
    assert not torch.equal(RotaryEmbedding.from_rope_parameters(64, {"rope_theta": 500_000.0}).inv_freq, inv_freq)


def test_plain_rotary_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding.from_rope_parameters(32, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="one position row"):
        RotaryEmbedding(32, 1e4)(torch.zeros(3, 4, dtype=torch.long))


def test_softcap_is_transformers_final_logit_softcapping():
    logits = torch.randn(4, 50) * 40
    expected = torch.tanh(logits / 30.0) * 30.0  # Gemma3ForCausalLM.forward's three steps
    assert torch.equal(softcap(logits, 30.0), expected)
    assert softcap(logits, None) is logits
    assert float(softcap(logits, 30.0).abs().max()) < 30.0


@pytest.mark.parametrize("window,cap", [(4, None), (None, 0.8), (5, 0.6)])
def test_attention_layer_applies_its_window_and_softcap(window, cap):
    """A layer with a window and a soft-cap over a prompt longer than the window, behind a cached
    prefix, against the same layer's projections attended densely by hand."""
    torch.manual_seed(0)
    hidden, num_heads, num_kv_heads, head_dim, block_size = 32, 4, 2, 16, 4
    layer = Attention(hidden, num_heads, num_kv_heads, head_dim, layer_idx=0, rms_norm_eps=1e-6, qk_norm=False,
                      sliding_window=window, softcap=cap)
    rope = RotaryEmbedding(head_dim, 10_000.0)
    n_prefix, n_new = 7, 9
    n = n_prefix + n_new
    x = torch.randn(n, hidden)
    cos, sin = rope(torch.arange(n)[None])
    kv = [(torch.zeros(5, block_size, num_kv_heads, head_dim), torch.zeros(5, block_size, num_kv_heads, head_dim))]
    backend, blocks = get_backend("torch"), [3, 0, 4, 1]
    with torch.inference_mode():
        for start, end in ((0, n_prefix), (n_prefix, n)):  # the prefix, then a chunk behind it
            meta = AttentionMetadata.build([end - start], [end], [blocks], block_size)
            batch = ForwardBatch(positions=torch.arange(start, end)[None], attn_meta=meta, backend=backend, kv_caches=kv)
            out = layer(x[start:end], cos[start:end], sin[start:end], batch, torch.zeros(end - start, hidden))
        qkv = layer.qkv_proj(x)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rotary(q.view(n, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(n, num_kv_heads, head_dim), cos, sin).repeat_interleave(2, dim=1)
    v = v.view(n, num_kv_heads, head_dim).repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim ** -0.5
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    o = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)
    expected = layer.o_proj(o.reshape(n, -1))[n_prefix:]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
