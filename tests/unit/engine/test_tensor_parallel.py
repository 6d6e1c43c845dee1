"""--tensor-parallel-size 2 on CPU (gloo): the offline LLM's greedy tokens equal TP=1's on the tiny
Qwen3-VL checkpoint (float32; logprobs within rounding), a follower rank's death fails the group
with an error naming it, and what is not sharded yet is refused by name."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch
from testkit.media import IMG_A, describe

from epd.engine.config import EngineConfig
from epd.engine.parallel.comm import GroupFailed
from epd.engine.parallel.leader import check_supported
from epd.engine.parallel.shard import Shard, TensorParallelError, check_divisible
from epd.families.qwen_vl.presets import PRESETS
from epd.tools.make_model import make_model
from epd.transport.wire.sampling import SamplingParams

CHATS = [[{"role": "user", "content": "Tell me about lighthouses."}],
         [{"role": "user", "content": "Count to ten, slowly."}],
         describe(IMG_A)]  # the image's rows and deepstack features reach the follower
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)


@pytest.fixture(scope="module")
def llms(tiny_model):
    """A TP=1 and a TP=2 LLM of the tiny checkpoint."""
    from epd import LLM

    return (LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu"),
            LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu", tensor_parallel_size=2))


def test_tp2_greedy_tokens_equal_tp1(llms):
    one, two = (llm.chat(CHATS, GREEDY) for llm in llms)
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == GREEDY.max_tokens
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(x.logprob - y.logprob) < 1e-4  # the sums' order differs: rounding only
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def _prefill(core, request_id: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """`core` prefills PROMPT: (its first token, the prompt's K and V as the hand-over carries them)."""
    from epd.engine.request import Request

    core.add_request(Request(request_id, list(PROMPT), LONG))
    first = []
    while not first:
        first = [t for u in core.step().updates for t in u.new_token_ids]
    k, v = core.export_kv(request_id)
    core.abort([request_id])
    return first[0], k, v


def _decode(core, request_id: str, first: int, k: torch.Tensor, v: torch.Tensor) -> list[int]:
    """`core` takes the prefilled request and decodes it to its end: every token, the first included."""
    from epd.engine.request import Request

    request = Request(request_id, list(PROMPT), LONG, eos_token_ids=core.info.eos_token_ids)
    request.output_token_ids.append(first)
    assert core.add_prefilled(request, k, v)
    tokens = [first]
    while core.has_unfinished():
        tokens += [t for u in core.step().updates for t in u.new_token_ids]
    return tokens


PROMPT = [(i * 37) % 900 + 10 for i in range(40)]  # 3 blocks of 16, the last one partial
LONG = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_kv_hand_over_between_tp2_and_tp1(llms):
    """Prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2: the KV crosses as every head
    (rank 0 gathers the followers' heads; a receiving group gives each rank its own), and both
    give the tokens TP=1 gives alone."""
    one, two = (llm.engine for llm in llms)
    first_1, k_1, v_1 = _prefill(one, "ref")
    expected = _decode(one, "ref", first_1, k_1, v_1)
    assert len(expected) == LONG.max_tokens
    first_2, k_2, v_2 = _prefill(two, "p2")
    assert k_2.shape == k_1.shape and k_2.shape[3] == one.info.num_kv_heads == 2  # both ranks' heads
    torch.testing.assert_close(k_2, k_1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v_2, v_1, rtol=1e-4, atol=1e-4)
    assert first_2 == first_1
    assert _decode(one, "2to1", first_2, k_2, v_2) == expected
    assert _decode(two, "1to2", first_1, k_1, v_1) == expected


def test_a_stuck_or_dead_rank_fails_the_group_by_name(llms):
    """Last in this module: it breaks the group. A follower that stops answering is named at the
    collective's deadline (shortened here from 60 s); one that died, before the next step."""
    llm = llms[1]
    group = llm.engine.runner.model
    (follower,) = group.followers
    os.kill(follower.pid, signal.SIGSTOP)
    group.comm.shm.timeout_s = 1.0
    with pytest.raises(GroupFailed, match=r"ranks \[1\] did not reach all-reduce"):
        llm.chat(CHATS[:1], GREEDY)
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


def test_what_is_not_sharded_is_refused_by_name(tiny_model):
    from epd.config import ServeConfig, WorkerConfig

    tp2 = EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="with --cluster ray is not served yet"):
        ServeConfig(model=tiny_model, mode="e-p-d", engine=tp2, ray=object())
    ServeConfig(model=tiny_model, mode="e-p-d", engine=tp2)
    split = ServeConfig(model=tiny_model, mode="e-p-d", decode_tensor_parallel_size=2,
                        engine=EngineConfig(device="cpu"))  # prefill TP=1 hands over to decode TP=2
    sizes = {role.value: e.tensor_parallel_size for (role, _), e in zip(split.worker_roles(), split.worker_engines(0))}
    assert sizes == {"encoder": 1, "prefill": 1, "decode": 2}
    with pytest.raises(ValueError, match="--prefill-tensor-parallel-size must be at least 1, got 0"):
        ServeConfig(model=tiny_model, mode="e-p-d", prefill_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="an encoder worker is not sharded"):
        WorkerConfig(model=tiny_model, role="encoder", api="tcp://127.0.0.1:5555", engine=tp2)
    lora = EngineConfig.from_flat(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(TensorParallelError, match="--enable-lora"):
        check_supported(lora, "cpu")
    with pytest.raises(TensorParallelError, match=r"device cuda \(CPU with gloo only so far\)"):
        check_supported(tp2, "cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(tensor_parallel_size=0)


def _forward_logits(model, backend, num_tokens: int) -> torch.Tensor:
    """One prefill of `num_tokens` fixed ids through `model` on a fresh KV cache: logits [num_tokens, vocab]."""
    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.layers.forward_batch import ForwardBatch

    cfg = model.cfg
    kv = torch.zeros(2, cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim)
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0, 1, 2, 3]], 16)
    batch = ForwardBatch(positions=torch.arange(num_tokens).expand(3, -1), attn_meta=meta, backend=backend,
                         kv_caches=[(kv[0, i], kv[1, i]) for i in range(cfg.num_layers)])
    ids = torch.arange(num_tokens) * 37 % cfg.vocab_size
    return model.compute_logits(model(ids, batch))


@torch.inference_mode()
def test_qwen2_5_shards_give_the_whole_models_logits(tmp_path):
    """Qwen2.5-VL (q/k/v biases), one K/V head replicated on both ranks, a tied head and a vocabulary
    that does not split evenly: two ranks in threads of this process (gloo, their own group) give
    the unsharded model's logits, each rank having read only its slices."""
    from transformers import AutoConfig

    from epd.engine.attention import get_backend
    from epd.engine.loader import load_language_model
    from epd.engine.parallel.comm import GroupComm, open_store
    from epd.engine.parallel.follower import load_shard

    preset = dataclasses.replace(PRESETS["qwen2.5-vl-tiny"], num_kv_heads=1, tie_word_embeddings=True, vocab_size=1101)
    path = str(make_model(tmp_path / "ckpt", preset, seed=4))
    backend = get_backend("torch")
    whole = _forward_logits(load_language_model(path, AutoConfig.from_pretrained(path), torch.float32), backend, 20)
    results = {}

    def rank(r: int) -> None:
        shard = Shard(r, 2)
        model = load_shard(path, torch.float32, shard)
        assert model.model.embed_tokens.weight.shape[0] == (551, 550)[r]
        assert model.model.layers[0].self_attn.qkv_proj.bias.shape[0] == (2 + 1 + 1) * preset.head_dim
        shard.comm = GroupComm.connect(open_store(tmp_path, 2, 30), r, 2, 30)
        with torch.inference_mode():
            results[r] = _forward_logits(model, backend, 20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0].shape == whole.shape == (20, 1101)
    torch.testing.assert_close(results[0], whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(results[0].argmax(-1), whole.argmax(-1))


def test_shared_memory_all_reduce_sums_alike_and_has_a_deadline(tmp_path):
    """Two ranks in threads: each call's sum is the same bits on both (slots added in rank order),
    across calls that alternate the file's halves; a rank that never arrives is named at the deadline."""
    from epd.engine.parallel import shm_allreduce

    path = tmp_path / "shm"
    with open(path, "wb") as f:
        f.truncate(shm_allreduce.file_bytes(2, 4096))
    inputs = [[torch.randn(3, 5) * (r + 1) + call for call in range(5)] for r in range(2)]
    results = {}

    def rank(r: int) -> None:
        comm = shm_allreduce.ShmAllReduce(path, r, 2, 4096, timeout_s=10)
        results[r] = [comm.all_reduce(x.clone()) for x in inputs[r]]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for call in range(5):
        assert torch.equal(results[0][call], inputs[0][call] + inputs[1][call])
        assert torch.equal(results[1][call], results[0][call])
    alone = shm_allreduce.ShmAllReduce(path, 0, 2, 4096, timeout_s=0.2)
    assert not alone.fits(torch.zeros(2048))  # 8 KiB: gloo's
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reach all-reduce 6"):
        alone.all_reduce(torch.ones(4))
