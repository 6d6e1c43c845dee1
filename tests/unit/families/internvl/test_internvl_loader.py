"""InternVL's loaders on the layouts a release has: the *-hf names transformers
writes (`language_model.model.*`, `vision_tower.*`), its in-memory names
(`model.language_model.*`, `model.vision_tower.*`, `lm_head.weight`) in
sharded files with an index, a tied head, and what they refuse by name."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd.families.internvl.presets import PRESETS
from epd.tools.make_model import make_model
from epd.families.internvl.text_loader import load_text_model
from epd.families.internvl.text_model import text_config
from epd.families.internvl.vision import load_vision_weights
from epd.transport.weights.checkpoint import CheckpointError

_NEW_NAMES = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
              "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}


def _config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _renamed_and_sharded(src, dst):
    """The checkpoint with transformers' in-memory names, in two shards and an index."""
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        old = next(p for p in _NEW_NAMES if name.startswith(p))
        tensors[_NEW_NAMES[old] + name[len(old):]] = t
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(dst / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("preset", ["internvl-tiny", "internvl-moe-tiny"])
def test_both_name_layouts_and_shards_load_the_same_weights(preset, tmp_path):
    src, dst = tmp_path / "hf", tmp_path / "sharded"
    dst.mkdir()
    make_model(src, preset)
    _renamed_and_sharded(src, dst)
    for load in (load_text_model, load_vision_weights):
        a, b = load(src, _config(src), torch.float32), load(dst, _config(dst), torch.float32)
        state_a, state_b = a.state_dict(), b.state_dict()
        assert state_a.keys() == state_b.keys()
        for name in state_a:
            assert torch.equal(state_a[name], state_b[name]), name


def test_a_tied_head_is_the_embeddings(tmp_path):
    make_model(tmp_path, dataclasses.replace(PRESETS["internvl-tiny"], tie_word_embeddings=True))
    assert not any(k.endswith("lm_head.weight") for k in load_file(str(tmp_path / "model.safetensors")))
    lm = load_text_model(tmp_path, _config(tmp_path), torch.float32)
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight)


def test_a_missing_tensor_is_named(tmp_path):
    make_model(tmp_path, "internvl-tiny")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["language_model.model.layers.1.self_attn.k_proj.weight"]
    del tensors["vision_tower.encoder.layer.0.lambda_2"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="model.language_model.layers.1.self_attn.k_proj.weight"):
        load_text_model(tmp_path, _config(tmp_path), torch.float32)
    with pytest.raises(CheckpointError, match="model.vision_tower.encoder.layer.0.lambda_2"):
        load_vision_weights(tmp_path, _config(tmp_path), torch.float32)


def test_what_the_decoder_cannot_serve_is_refused_by_name(tmp_path):
    make_model(tmp_path, "internvl-tiny")
    cfg = _config(tmp_path)
    assert text_config(cfg).mrope_section == (8, 0, 0)  # every frequency on the one position row
    cfg.text_config.use_sliding_window = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        text_config(cfg)
    cfg.text_config.use_sliding_window = False
    cfg.text_config.model_type = "llama"
    with pytest.raises(ValueError, match="'llama' language model is not supported"):
        text_config(cfg)
