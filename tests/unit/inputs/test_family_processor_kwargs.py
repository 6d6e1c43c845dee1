"""--mm-processor-kwargs' image settings are the family's: read before the checkpoint,
a setting no family takes is refused; at start-up, the checkpoint's family decides."""
from __future__ import annotations

import pytest

from epd.inputs.model_files import ModelFiles, ModelFilesConfig, split_processor_kwargs
from epd.transport.weights.checkpoint_error import CheckpointError


def test_a_setting_of_some_family_passes_before_the_checkpoint_is_known():
    assert split_processor_kwargs({"crop_to_patches": True, "max_patches": 6, "fps": 1}) == (
        {"crop_to_patches": True, "max_patches": 6}, {"fps": 1})


@pytest.mark.parametrize("kwargs, message", [
    ({"size_divisor": 2}, "size_divisor cannot be applied here"),
    ({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0},  # Gemma 3's keys, a value it refuses
     "pan_and_scan_min_crop_size 0: a positive integer"),
    ({"min_pixels": 64, "crop_to_patches": True}, "cannot be applied here"),  # no one family takes both
])
def test_a_setting_no_family_takes_is_refused_before_the_checkpoint(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelFilesConfig(mm_processor_kwargs=tuple(kwargs.items()))


def test_the_checkpoints_family_refuses_another_familys_setting(tiny_model):
    config = ModelFilesConfig(mm_processor_kwargs=(("crop_to_patches", True),))  # InternVL's, not Qwen's
    with pytest.raises(CheckpointError, match="crop_to_patches cannot be applied here; the image processor "
                                              "takes min_pixels, max_pixels"):
        ModelFiles.open(tiny_model, config)
    assert ModelFiles.open(tiny_model, ModelFilesConfig(mm_processor_kwargs=(("max_pixels", 4096),))).geometry
