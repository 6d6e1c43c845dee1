"""--tensor-parallel-size 2 on CPU (gloo): the offline LLM's greedy tokens equal TP=1's on the tiny
Qwen3-VL checkpoint (float32; logprobs within rounding), a follower rank's death fails the group
with an error naming it, and what is not sharded yet is refused by name."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
from testkit.media import IMG_A, describe

from epd.engine.config import EngineConfig
from epd.engine.parallel.comm import GroupFailed
from epd.engine.parallel.leader import check_supported
from epd.engine.parallel.shard import Shard, TensorParallelError, check_divisible
from epd.transport.wire.sampling import SamplingParams

CHATS = [[{"role": "user", "content": "Tell me about lighthouses."}],
         [{"role": "user", "content": "Count to ten, slowly."}],
         describe(IMG_A)]  # the image's rows and deepstack features reach the follower
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)


@pytest.fixture(scope="module")
def outputs(tiny_model):
    """TP=1's and TP=2's outputs of CHATS, and the TP=2 LLM (its group still up)."""
    from epd import LLM

    one = LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu").chat(CHATS, GREEDY)
    two = LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu", tensor_parallel_size=2)
    return one, two.chat(CHATS, GREEDY), two


def test_tp2_greedy_tokens_equal_tp1(outputs):
    one, two, _ = outputs
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == GREEDY.max_tokens
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4  # the sums' order differs: rounding only
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_rank_death_fails_the_group_by_name(outputs):
    """Last in this module: it kills the group."""
    llm = outputs[2]
    (follower,) = llm.engine.runner.model.followers
    os.kill(follower.pid, signal.SIGKILL)
    follower.wait(timeout=10)
    with pytest.raises(GroupFailed, match="tensor-parallel rank 1 .* exited with code -9"):
        llm.chat(CHATS[:1], GREEDY)


def test_shard_runs_and_replicated_kv_heads():
    cfg = SimpleNamespace(num_heads=8, num_kv_heads=2, intermediate_size=64, head_dim=4, vocab_size=10)
    check_divisible(cfg, 4)
    # 2 K/V heads over 4 ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1 (their q heads' group)
    assert [Shard(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [Shard(r, 4).vocab_run(10) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    part = Shard(3, 4).narrowing(cfg)
    assert part("model.layers.0.self_attn.qkv_proj.weight", 0) == (0, 24, 8)  # q heads 6, 7
    assert part("model.layers.0.self_attn.qkv_proj.weight", 2) == (0, 4, 4)  # v head 1
    assert part("model.layers.0.self_attn.o_proj.weight", None) == (1, 24, 8)
    assert part("model.layers.0.mlp.down_proj.weight", None) == (1, 48, 16)
    assert part("model.layers.0.input_layernorm.weight", None) is None
    with pytest.raises(TensorParallelError, match="3 does not divide this model's 8 attention heads"):
        check_divisible(cfg, 3)


def test_what_is_not_sharded_is_refused_by_name():
    lora = EngineConfig.from_flat(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(TensorParallelError, match="--enable-lora"):
        check_supported(lora, "pd", "cpu")
    with pytest.raises(TensorParallelError, match="the decode role"):
        check_supported(EngineConfig(tensor_parallel_size=2), "decode", "cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)
