"""InternVL's pieces against transformers' InternVLForConditionalGeneration on
tiny random checkpoints from the family's presets, float32: the vision side
(tower, pixel-unshuffle, projector) equals `get_image_features`; the prompt's
token ids equal transformers' whole InternVLProcessor's (tile counts from the
image size alone); the language model's prompt logits equal transformers'
(text, one image, two images, several turns): Qwen3 dense and MoE, and Qwen2
(InternVL3)."""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image
from testkit.media import CHATS
from testkit.video_reference import VideoClips, hf_processor_inputs, reference_available

from epd.encoders.image_io import read_image_size
from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.layers.forward_batch import ForwardBatch
from epd.families.internvl.image_processor import TilePreprocessor
from epd.families.internvl.presets import PRESETS
from epd.tools.make_model import make_model
from epd.families.internvl.prompt_format import INTERNVL_FORMAT
from epd.families.internvl.text_loader import load_text_model
from epd.families.internvl.vision import load_vision
from epd.inputs.prompt import ImageRef, PromptBuilder

TINY = PRESETS["internvl-tiny"]
# the tower's other options: a hidden layer's features (no final norm), RMSNorm blocks, q/k norm
ODD_TOWER = dataclasses.replace(TINY, vision_feature_layer=-2, vision_layers=3, use_mean_pooling=False,
                                use_qk_norm=True, norm_type="rms_norm", tie_word_embeddings=True)
FINAL_NORM = dataclasses.replace(TINY, use_mean_pooling=False)  # the last layer through the tower's final LayerNorm


# InternVL3's language model: Qwen2 (q/k/v biases, no q/k norm, head_dim = hidden / heads)
QWEN2 = dataclasses.replace(TINY, text_model_type="qwen2")
CHECKPOINTS = {"internvl-tiny": "internvl-tiny", "internvl-moe-tiny": "internvl-moe-tiny", "qwen2": QWEN2}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp(request.param), CHECKPOINTS[request.param]))


def _reference(model_dir: str):
    from transformers import AutoConfig, InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return AutoConfig.from_pretrained(model_dir), model


def _images(data: list[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(b)).convert("RGB") for b in data]


@pytest.mark.parametrize("preset", [TINY, ODD_TOWER, FINAL_NORM], ids=["tiny", "odd_tower", "final_norm"])
def test_image_features_match_transformers(preset, tmp_path):
    model_dir = str(make_model(tmp_path, preset))
    hf_config, ref = _reference(model_dir)
    images = [Image.effect_noise((150, 70), 60).convert("RGB"), Image.effect_noise((40, 200), 30).convert("RGB"),
              Image.effect_noise((64, 64), 90).convert("RGB")]
    ours = load_vision(model_dir, hf_config, torch.float32)
    pixel_values, metas = ours.preprocess(images)
    # 2x1 + thumbnail, 1x5 + thumbnail (max_patches 6), one tile; 8x8 patches a tile
    assert metas == [{"num_tiles": 3}, {"num_tiles": 6}, {"num_tiles": 1}]
    assert [ours.patches(*image.size) for image in images] == [192, 384, 64]
    with torch.no_grad():
        want = ref.model.get_image_features(pixel_values=pixel_values).pooler_output  # [tiles, 16, hidden]
        entries = ours(pixel_values, metas)
    assert [tuple(e.embeddings.shape) for e in entries] == [(48, 64), (96, 64), (16, 64)]
    assert [e.meta for e in entries] == metas
    torch.testing.assert_close(torch.cat([e.embeddings for e in entries]), want.reshape(-1, want.shape[-1]),
                               atol=1e-5, rtol=0)


def _prompt_logits(model_dir: str, messages, images: list[bytes]):
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(model_dir)
    lm = load_text_model(model_dir, hf_config, torch.float32)
    vision = load_vision(model_dir, hf_config, torch.float32)
    builder = PromptBuilder(AutoTokenizer.from_pretrained(model_dir), vision.geometry, hf_config.image_token_id,
                            prompt_format=INTERNVL_FORMAT)
    prompt = builder.build(messages, [ImageRef(*read_image_size(b), f"{i:064x}") for i, b in enumerate(images)])
    ids, n = prompt.token_ids, len(prompt.token_ids)
    cfg, block_size = lm.cfg, 16
    num_blocks = n // block_size + 2
    kv = [(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    positions, delta = lm.positions.prompt_positions(n, prompt.mm_spans)
    assert delta == 0 and positions.shape == (1, n)
    batch = ForwardBatch(positions=positions, attn_meta=AttentionMetadata.build([n], [n], [blocks], block_size),
                         backend=get_backend("torch"), kv_caches=kv)
    if images:
        pixel_values, metas = vision.preprocess(_images(images))
        assert metas == [s.meta for s in prompt.mm_spans]
        batch.mm_mask = torch.tensor(ids) == hf_config.image_token_id
        with torch.inference_mode():
            batch.mm_embeds = torch.cat([e.embeddings for e in vision(pixel_values, metas)])
    with torch.inference_mode():
        return ids, prompt.mm_spans, lm.compute_logits(lm(torch.tensor(ids), batch))


@pytest.mark.skipif(not reference_available(), reason="transformers' whole processor needs the reference torchvision")
@pytest.mark.parametrize("case", list(CHATS))
def test_prompt_ids_and_logits_match_transformers(checkpoint, case, tmp_path):
    messages, images = CHATS[case]
    ids, spans, logits = _prompt_logits(checkpoint, messages, images)
    hf_config, ref = _reference(checkpoint)
    text = PromptBuilder(_tokenizer(checkpoint), None, hf_config.image_token_id,
                         prompt_format=INTERNVL_FORMAT).render(messages)
    ref_ids = hf_processor_inputs(checkpoint, text, VideoClips([], {}, tmp_path), images)["input_ids"]
    assert ids == ref_ids[0].tolist(), "prompt token ids differ from InternVLProcessor's"
    assert [s.length for s in spans] == [TilePreprocessor(checkpoint).geometry.num_image_tokens(*read_image_size(b))
                                         for b in images]
    inputs = {"input_ids": ref_ids}
    if images:
        from transformers import AutoImageProcessor

        out = AutoImageProcessor.from_pretrained(checkpoint)(_images(images), crop_to_patches=True,
                                                             return_tensors="pt")
        inputs["pixel_values"] = out["pixel_values"]
    with torch.no_grad():
        ref_logits = ref(**inputs).logits[0]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
