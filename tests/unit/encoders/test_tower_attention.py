"""The towers' attention: exact within each segment, and memory linear in a
segment's patches (issue 44 item 1: a 3-D SDPA call on CPU took the math path
and held heads x n x n scores; one 8K video group OOM-killed the encoder)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from epd.families.qwen_vl.vision_tower import segment_attention


def _reference(q, k, v, seq_lens):
    """softmax(q k^T / sqrt(d)) v within each segment, in float64."""
    outs = []
    for qi, ki, vi in zip(q.double().split(seq_lens), k.double().split(seq_lens), v.double().split(seq_lens)):
        scores = torch.einsum("nhd,mhd->hnm", qi, ki) / math.sqrt(q.shape[-1])
        outs.append(torch.einsum("hnm,mhd->nhd", scores.softmax(-1), vi))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_segment_attention_matches_reference(dtype, atol):
    # ragged windows, runs of equal lengths, and a lone image
    seq_lens = [64, 64, 64, 40, 16, 16, 256, 4]
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, sum(seq_lens), 4, 16, generator=gen).to(dtype).unbind(0)
    out = segment_attention(q, k, v, seq_lens)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(q, k, v, seq_lens), atol=atol, rtol=0)


# Runs in a fresh interpreter: builds each tower with random weights, and reads
# the peak RSS (VmHWM, reset through clear_refs) of one forward over one group
# of `side x side` patches. Prints {case: peak growth in bytes}.
_CHILD = r"""
import json, re, sys
import torch
from epd.families.qwen_vl.qwen2_5_vision_tower import Qwen2_5VisionConfig, Qwen2_5VisionTower
from epd.families.qwen_vl.vision_tower import VisionConfig, VisionTower

side, heads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(2)
torch.manual_seed(0)
shape = dict(depth=2, hidden_size=16 * heads, num_heads=heads, intermediate_size=32 * heads,
             hidden_act="gelu_pytorch_tanh", patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
             in_channels=3, out_hidden_size=32, rope_theta=10000.0)
towers = {"qwen3_vl": VisionTower(VisionConfig(**shape, num_position_embeddings=64, deepstack_indexes=(0,))),
          # block 1 attends over the whole group, block 0 within windows
          "qwen2_5_vl": Qwen2_5VisionTower(Qwen2_5VisionConfig(**shape, window_size=112,
                                                               fullatt_block_indexes=(1,)))}
towers["qwen3_vl"].pos_embed.weight.data.normal_()

def peak_kb():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

grown = {}
for dtype in (torch.float32, torch.bfloat16):
    for name, tower in towers.items():
        tower = tower.to(dtype)
        tower(torch.randn(64, 3 * 2 * 14 * 14), [(1, 8, 8)])  # warm up kernels and allocator
        pixels = torch.randn(side * side, 3 * 2 * 14 * 14)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = peak_kb()
        out = tower(pixels, [(1, side, side)])
        assert out.embeds[0].shape == (side * side // 4, 32)
        grown[f"{name}/{str(dtype).split('.')[-1]}"] = (peak_kb() - before) * 1024
        del pixels, out
print(json.dumps(grown))
"""


def test_tower_attention_memory_is_linear_in_patches():
    # one 64 x 64-patch group (896 x 896 pixels), 4 heads: the math path's scores
    # are heads x n x n = 268 MB per float32 copy; the fixed forward grows the peak
    # by ~8-20 MB (the pixels in the tower's dtype, activations, kernel buffers)
    side, heads = 64, 4
    n = side * side
    scores_bytes = heads * n * n * 4
    done = subprocess.run([sys.executable, "-c", _CHILD, str(side), str(heads)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(grown) == {"qwen3_vl/float32", "qwen3_vl/bfloat16", "qwen2_5_vl/float32", "qwen2_5_vl/bfloat16"}
    for case, peak in grown.items():
        assert peak < scores_bytes / 4, f"{case}: peak grew {peak / 2**20:.0f} MiB during one forward"
