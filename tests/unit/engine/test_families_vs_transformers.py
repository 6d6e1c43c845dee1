"""Qwen3-VL-MoE and Qwen2.5-VL on the same paged engine give exactly
transformers' greedy tokens: prompt logits first, then the 8-request mixed
batch under a KV budget that forces preemption and a token budget that splits
image placeholders across prefill chunks."""
from __future__ import annotations

import pytest
import torch
from testkit.family_checkpoints import family_checkpoint
from testkit.hf_reference import hf_greedy, hf_prompt_logits
from testkit.media import MIXED_BATCH, images_of

from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.image_io import read_image_size
from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.loader import load_language_model
from epd.engine.model_info import ModelInfo
from epd.families.qwen_vl.mrope import mrope_positions
from epd.engine.layers.forward_batch import ForwardBatch
from epd.inputs.prompt import ImageRef, PromptBuilder
from epd.transport.wire.sampling import SamplingParams
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT

FAMILIES = ["qwen3_vl_moe", "qwen2_5_vl"]
CONVERSATIONS = MIXED_BATCH
NUM_TOKENS = 12


@torch.inference_mode()
def _prompt_logits(model_dir: str, messages, images) -> tuple[list[int], torch.Tensor]:
    """Our modules driven directly: one full-prompt forward on a shuffled paged cache."""
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(model_dir)
    info = ModelInfo.from_pretrained(model_dir, hf_config)
    lm = load_language_model(model_dir, hf_config, torch.float32)
    encoder = ImageEncoder(model_dir, hf_config, torch.float32, model_fingerprint=info.fingerprint)
    prompts = PromptBuilder(AutoTokenizer.from_pretrained(model_dir), encoder.vision.geometry, info.image_token_id,
                            prompt_format=QWEN_VL_FORMAT)
    prompt = prompts.build(messages, [ImageRef(*read_image_size(b), encoder.mm_hash(b)) for b in images])
    ids, n = prompt.token_ids, len(prompt.token_ids)
    cfg, block_size, num_blocks = lm.cfg, 16, n // 16 + 2
    kv = [(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    positions, _ = mrope_positions(n, prompt.mm_spans, info.spatial_merge_size)
    batch = ForwardBatch(positions=positions, attn_meta=AttentionMetadata.build([n], [n], [blocks], block_size),
                         backend=get_backend("torch"), kv_caches=kv)
    encoded = encoder.encode(images)
    batch.mm_mask = torch.tensor(ids) == info.image_token_id
    batch.mm_embeds = torch.cat([e.embeddings for e in encoded])
    if encoded[0].extras:
        batch.mm_extras = {k: torch.cat([e.extras[k] for e in encoded]) for k in encoded[0].extras}
    return ids, lm.compute_logits(lm(torch.tensor(ids), batch))


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family):
    model_dir = family_checkpoint(family)
    messages = CONVERSATIONS[7]  # two images of odd aspect ratios
    ref_ids, ref_logits = hf_prompt_logits(model_dir, messages, images_of(messages))
    ids, logits = _prompt_logits(model_dir, messages, images_of(messages))
    assert ids == ref_ids, "prompt token ids differ (placeholder counts from size alone?)"
    assert logits.shape[-1] == 1100  # the padded vocabulary
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_GPU])  # cuda runs the Triton attention and fused-MoE kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_with_preemption_and_split_images(family, device):
    from epd import LLM

    model_dir = family_checkpoint(family)
    expected = [hf_greedy(model_dir, c, images_of(c), num_tokens=NUM_TOKENS) for c in CONVERSATIONS]
    llm = LLM(model_dir, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=8, dtype="float32", device=device)
    assert llm.engine.info.family == family
    scheduler = llm.engine.scheduler
    split_inside_image = []
    original = scheduler.schedule

    def recording_schedule():
        out = original()
        split_inside_image.extend(s.request_id for s in out.scheduled for span in s.request.mm_spans
                                  if span.offset < s.end < span.end)
        return out

    scheduler.schedule = recording_schedule
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert split_inside_image, "the token budget was meant to split an image's placeholders"
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks
