"""The CPU Gated DeltaNet kernel (engine/layers/gated_delta_cpu.c) against the layer's torch path
(engine/layers/gated_deltanet.py with the kernel switched off): one step mixing decodes, a chunk
continuing a prompt, a fresh prompt over three 64-token chunks and a one-token prompt, the states
read and written in place in their slots; float32 tightly, bfloat16 to its rounding."""
from __future__ import annotations

import pytest
import torch

from epd.engine.layers import gated_delta_cpu, gated_deltanet
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.layers.gated_deltanet import GatedDeltaNet
from epd.engine.attention.metadata import AttentionMetadata

HIDDEN, NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM, KERNEL = 96, 2, 4, 32, 48, 4
NUM_SLOTS = 8
# per sequence: (new tokens, context after the step, slot); the slots out of order, 3 and 6 unused
SEQS = [(1, 7, 5), (3, 10, 2), (1, 4, 0), (150, 150, 7), (1, 1, 4), (2, 2, 1)]


@pytest.fixture(scope="module", autouse=True)
def built():
    if gated_delta_cpu.load() is None:
        pytest.skip("no C compiler here: the CPU Gated DeltaNet kernel is not built")


def make_layer(dtype: torch.dtype) -> GatedDeltaNet:
    gen = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM, KERNEL, 1e-6, state_idx=0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        layer.A_log.uniform_(-2.0, 0.0, generator=gen)  # decays that keep some state over 150 tokens
    return layer.to(dtype)


def run(layer: GatedDeltaNet, x: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], use_kernel: bool,
        monkeypatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(gated_deltanet, "use_cpu_kernel", use_kernel)
    conv, rec = (s.clone() for s in states)
    num_tokens = [n for n, _, _ in SEQS]
    cu = torch.tensor([0, *torch.tensor(num_tokens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=torch.tensor([L for _, L, _ in SEQS], dtype=torch.int32),
                             max_seqlen_q=max(num_tokens), max_seqlen_k=150, slot_mapping=torch.zeros(0), is_decode_only=False,
                             block_tables=torch.zeros(len(SEQS), 1, dtype=torch.int32))
    batch = ForwardBatch(positions=torch.zeros(1, x.shape[0]), attn_meta=meta, backend=None, kv_caches=[],
                         state_caches=[(conv, rec)], state_slots=[slot for _, _, slot in SEQS])
    with torch.inference_mode():
        return layer(x, batch), conv, rec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_the_torch_path(dtype, monkeypatch):
    layer = make_layer(dtype)
    gen = torch.Generator().manual_seed(1)
    conv_shape, rec_shape = layer.state_shapes()
    states = (torch.randn(NUM_SLOTS, *conv_shape, generator=gen).to(dtype),
              torch.randn(NUM_SLOTS, *rec_shape, generator=gen) * 0.3)
    x = torch.randn(sum(n for n, _, _ in SEQS), HIDDEN, generator=gen).to(dtype)

    got = run(layer, x, states, True, monkeypatch)
    ref = run(layer, x, states, False, monkeypatch)
    for name, a, b in zip(("out", "conv states", "recurrent states"), got, ref):
        if dtype == torch.float32:  # the recurrent rule against the chunked one: float32 rounding apart
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=name)
        else:  # the torch path rounds its conv output, beta and core output to bfloat16; the kernel does not
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.02, name
    for slot in (3, 6):  # no sequence's: untouched
        assert torch.equal(got[1][slot], states[0][slot]) and torch.equal(got[2][slot], states[1][slot])
    assert not torch.equal(got[2][7], states[1][7])  # the fresh prompt's slot: overwritten, not added to


def test_switched_off_or_without_a_compiler_the_kernel_is_not_built(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EPD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    assert gated_delta_cpu._load() is None
    assert "CPU Gated DeltaNet kernel not built" in caplog.text and not list(tmp_path.glob("*.so"))
    monkeypatch.setenv("EPD_CPU_GDN_KERNEL", "0")
    caplog.clear()
    assert gated_delta_cpu._load() is None and not caplog.text
