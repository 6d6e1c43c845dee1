"""The short causal depthwise convolution of a Gated DeltaNet layer, with its carried conv state.

A sequence's conv state is its last `kernel - 1` inputs (zeros before the first token), so a
prefill chunk continues where the previous chunk stopped and a decode step needs one token.
torch only (the CPU path, and the reference any GPU kernel is tested against); the `silu` is
applied here, as transformers' `causal_conv1d_fn` / `causal_conv1d_update` do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor,
                          conv_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: x [num_tokens, channels], weight [channels, kernel], conv_state
    [channels, kernel - 1] (the inputs before this chunk; None: the sequence starts here) ->
    silu(conv) [num_tokens, channels] and the new conv state [channels, kernel - 1]."""
    num_tokens, channels = x.shape
    assert weight.shape[0] == channels, (weight.shape, x.shape)
    state_len = weight.shape[1] - 1
    if conv_state is None:
        conv_state = x.new_zeros(channels, state_len)
    assert conv_state.shape == (channels, state_len), (conv_state.shape, channels, state_len)
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [channels, state_len + num_tokens]
    # each output's kernel taps side by side: [channels, num_tokens, kernel] (a grouped conv1d is slow on CPU)
    taps = window.to(weight.dtype).unfold(-1, state_len + 1, 1)
    out = F.silu((taps * weight[:, None, :]).sum(-1)).t().to(x.dtype)  # [num_tokens, channels]
    return out, window[:, -state_len:].clone()


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> torch.Tensor:
    """One token per sequence: x [num_seqs, channels], conv_states [num_seqs, channels, kernel - 1],
    updated in place -> silu(conv) [num_seqs, channels]."""
    num_seqs, channels = x.shape
    state_len = weight.shape[1] - 1
    assert conv_states.shape == (num_seqs, channels, state_len), (conv_states.shape, x.shape, weight.shape)
    window = torch.cat([conv_states, x.unsqueeze(-1).to(conv_states.dtype)], dim=-1)  # [num_seqs, channels, kernel]
    conv_states.copy_(window[:, :, 1:])
    return F.silu((window.to(weight.dtype) * weight).sum(-1)).to(x.dtype)  # [num_seqs, channels]
