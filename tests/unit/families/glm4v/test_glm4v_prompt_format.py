"""GLM-4.1V's torch-free side against transformers' Glm4vImageProcessor and
Glm4vProcessor: an image's grid and token count from its size alone, refusals
where the processor refuses, the placeholders' expansion, --mm-processor-kwargs."""
from __future__ import annotations

import pytest
from PIL import Image

from epd.families.glm4v.prompt_format import GLM4V_FORMAT, Glm4vImageGeometry, check_processor_kwargs
from epd.transport.media.video_geometry import VideoPlan

transformers = pytest.importorskip("transformers")

RELEASE_SIZE = {"shortest_edge": 12544, "longest_edge": 9633792}  # GLM-4.1V-9B's preprocessor_config.json
SMALL_SIZE = {"shortest_edge": 2 * 28 * 28 * 2, "longest_edge": 2 * 28 * 28 * 24}
# (width, height): tiny, under one merged patch a side, exact multiples, odd aspects, near the aspect
# bound after the scale-up, large enough for the upper pixel bound
SIZES = [(1, 1), (27, 27), (28, 28), (29, 57), (60, 40), (17, 300), (5, 900), (900, 5), (10, 1990),
         (333, 77), (640, 480), (1920, 1080), (1080, 1920), (4000, 3000), (12000, 61), (7, 7000)]


def _write_processor(path, size: dict) -> str:
    from transformers import Glm4vImageProcessor

    Glm4vImageProcessor(size=size).save_pretrained(path)
    return str(path)


def _processor_patches(processor, width: int, height: int) -> int | None:
    """transformers' patch count for the size, by its own rule; None where it refuses."""
    try:
        return processor.get_number_of_image_patches(height, width)
    except ValueError:
        return None


@pytest.mark.parametrize("size", [RELEASE_SIZE, SMALL_SIZE], ids=["release", "small"])
def test_token_counts_equal_the_processor(tmp_path, size):
    from transformers import AutoImageProcessor

    model_dir = _write_processor(tmp_path, size)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    geometry = GLM4V_FORMAT.image_geometry(model_dir, None)
    refused = 0
    for width, height in SIZES:
        want = _processor_patches(processor, width, height)
        if want is None:
            refused += 1
            with pytest.raises(ValueError):
                geometry.grid_thw(width, height)
            continue
        t, h, w = geometry.grid_thw(width, height)
        assert (t, h * w) == (1, want), (width, height)
        assert geometry.num_image_tokens(width, height) == want // 4
    assert refused >= 1  # (7, 7000) is over the aspect bound; (5, 900) is not, once scaled up


def test_grids_equal_the_processors_on_decoded_images(tmp_path):
    from transformers import AutoImageProcessor

    model_dir = _write_processor(tmp_path, SMALL_SIZE)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    geometry = GLM4V_FORMAT.image_geometry(model_dir, None)
    sizes = [(w, h) for w, h in SIZES if w * h <= 2_000_000 and max(w, h) / min(w, h) < 150]
    images = [Image.new("RGB", size, (seed * 40 % 256, 90, 200)) for seed, size in enumerate(sizes)]
    grids = processor(images=images, return_tensors="pt")["image_grid_thw"].tolist()
    assert [tuple(g) for g in grids] == [geometry.grid_thw(w, h) for w, h in sizes]


def test_empty_images_are_refused(tmp_path):
    geometry = GLM4V_FORMAT.image_geometry(_write_processor(tmp_path, SMALL_SIZE), None)
    for width, height in [(0, 10), (10, 0)]:
        with pytest.raises(ValueError, match="empty dimension"):
            geometry.grid_thw(width, height)


def test_processor_kwargs_size_over_the_files(tmp_path):
    from transformers import AutoImageProcessor

    model_dir = _write_processor(tmp_path, RELEASE_SIZE)
    kwargs = {"size": {"longest_edge": 2 * 28 * 28 * 6}}
    check_processor_kwargs(kwargs)
    geometry = Glm4vImageGeometry.from_pretrained(model_dir, kwargs)
    assert geometry.size == {"shortest_edge": 12544, "longest_edge": 2 * 28 * 28 * 6}
    processor = AutoImageProcessor.from_pretrained(model_dir, size=geometry.size)
    assert geometry.num_image_tokens(1920, 1080) * 4 == processor.get_number_of_image_patches(1080, 1920)
    assert geometry.num_image_tokens(1920, 1080) <= 6 < Glm4vImageGeometry.from_pretrained(
        model_dir).num_image_tokens(1920, 1080)
    for bad in [{"min_pixels": 4}, {"size": {"max_pixels": 4}}, {"size": {"longest_edge": 0}}, {"size": 4}]:
        with pytest.raises(ValueError, match="--mm-processor-kwargs"):
            check_processor_kwargs(bad)


def _glm4v_processor(model_dir: str):
    """transformers' Glm4vProcessor's placeholder replacement on the checkpoint's image
    processor. Its video processor needs torchvision, which is not installed; the
    replacement reads only its merge_size, the image processor's."""
    from transformers import AutoImageProcessor, Glm4vProcessor

    processor = Glm4vProcessor.__new__(Glm4vProcessor)
    processor.image_processor = processor.video_processor = AutoImageProcessor.from_pretrained(model_dir)
    processor.image_token = "<|image|>"
    return processor


def test_image_expansion_equals_the_processors(tmp_path):
    import torch

    model_dir = _write_processor(tmp_path, SMALL_SIZE)
    geometry = GLM4V_FORMAT.image_geometry(model_dir, None)
    processor = _glm4v_processor(model_dir)
    sizes = [(60, 40), (333, 77), (640, 480)]
    grids = torch.tensor([geometry.grid_thw(w, h) for w, h in sizes])
    for i, (width, height) in enumerate(sizes):
        want = processor.replace_image_token({"image_grid_thw": grids}, i)
        assert GLM4V_FORMAT.expand_image(geometry.num_image_tokens(width, height)) == want
    # the chat template's `<|begin_of_image|><|image|><|end_of_image|>`: the middle token is replaced
    assert GLM4V_FORMAT.image_placeholder == GLM4V_FORMAT.image_token == processor.image_token


def test_video_expansion_equals_the_processors(tmp_path):
    import torch
    from transformers.video_utils import VideoMetadata

    processor = _glm4v_processor(_write_processor(tmp_path, SMALL_SIZE))
    # 8 frames sampled from a 30 fps stream: 4 temporal groups of 6 x 4 patches (6 tokens each)
    metadata = VideoMetadata(total_num_frames=300, fps=30.0, frames_indices=[0, 15, 45, 60, 200, 215, 290, 299])
    want = processor.replace_video_token({"video_grid_thw": torch.tensor([[4, 6, 4]]),
                                          "video_metadata": [metadata]}, 0)
    plan = VideoPlan(frame_indices=tuple(metadata.frames_indices), resized_height=84, resized_width=56,
                     grid_thw=(4, 6, 4), num_tokens=24, tokens_per_group=6,
                     group_timestamps_s=tuple(metadata.timestamps[::2]))
    assert GLM4V_FORMAT.expand_video(plan, "<|video|>") == want
    assert want.count("<|image|>") == 24 and want.endswith("<|end_of_image|>9")
    assert GLM4V_FORMAT.video_token == GLM4V_FORMAT.image_token  # a video's positions hold the image token
