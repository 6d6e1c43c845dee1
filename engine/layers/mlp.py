"""The dense SwiGLU MLP, and `pack_cpu_linears`, which packs a model's linears for CPU float32."""
from __future__ import annotations

import torch
from torch import nn

from epd.transport.weights.cpu_linear import linear_add, pack_linears, pack_swiglu, swiglu


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] normed -> residual + MLP output [N, hidden] (without a residual: the output alone)."""
        h = swiglu(self.gate_up_proj, x, self.intermediate_size)
        if residual is None:
            return self.down_proj(h)
        return linear_add(self.down_proj, h, residual)


def pack_cpu_linears(model: nn.Module) -> None:
    """CPU float32 (other dtypes: only the MoE experts below): every dense MLP's gate/up projection as a
    `PackedSwiGLU` (the activation and product inside oneDNN's calls), then every other
    `nn.Linear` packed whole (transport/weights/cpu_linear.py). After any LoRA wrapping: a wrapped
    gate/up is packed whole, its adapter added to the plain projection's output. CPU bfloat16
    also: every MoE block's routed experts (moe.py `RoutedExperts.pack_experts`)."""
    for module in model.modules():
        if isinstance(module, MLP):
            pack_swiglu(module, "gate_up_proj", module.intermediate_size)
        elif hasattr(module, "pack_experts"):  # a MoE block (moe.py imports this module, not it this one)
            module.pack_experts()  # CPU bfloat16 only
        elif hasattr(module, "pack_weights"):  # a tensor-parallel row-parallel linear (engine/parallel/layers.py)
            module.pack_weights()
    pack_linears(model)
