"""The `epd` command as a user runs it: a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epd.encoders.video_io import decode_frames, read_video_meta
from testkit.hf_reference import hf_generate_text
from testkit.media import image_bytes, image_part
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames


def run_epd(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "epd.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_make_model_writes_a_hf_checkpoint(tmp_path):
    out = tmp_path / "m"
    proc = run_epd("make-model", str(out), "--preset", "tiny", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        assert (out / name).exists(), name
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|image_pad|>" in tok_cfg["chat_template"] and "<|video_pad|>" in tok_cfg["chat_template"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    for special in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                    "<|endoftext|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_chat_prints_transformers_greedy_text(tiny_model, tmp_path):
    img = image_bytes(120, 80, seed=5)
    path = tmp_path / "picture.png"
    path.write_bytes(img)
    proc = run_epd("chat", tiny_model, "--prompt", "What is in this picture?", "--image", str(path),
                   "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    messages = [{"role": "user", "content": [image_part(img), {"type": "text", "text": "What is in this picture?"}]}]
    assert proc.stdout.rstrip("\n") == hf_generate_text(tiny_model, messages, [img], max_new_tokens=12)


def test_chat_on_a_file_that_is_not_an_image(tiny_model, tmp_path):
    bogus = tmp_path / "notes.png"
    bogus.write_text("this is text, not pixels")
    proc = run_epd("chat", tiny_model, "--prompt", "hi", "--image", str(bogus))
    assert proc.returncode != 0
    assert "not a usable image" in proc.stderr and "notes.png" in proc.stderr


def test_chat_with_a_video_prints_transformers_greedy_text(tiny_model, tmp_path):
    pytest.importorskip("av")
    if not reference_available():
        pytest.skip("scripts/env.sh dev installs the reference")
    data = encode_video(synthetic_frames(11, 64, 96, seed=4), "mp4", fps=5)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    proc = run_epd("chat", tiny_model, "--prompt", "What happens?", "--video", str(path), "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    meta = read_video_meta(data)
    clips = VideoClips([(decode_frames(data, range(meta.num_frames)), meta)], {}, tmp_path / "ref")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    assert proc.stdout.rstrip("\n") == hf_generate_text(tiny_model, messages, [], max_new_tokens=12, videos=clips)


def test_chat_on_a_file_that_is_not_a_video(tiny_model, tmp_path):
    bogus = tmp_path / "clip.mp4"
    bogus.write_bytes(b"\x00" * 100)
    proc = run_epd("chat", tiny_model, "--prompt", "hi", "--video", str(bogus))
    assert proc.returncode != 0
    assert "not a usable video" in proc.stderr and "clip.mp4" in proc.stderr


def test_chat_on_a_missing_checkpoint(tmp_path):
    proc = run_epd("chat", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert proc.returncode != 0 and "not a checkpoint directory" in proc.stderr

