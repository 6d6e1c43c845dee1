"""Gemma 3's language model (text_model.py, loaded by text_loader.py) against transformers'
Gemma3ForConditionalGeneration on a tiny random checkpoint, float32: our paged forward over the
whole prompt gives its logits; the prompt prefilled in chunks (cut outside images, as the
scheduler cuts for this model) and then decoded greedily, a token a step, gives its greedy
tokens. The images' embeddings come from our vision side; an image's tokens attend to each
other both ways (the processor's `token_type_ids`, our metadata's bidirectional ranges); the
prompts are longer than the checkpoint's sliding window."""
from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.media import IMG_A, IMG_B

from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.layers.forward_batch import ForwardBatch
from epd.families.gemma3.prompt_format import GEMMA3_FORMAT, Gemma3Geometry
from epd.families.gemma3.text_loader import load_text_model
from epd.families.gemma3.vision import load_vision
from epd.inputs.prompt import ImageRef, PromptBuilder
from epd.transport.weights.checkpoint import CheckpointError

BLOCK = 4  # small blocks: a prompt spans many, in a shuffled order
CHATS = {
    "text_only": ([{"role": "user", "content": "Tell me about the red chair, then count: 1 2 3 4 5 6 7 8 9 10 11 "
                                               "12 13 14 15 16 17 18 19 20 21 22 23 24 25."}], []),
    "one_image": ([{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
                  [IMG_A]),
    "two_images": ([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": "Compare them."}]}], [IMG_A, IMG_B]),
}


class Ours:
    """Our modules driven directly on a paged cache with a shuffled block table."""

    def __init__(self, model_dir: str):
        from transformers import AutoConfig, AutoTokenizer

        self.config = AutoConfig.from_pretrained(model_dir)
        self.lm = load_text_model(model_dir, self.config, torch.float32)
        self.vision = load_vision(model_dir, self.config, torch.float32)
        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(model_dir), Gemma3Geometry.from_pretrained(model_dir),
                                     self.config.image_token_index, prompt_format=GEMMA3_FORMAT)
        cfg = self.lm.cfg
        self.num_blocks = 64
        self.blocks = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        shape = (self.num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]

    def prompt(self, messages, images: list) -> tuple[list[int], torch.Tensor | None]:
        """(token ids, the images' embeddings in prompt order or None)."""
        prompt = self.prompts.build(messages, [ImageRef(im.width, im.height, f"{i:064x}") for i, im in enumerate(images)])
        if not images:
            return prompt.token_ids, None
        pixels, metas = self.vision.preprocess(images)
        with torch.no_grad():
            return prompt.token_ids, torch.cat([e.embeddings for e in self.vision.forward(pixels, metas)])

    def image_ranges(self, ids: list[int]) -> list[tuple[int, int]]:
        """The [start, end) runs of image tokens in `ids`: each image's bidirectional range."""
        flags = [t == self.config.image_token_index for t in ids] + [False]
        return [(i, j) for i in range(len(ids)) if flags[i] and (i == 0 or not flags[i - 1])
                for j in [flags.index(False, i)]]

    @torch.inference_mode()
    def step(self, ids: list[int], start: int, mm_embeds: torch.Tensor | None = None,
             ranges: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Tokens start..start+len(ids) of the sequence (those before already cached) -> logits;
        `ranges`: the sequence's image spans (bidirectional)."""
        n, end = len(ids), start + len(ids)
        meta = AttentionMetadata.build([n], [end], [self.blocks[:-(-end // BLOCK)]], BLOCK,
                                       bidirectional_ranges=[list(ranges)])
        positions = self.lm.positions.between(None, 0, end, start, end, "cpu")
        batch = ForwardBatch(positions=positions, attn_meta=meta, backend=get_backend("torch"), kv_caches=self.kv)
        mask = torch.tensor(ids) == self.config.image_token_index
        if mask.any():
            batch.mm_mask, batch.mm_embeds = mask, mm_embeds
        return self.lm.compute_logits(self.lm(torch.tensor(ids), batch))


def _pil(images: list[bytes]):
    from PIL import Image

    return [Image.open(io.BytesIO(b)).convert("RGB") for b in images]


@pytest.fixture(scope="module")
def ours(gemma3_model):
    return Ours(gemma3_model)


def _reference_inputs(processor, messages, images) -> dict:
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=images or None, return_tensors="pt")  # token_type_ids: image tokens


@pytest.mark.parametrize("case", list(CHATS))
def test_prompt_logits_equal_transformers(ours, gemma3_reference, case):
    model, processor = gemma3_reference
    messages, images = CHATS[case][0], _pil(CHATS[case][1])
    ids, mm_embeds = ours.prompt(messages, images)
    inputs = _reference_inputs(processor, messages, images)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = model(**inputs).logits[0]
    assert len(ids) > ours.lm.cfg.sliding_window
    got = ours.step(ids, 0, mm_embeds, ours.image_ranges(ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.topk(5).indices, want.topk(5).indices)


@pytest.mark.parametrize("case", list(CHATS))
def test_chunked_prefill_then_greedy_decode_equal_transformers(ours, gemma3_reference, case):
    model, processor = gemma3_reference
    messages, images = CHATS[case][0], _pil(CHATS[case][1])
    ids, mm_embeds = ours.prompt(messages, images)
    ranges = ours.image_ranges(ids)
    cuts = [next((e for s, e in ranges if s < c < e), c) for c in (len(ids) // 3, 2 * len(ids) // 3)]
    num_mm = 0
    for start, end in zip([0, *cuts], [*cuts, len(ids)]):  # three chunks, none ending inside an image
        chunk = ids[start:end]
        k = sum(t == ours.config.image_token_index for t in chunk)
        logits = ours.step(chunk, start, None if mm_embeds is None else mm_embeds[num_mm:num_mm + k], ranges)
        num_mm += k
    tokens = []
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = ours.step(tokens[-1:], len(ids) + len(tokens) - 1, ranges=ranges)
    inputs = _reference_inputs(processor, messages, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert tokens == out[0, len(ids):].tolist()


def test_loader_reads_the_current_layout_and_names_a_missing_tensor(gemma3_model, ours, tmp_path):
    import shutil

    from transformers import AutoConfig

    copy = shutil.copytree(gemma3_model, tmp_path / "renamed")
    tensors = load_file(copy / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)  # what transformers writes today
    renamed = {("model.language_model." + k[len("language_model.model."):]) if k.startswith("language_model.model.")
               else "model." + k: v for k, v in tensors.items()}
    save_file(renamed, copy / "model.safetensors")
    lm = load_text_model(copy, AutoConfig.from_pretrained(copy), torch.float32)
    for (name, got), want in zip(lm.state_dict().items(), ours.lm.state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)  # tied
    del renamed["model.language_model.layers.2.self_attn.k_proj.weight"]
    save_file(renamed, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.language_model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_text_model(copy, AutoConfig.from_pretrained(copy), torch.float32)


def test_final_logits_are_soft_capped_when_the_config_says_so(ours):
    from dataclasses import replace

    hidden = torch.randn(3, ours.lm.cfg.hidden_size) * 100  # logits well past the cap
    raw, cfg = ours.lm.compute_logits(hidden).detach(), ours.lm.cfg
    assert cfg.final_logit_softcapping is None and raw.abs().max() > 5
    ours.lm.cfg = replace(cfg, final_logit_softcapping=5.0)
    try:
        capped = ours.lm.compute_logits(hidden).detach()
    finally:
        ours.lm.cfg = cfg
    torch.testing.assert_close(capped, 5.0 * torch.tanh(raw / 5.0))


@pytest.mark.parametrize("field, value, named", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "silu", "hidden_activation"),
])
def test_what_is_not_served_is_refused_by_name(gemma3_model, field, value, named):
    from transformers import AutoConfig

    from epd.families.gemma3.text_model import TextConfig

    config = AutoConfig.from_pretrained(gemma3_model)
    setattr(config.text_config, field, value)
    with pytest.raises(ValueError, match=named):
        TextConfig.from_hf(config)
