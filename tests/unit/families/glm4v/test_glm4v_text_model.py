"""GLM-4.1V's and GLM-4.5V's language side (epd/families/glm4v/) against
transformers' Glm4vForConditionalGeneration / Glm4vMoeForConditionalGeneration
on tiny random checkpoints from their presets, float32: our positions equal
its get_rope_index (images, a video's frame groups between timestamps), and
our paged text model gives its logits on a text prompt and on a prompt whose
image and video placeholders carry injected embeddings at 3-D positions, in
one prefill and in several chunks."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from testkit.family_checkpoints import family_checkpoint

from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.layers.forward_batch import ForwardBatch
from epd.families.glm4v.positions import Glm4vPositions
from epd.families.glm4v.text_loader import load_text_model
from epd.transport.wire.mm_span import MMSpan

BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=["glm4v", "glm4v_moe"])
def checkpoint(request) -> str:
    """GLM-4.1V: 5 query heads over 1 KV head, 8 rotary dims; GLM-4.5V: head_dim 24 (not hidden / heads),
    two dense then two MoE layers, grouped routing, shared experts, a tied head (testkit/family_checkpoints.py)."""
    return family_checkpoint(request.param)


@lru_cache(maxsize=2)
def _reference(model_dir: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model_cls = getattr(transformers, config.architectures[0])
    return model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@lru_cache(maxsize=2)
def _ours(model_dir: str):
    from transformers import AutoConfig

    return load_text_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)


def _mm_prompt(config, image_grid=(1, 4, 6), video_grid=(2, 4, 4)) -> tuple[list[int], list[int], list[MMSpan]]:
    """Token ids of a prompt as Glm4vProcessor expands it: text, an image, text, a video of
    `video_grid[0]` frame groups (each `<|begin_of_image|>` pads `<|end_of_image|>` then its
    timestamp), text; with transformers' mm_token_type_ids and our spans (one per image or group)."""
    ids, types, spans = [101, 102, 103], [0, 0, 0], []

    def place(grid, kind):
        n = grid[1] * grid[2] // 4  # merged 2 x 2
        ids.append(config.image_start_token_id)
        spans.append(MMSpan(len(ids), n, f"item{len(spans)}", {"grid_thw": (1, grid[1], grid[2])}))
        ids.extend([config.image_token_id] * n)
        ids.append(config.image_end_token_id)
        types.extend([0] + [kind] * n + [0])

    place(image_grid, 1)
    ids += [104, 105]
    types += [0, 0]
    ids.append(config.video_start_token_id)
    types.append(0)
    for group in range(video_grid[0]):
        place(video_grid, 2)
        ids.append(200 + group)  # the timestamp
        types.append(0)
    ids += [config.video_end_token_id, 106, 107, 108]
    types += [0, 0, 0, 0]
    return ids, types, spans


def test_positions_are_transformers_get_rope_index(checkpoint):
    ref = _reference(checkpoint)
    ids, types, spans = _mm_prompt(ref.config)
    expected, expected_delta = ref.model.get_rope_index(
        torch.tensor([ids]), torch.tensor([types]), image_grid_thw=torch.tensor([[1, 4, 6]]),
        video_grid_thw=torch.tensor([[2, 4, 4]]))
    rule = _ours(checkpoint).positions
    rule.check_spans(spans)
    positions, delta = rule.prompt_positions(len(ids), spans)
    assert rule.position_dims == 3
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta) and delta < 0  # the grids take fewer positions than tokens
    # tokens past the prompt: index + delta in every row, as transformers' cached decoding places them
    assert rule.between(positions, delta, len(ids), len(ids) - 2, len(ids) + 3, "cpu")[:, 2:].tolist() == \
        [list(range(len(ids) + delta, len(ids) + delta + 3))] * 3


def test_positions_refuse_what_glm_never_sends():
    rule = Glm4vPositions(spatial_merge_size=2)
    with pytest.raises(ValueError, match="second_per_grid_t"):
        rule.check_spans([MMSpan(3, 4, "v", {"grid_thw": (1, 4, 4), "second_per_grid_t": 0.5})])
    with pytest.raises(ValueError, match="one image or frame group"):
        rule.check_spans([MMSpan(3, 8, "v", {"grid_thw": (2, 4, 4)})])
    with pytest.raises(ValueError, match="does not give"):
        rule.check_spans([MMSpan(3, 5, "i", {"grid_thw": (1, 4, 4)})])


@torch.inference_mode()
def _our_logits(model, ids: list[int], positions: torch.Tensor, mm_mask=None, mm_embeds=None,
                chunks: tuple[int, ...] = ()) -> torch.Tensor:
    """Our logits of every prompt token, prefilled in one step or cut at `chunks`, on a
    shuffled paged cache (the paged path must not depend on contiguity)."""
    n, cfg = len(ids), model.cfg
    num_blocks = n // BLOCK_SIZE + 2
    kv = [(torch.zeros(num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    bounds = [0, *chunks, n]
    logits = []
    for start, end in zip(bounds, bounds[1:]):
        batch = ForwardBatch(positions=positions[:, start:end],
                             attn_meta=AttentionMetadata.build([end - start], [end], [blocks], BLOCK_SIZE),
                             backend=get_backend("torch"), kv_caches=kv)
        if mm_mask is not None:
            batch.mm_mask = mm_mask[start:end]
            before = int(mm_mask[:start].sum())
            batch.mm_embeds = mm_embeds[before:before + int(batch.mm_mask.sum())]
        logits.append(model.compute_logits(model(torch.tensor(ids[start:end]), batch)))
    return torch.cat(logits)


def test_text_prompt_logits_match_transformers(checkpoint):
    ref, ours = _reference(checkpoint), _ours(checkpoint)
    ids = torch.randint(16, 1024, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        expected = ref(input_ids=torch.tensor([ids])).logits[0]
    positions, _ = ours.positions.prompt_positions(len(ids))
    logits = _our_logits(ours, ids, positions)
    assert logits.shape == (37, 1100)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("chunks", [(), (6, 17, 27)], ids=["one-prefill", "chunks-through-items"])
def test_injected_embeddings_at_3d_positions_match_transformers(checkpoint, chunks):
    ref, ours = _reference(checkpoint), _ours(checkpoint)
    ids, types, spans = _mm_prompt(ref.config)
    assert len(ids) == 32 and [(s.offset, s.end) for s in spans] == [(4, 10), (15, 19), (22, 26)]  # cuts inside items
    mask = torch.tensor(types) > 0
    embeds = torch.randn(int(mask.sum()), ours.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    positions, _ = ours.positions.prompt_positions(len(ids), spans)
    with torch.inference_mode():
        inputs_embeds = ref.model.language_model.embed_tokens(torch.tensor([ids]))
        inputs_embeds[0, mask] = embeds
        hidden = ref.model.language_model(inputs_embeds=inputs_embeds, position_ids=positions[:, None]).last_hidden_state
        expected = ref.lm_head(hidden)[0]
    logits = _our_logits(ours, ids, positions, mask, embeds, chunks)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # the embeddings matter: the same prompt with the placeholders' own embeddings differs
    assert not torch.allclose(_our_logits(ours, ids, positions), expected, atol=1e-2)
