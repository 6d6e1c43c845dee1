"""Our Qwen3-VL (vision tower + paged language model) against transformers'
Qwen3VLForConditionalGeneration on the same tiny checkpoint, in float32."""
from __future__ import annotations

import pytest
import torch
from testkit.hf_reference import hf_greedy, hf_prompt_logits
from testkit.media import CHATS

from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.image_io import read_image_size
from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.loader import load_language_model
from epd.engine.model_info import ModelInfo
from epd.families.qwen_vl.mrope import mrope_positions
from epd.engine.layers.forward_batch import ForwardBatch
from epd.transport.wire.sampling import SamplingParams
from epd.inputs.prompt import ImageRef, PromptBuilder
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT

CASES = CHATS  # text only, one image, two images, multi-turn (tests/testkit/media.py)


class OurModel:
    """Our modules driven directly: one full-prompt forward with all logits."""

    def __init__(self, model_dir: str):
        from transformers import AutoConfig, AutoTokenizer

        hf_config = AutoConfig.from_pretrained(model_dir)
        self.info = ModelInfo.from_pretrained(model_dir, hf_config)
        self.lm = load_language_model(model_dir, hf_config, torch.float32)
        self.encoder = ImageEncoder(model_dir, hf_config, torch.float32, model_fingerprint=self.info.fingerprint)
        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(model_dir), self.encoder.vision.geometry,
                                     self.info.image_token_id, prompt_format=QWEN_VL_FORMAT)

    @torch.inference_mode()
    def prompt_logits(self, messages, images) -> tuple[list[int], torch.Tensor]:
        refs = [ImageRef(*read_image_size(b), self.encoder.mm_hash(b)) for b in images]
        prompt = self.prompts.build(messages, refs)
        ids, n = prompt.token_ids, len(prompt.token_ids)
        block_size, num_blocks = 16, n // 16 + 2
        cfg = self.lm.cfg
        kv = [(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
        # A shuffled block table: the paged path must not depend on contiguity.
        blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        positions, _ = mrope_positions(n, prompt.mm_spans, self.info.spatial_merge_size)
        batch = ForwardBatch(positions=positions, attn_meta=AttentionMetadata.build([n], [n], [blocks], block_size),
                             backend=get_backend("torch"), kv_caches=kv)
        if images:
            encoded = self.encoder.encode(images)
            batch.mm_mask = torch.tensor(ids) == self.info.image_token_id
            batch.mm_embeds = torch.cat([e.embeddings for e in encoded])
            if encoded[0].extras:  # Qwen2.5-VL has none
                batch.mm_extras = {k: torch.cat([e.extras[k] for e in encoded]) for k in encoded[0].extras}
        return ids, self.lm.compute_logits(self.lm(torch.tensor(ids), batch))


@pytest.fixture(scope="module")
def ours(tiny_model):
    return OurModel(tiny_model)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_match_transformers(ours, tiny_model, case):
    messages, images = CASES[case]
    ref_ids, ref_logits = hf_prompt_logits(tiny_model, messages, images)
    ids, logits = ours.prompt_logits(messages, images)
    assert ids == ref_ids, "prompt token ids differ (placeholder counts from size alone?)"
    assert len(images) == 0 or (torch.tensor(ids) == ours.info.image_token_id).sum() > 0
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(llm, tiny_model, case):
    messages, images = CASES[case]
    expected = hf_greedy(tiny_model, messages, images, num_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.chat([messages], params)[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "length"
