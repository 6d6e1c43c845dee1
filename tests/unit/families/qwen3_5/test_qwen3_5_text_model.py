"""Qwen3.5's language side (epd/families/qwen3_5/) against transformers on the tiny dense and MoE
presets, float32: prompt logits in one prefill and over chunks carried through the state slots;
greedy decode of two sequences batched (one decoding while the other prefills) from their own
slots; the release's names load (`mtp.*` ignored, a missing expert named)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.layers.forward_batch import ForwardBatch
from epd.families.qwen3_5.text_loader import load_text_model
from epd.transport.weights.checkpoint import CheckpointError

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 16, 18, 3


@pytest.fixture(scope="module")
def ours(qwen3_5_model):
    return load_text_model(qwen3_5_model, AutoConfig.from_pretrained(qwen3_5_model), torch.float32)


class Caches:
    """A shuffled paged KV cache and a state cache of NUM_SLOTS slots, filled with garbage (a fresh
    sequence must not read its slot's leftovers)."""

    def __init__(self, model):
        cfg, gen = model.cfg, torch.Generator().manual_seed(0)
        shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        self.states = [(torch.randn(NUM_SLOTS, *conv, generator=gen), torch.randn(NUM_SLOTS, *rec, generator=gen))
                       for conv, rec in model.state_shapes()]
        blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        per_slot = NUM_BLOCKS // NUM_SLOTS
        self.blocks = [blocks[i * per_slot:(i + 1) * per_slot] for i in range(NUM_SLOTS)]  # by the sequence's slot

    @torch.inference_mode()
    def step(self, model, seqs: list[tuple[list[int], int, int, int]]) -> torch.Tensor:
        """One forward over sequences (ids, start, end, slot): tokens ids[start:end] of each ->
        their logits [num_tokens, vocab]."""
        positions = torch.cat([model.positions.prompt_positions(end)[0][:, start:end] for _, start, end, _ in seqs], 1)
        meta = AttentionMetadata.build([end - start for _, start, end, _ in seqs], [end for _, _, end, _ in seqs],
                                       [self.blocks[slot] for *_, slot in seqs], BLOCK_SIZE)
        batch = ForwardBatch(positions=positions, attn_meta=meta, backend=get_backend("torch"), kv_caches=self.kv,
                             state_caches=self.states, state_slots=[slot for *_, slot in seqs])
        ids = torch.tensor([t for ids, start, end, _ in seqs for t in ids[start:end]])
        return model.compute_logits(model(ids, batch))


def _reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("chunks", [(), (5, 70, 71)], ids=["one-prefill", "chunks"])
def test_prompt_logits_equal_transformers(ours, qwen3_5_reference, chunks):
    ids = torch.randint(16, 1000, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = _reference_logits(qwen3_5_reference, ids)
    caches, bounds = Caches(ours), (0, *chunks, len(ids))
    logits = torch.cat([caches.step(ours, [(ids, lo, hi, 2)]) for lo, hi in zip(bounds, bounds[1:])])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_batched_greedy_decode_from_own_slots_equals_transformers(ours, qwen3_5_reference):
    gen = torch.Generator().manual_seed(4)
    a = torch.randint(16, 1000, (23,), generator=gen).tolist()
    b = torch.randint(16, 1000, (41,), generator=gen).tolist()
    caches, new_tokens = Caches(ours), 6
    last_a = caches.step(ours, [(a, 0, len(a), 1)])[-1]
    a.append(int(last_a.argmax()))
    # a decodes while b's prompt prefills in two chunks, then both decode in one batch
    logits = caches.step(ours, [(a, len(a) - 1, len(a), 1), (b, 0, 30, 0)])
    a.append(int(logits[0].argmax()))
    logits = caches.step(ours, [(b, 30, len(b), 0), (a, len(a) - 1, len(a), 1)])
    b.append(int(logits[-2].argmax()))
    a.append(int(logits[-1].argmax()))
    for _ in range(new_tokens):
        logits = caches.step(ours, [(a, len(a) - 1, len(a), 1), (b, len(b) - 1, len(b), 0)])
        a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
    for seq, prompt_len in ((a, 23), (b, 41)):
        expected = _reference_logits(qwen3_5_reference, seq[:-1])
        assert seq[prompt_len:] == expected[prompt_len - 1:].argmax(-1).tolist()  # transformers' greedy tokens
        torch.testing.assert_close(logits[0 if seq is a else 1], expected[-1], atol=1e-4, rtol=0)


def test_release_names_load_mtp_ignored_missing_expert_named(qwen3_5_model, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen3_5_model, ckpt)
    save_file({"mtp.fc.weight": torch.zeros(4, 4), "mtp.layers.0.input_layernorm.weight": torch.zeros(4)},
              str(ckpt / "mtp.safetensors"))
    config = AutoConfig.from_pretrained(ckpt)
    model = load_text_model(ckpt, config, torch.float32)  # mtp.* read by nothing, and no error
    assert len(model.state_shapes()) == config.text_config.layer_types.count("linear_attention")
    if not getattr(config.text_config, "num_experts", 0):
        return
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.language_model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.language_model\.layers\.2\.mlp\.experts\.5\."
                                              r"up_proj\.weight'"):
        load_text_model(ckpt, config, torch.float32)

