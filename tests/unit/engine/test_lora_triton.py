"""Multi-LoRA's gathered low-rank matmul: the Triton kernels (engine/lora/triton_lora.py)
against the torch path (`add_lora_torch`, the CPU path), on rows with no adapter, mixed
slots, ranks below the maximum and a slot with a zero adapter.

Triton on CPU needs TRITON_INTERPRET=1 before the kernel is decorated, so
`test_triton_lora_under_interpreter` reruns this file's `test_triton_interpreted`
cases in a subprocess with it set; on a CUDA machine `test_triton_gpu` runs them natively.
"""
from __future__ import annotations

import pytest
import torch
from testkit.triton_interpreter import INTERPRETING, run_interpreted

from epd.engine.lora.step_rows import BLOCK_M, step_rows

HAS_CUDA = torch.cuda.is_available()
NUM_SLOTS = 4


def make_case(token_slots: list[int], k: int, out: int, max_rank: int, ranks: list[int], dtype, device, seed=0):
    """x [num_tokens, k], y [num_tokens, out] (the base output), A / B per slot with rank
    `ranks[slot]` of `max_rank` (the rest zero, as a slot holds a smaller adapter), scaling per slot."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), k, generator=gen)
    y = torch.randn(len(token_slots), out, generator=gen)
    a = torch.zeros(NUM_SLOTS, max_rank, k)
    b = torch.zeros(NUM_SLOTS, out, max_rank)
    for slot, r in enumerate(ranks):
        a[slot, :r] = torch.randn(r, k, generator=gen) / k ** 0.5
        b[slot, :, :r] = torch.randn(out, r, generator=gen)
    scaling = [0.5, 2.0, 1.0, 0.25][:NUM_SLOTS]
    to = dict(device=device, dtype=dtype)
    return x.to(**to), y.to(**to), a.to(**to), b.to(**to), scaling


def torch_reference(x, y, a, b, token_slots, scaling):
    from epd.engine.lora.layers import add_lora_torch

    ref = y.float().clone()
    rows = step_rows(token_slots, scaling, x.device, use_triton=False)
    add_lora_torch(ref, x.float(), a.float(), b.float(), rows.groups, scaling)
    return ref


def test_the_tiles_hold_every_adapter_row_once_and_one_slot_each():
    token_slots = [-1, 2, 2, 0, -1] + [1] * 20 + [2]
    tiles = step_rows(token_slots, [0.5, 2.0, 1.0, 0.25], torch.device("cpu"), use_triton=True).tiles
    rows = tiles.rows.view(-1, BLOCK_M)
    assert rows.shape[0] == tiles.tile_slots.numel() == 4  # slot 2: one tile, 0: one, 1: two (20 rows)
    for tile_rows, slot, scale in zip(rows.tolist(), tiles.tile_slots.tolist(), tiles.tile_scaling.tolist()):
        assert {token_slots[r] for r in tile_rows if r >= 0} == {slot}
        assert scale == [0.5, 2.0, 1.0, 0.25][slot]
    got = sorted(r for r in tiles.rows.tolist() if r >= 0)
    assert got == [i for i, s in enumerate(token_slots) if s >= 0]  # rows of no adapter are in no tile


def test_the_torch_path_adds_only_to_the_adapters_rows():
    token_slots = [-1, 1, -1, 0, 1]
    x, y, a, b, scaling = make_case(token_slots, 8, 12, 4, [4, 2, 0, 0], torch.float32, "cpu")
    ref = torch_reference(x, y, a, b, token_slots, scaling)
    torch.testing.assert_close(ref[[0, 2]], y[[0, 2]], atol=0, rtol=0)  # no adapter: the base output
    for row in (1, 3, 4):
        slot = token_slots[row]
        delta = x[row] @ a[slot].t() @ b[slot].t() * scaling[slot]
        torch.testing.assert_close(ref[row], y[row] + delta)


# -- Triton ---------------------------------------------------------------------------

TRITON_CASES = [  # (name, token_slots, k, out, max_rank, ranks per slot)
    ("decode_mixed", [0, -1, 1, 2, 1, -1, 3], 32, 48, 16, [16, 8, 4, 1]),
    ("prefill_ragged", [-1] * 3 + [2] * 19 + [0] * 5 + [-1] * 2 + [1] * 17, 80, 100, 16, [3, 16, 7, 0]),
    ("one_slot_every_row", [1] * 21, 64, 40, 24, [0, 24, 0, 0]),  # R = 3 pieces x max_rank 8, as qkv
    ("no_adapter_rows_only", [-1] * 5, 16, 24, 8, [8, 8, 8, 8]),
]
TRITON_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_triton_case(name, token_slots, k, out, max_rank, ranks, dtype, device):
    from epd.engine.lora.triton_lora import add_lora

    x, y, a, b, scaling = make_case(token_slots, k, out, max_rank, ranks, dtype, device, seed=3)
    ref = torch_reference(x, y, a, b, token_slots, scaling)
    got = y.clone()
    add_lora(got, x, a, b, step_rows(token_slots, scaling, x.device, use_triton=True).tiles)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    base = [i for i, s in enumerate(token_slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(got[base], y[base]), "rows of no adapter (or a zero one) keep the base output"


@pytest.mark.skipif(not INTERPRETING, reason="run by test_triton_lora_under_interpreter in a subprocess")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_interpreted(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cpu")


def test_triton_lora_under_interpreter():
    run_interpreted(__file__, len(TRITON_CASES) * len(TRITON_DTYPES))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES.values()), ids=list(TRITON_DTYPES))
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c[0] for c in TRITON_CASES])
def test_triton_gpu(case, dtype):
    check_triton_case(*case, dtype=dtype, device="cuda")
