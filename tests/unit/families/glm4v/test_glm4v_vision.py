"""GLM-4.1V's vision side against transformers on a tiny random checkpoint
(float32): the tower's embeddings equal Glm4vForConditionalGeneration's
get_image_features (and get_video_features for a grid of several temporal
groups), the preprocessing is the checkpoint's own processor's."""
from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from epd.families.glm4v.vision import load_vision

transformers = pytest.importorskip("transformers")

# (width, height): a small one scaled up, a thin one (a side under one merged patch), odd aspects,
# one the pixel bound shrinks
SIZES = [(60, 40), (17, 300), (200, 90), (333, 77), (500, 500), (90, 200)]


def _image(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()))


TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5})
# GLM-4.5V: the same tower before a MoE language model
MOE_TEXT = dict(TEXT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=0)


@pytest.fixture(scope="module", params=["glm4v", "glm4v_moe"])
def checkpoint(request, tmp_path_factory) -> str:
    """A tiny random Glm4v(Moe)ForConditionalGeneration saved with its image processor beside it."""
    from transformers import Glm4vImageProcessor

    prefix = "Glm4v" if request.param == "glm4v" else "Glm4vMoe"
    path = tmp_path_factory.mktemp(request.param)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=TEXT if request.param == "glm4v" else MOE_TEXT,
        # 3 heads of 16; MLP width out_hidden (64); a position table of 8 x 8 patches
        vision_config=dict(depth=2, hidden_size=48, num_heads=3, out_hidden_size=64, intermediate_size=80,
                           image_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=250, video_token_id=251, image_start_token_id=246, image_end_token_id=247,
        video_start_token_id=248, video_end_token_id=249)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # weights of unit gain (outputs of order 1, not 1e-3), norms and biases not 1 and 0
        for name, p in model.model.visual.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5 if "position" not in name else 1.0)
    model.save_pretrained(path)
    # between 2 and 24 merged tokens of 28 x 28 pixels (each counted twice: a temporal patch of 2)
    Glm4vImageProcessor(size={"shortest_edge": 2 * 28 * 28 * 2, "longest_edge": 2 * 28 * 28 * 24}).save_pretrained(path)
    # the release's video processor keys (Glm4vVideoProcessor itself needs torchvision, not installed)
    video = {"video_processor_type": "Glm4vVideoProcessor", "size": {"shortest_edge": 12544, "longest_edge": 47040000},
             "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "do_rescale": True,
             "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vision(checkpoint):
    from transformers import AutoConfig

    return load_vision(checkpoint, AutoConfig.from_pretrained(checkpoint), torch.float32, "cpu")


def test_image_embeddings_equal_transformers(checkpoint, reference, vision):
    from transformers import AutoImageProcessor

    images = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    pixel_values, metas = vision.preprocess(images)
    hf = AutoImageProcessor.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    assert [m["grid_thw"] for m in metas] == [tuple(g) for g in hf["image_grid_thw"].tolist()]
    assert torch.equal(pixel_values, hf["pixel_values"])
    assert len({m["grid_thw"] for m in metas}) > 3  # the sizes give different grids

    entries = vision.forward(pixel_values, metas)
    with torch.no_grad():
        want = reference.get_image_features(hf["pixel_values"], hf["image_grid_thw"]).pooler_output
    assert len(entries) == len(images)
    for entry, meta, w, (width, height) in zip(entries, metas, want, SIZES):
        assert entry.meta == meta == vision.geometry.span_meta(width, height) and entry.extras == {}
        assert entry.embeddings.shape == (vision.geometry.num_image_tokens(width, height), 64)
        torch.testing.assert_close(entry.embeddings, w, atol=1e-5, rtol=1e-5)


def test_one_image_alone_equals_its_place_in_a_batch(vision):
    images = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES[:3])]
    batch = vision.forward(*vision.preprocess(images))
    alone = vision.forward(*vision.preprocess(images[1:2]))
    torch.testing.assert_close(alone[0].embeddings, batch[1].embeddings, atol=1e-5, rtol=1e-5)


def test_temporal_groups_attend_apart_as_transformers_video_features(reference, vision):
    """A grid of 3 temporal groups (a video's): positions per group, attention within each."""
    t, h, w = 3, 6, 4
    gen = torch.Generator().manual_seed(5)
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=gen)
    ours = vision.tower(pixels, [(t, h, w)])
    with torch.no_grad():
        want = reference.get_video_features(pixels, torch.tensor([[t, h, w]])).pooler_output
    torch.testing.assert_close(ours[0], want[0], atol=1e-5, rtol=1e-5)
    assert ours[0].shape == (t * h * w // 4, 64)


def test_patches_are_the_towers_work(vision):
    for width, height in SIZES:
        t, h, w = vision.geometry.grid_thw(width, height)
        assert vision.patches(width, height) == t * h * w == 4 * vision.geometry.num_image_tokens(width, height)


def test_packed_cpu_linears_and_bfloat16_keep_the_embeddings(checkpoint, vision):
    """What the encoder runs: the tower's linears packed for oneDNN (float32 CPU), and bfloat16."""
    from transformers import AutoConfig

    from epd.transport.weights.cpu_linear import pack_linears

    images = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES[:3])]
    inputs, metas = vision.preprocess(images)
    want = vision.forward(inputs, metas)
    packed = load_vision(checkpoint, AutoConfig.from_pretrained(checkpoint), torch.float32)
    num_packed = pack_linears(packed.tower)
    for got, w in zip(packed.forward(inputs, metas), want):
        torch.testing.assert_close(got.embeddings, w.embeddings, atol=1e-5, rtol=1e-5)
    half = load_vision(checkpoint, AutoConfig.from_pretrained(checkpoint), torch.bfloat16)
    for got, w in zip(half.forward(inputs, metas), want):
        assert got.embeddings.dtype == torch.bfloat16 and half.tower.inv_freq.dtype == torch.float32
        torch.testing.assert_close(got.embeddings.float(), w.embeddings, atol=0.1, rtol=0.05)
    assert num_packed in (0, 2 * 5 + 4)  # every linear (5 a block, 4 in the merger), where this CPU packs them


@pytest.mark.parametrize("prefix", ["Glm4v", "Glm4vMoe"])
def test_release_sized_tower_has_transformers_tensor_names_and_shapes(prefix):
    """GLM-4.1V-9B's and GLM-4.5V's vision configs (transformers' defaults): every
    tensor of transformers' tower is one of ours, of the same shape, and no more."""
    from epd.families.glm4v.vision import Glm4vVisionTower, TowerConfig

    vision_config = getattr(transformers, f"{prefix}VisionConfig")()
    with torch.device("meta"):
        ours = Glm4vVisionTower(TowerConfig.from_hf(vision_config))
        theirs = getattr(transformers, f"{prefix}VisionModel")._from_config(vision_config)
    want = {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == want
    assert want["embeddings.position_embedding.weight"] == (576, 1536)  # 24 x 24 patches of 14 at 336


def test_a_missing_or_unknown_vision_tensor_is_named(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from epd.transport.weights.checkpoint_error import CheckpointError

    def variant(name: str, edit) -> str:
        path = tmp_path / name
        shutil.copytree(checkpoint, path)
        (shard,) = path.glob("*.safetensors")
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
        return str(path)

    config = AutoConfig.from_pretrained(checkpoint)
    missing = variant("missing", lambda t: t.pop("model.visual.merger.up_proj.weight"))
    with pytest.raises(CheckpointError, match="model.visual.merger.up_proj.weight"):
        load_vision(missing, config, torch.float32)
    extra = variant("extra", lambda t: t.update({"model.visual.blocks.0.attn.qkv.bias": torch.zeros(144)}))
    with pytest.raises(CheckpointError, match="model.visual.blocks.0.attn.qkv.bias"):
        load_vision(extra, config, torch.float32)


def test_a_video_through_the_encoder_equals_transformers_video_features(checkpoint, reference, vision):
    """A video's bytes, planned from its header as GLM-4.1V's processor samples it, through
    the encoder (decode, preprocess, the tower a group at a time): one entry per temporal
    group, keyed as its span, equal to get_video_features on the same pixels."""
    from testkit.videos import encode_video, synthetic_frames

    from epd.encoders.video_encoder import VideoEncoder
    from epd.encoders.video_io import decode_frames, read_video_meta
    from epd.encoders.video_processor import VideoPreprocessor
    from epd.families.glm4v.video_geometry import Glm4vVideoGeometry
    from epd.transport.media.video_geometry import VideoGeometry
    from epd.transport.media.video_keys import entry_hashes

    data = encode_video(synthetic_frames(12, height=60, width=90), fps=5)  # 2.4 s: 4 frames at 2 fps
    plan = Glm4vVideoGeometry.from_pretrained(checkpoint).plan(read_video_meta(data))
    assert plan.frame_indices == (0, 3, 5, 8) and plan.grid_thw == (2, 4, 6)
    assert plan.group_timestamps_s == (0.0, 1.0)
    video_hash = "ab" * 32
    pairs = VideoEncoder(checkpoint, vision, max_batch_patches=24).encode(data, plan, video_hash)  # a group a pass
    assert [key for key, _ in pairs] == entry_hashes(video_hash, plan)
    assert [entry.meta for _, entry in pairs] == [{"grid_thw": (1, 4, 6)}] * 2

    pixels, grid = VideoPreprocessor(VideoGeometry.from_pretrained(checkpoint))(
        decode_frames(data, plan.frame_indices), plan)
    with torch.no_grad():
        want = reference.get_video_features(pixels, torch.tensor([grid])).pooler_output[0]
    got = torch.cat([entry.embeddings for _, entry in pairs])
    assert got.shape == (plan.num_tokens, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_tower_gives_the_cpus_embeddings(checkpoint, vision):
    """CUDA's attention kernels, bicubic sampling and convolutions (TF32 where torch allows it)."""
    from transformers import AutoConfig

    images = [_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    inputs, metas = vision.preprocess(images)
    want = vision.forward(inputs, metas)
    cuda = load_vision(checkpoint, AutoConfig.from_pretrained(checkpoint), torch.float32, "cuda")
    for got, w in zip(cuda.forward(inputs, metas), want):
        assert got.embeddings.device.type == "cuda"
        torch.testing.assert_close(got.embeddings.cpu(), w.embeddings, atol=5e-3, rtol=5e-3)
