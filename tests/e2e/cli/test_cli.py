"""The `epd` command as a user runs it: a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

from testkit.hf_reference import hf_generate_text
from testkit.media import image_bytes, image_part


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
    assert "<|image_pad|>" in tok_cfg["chat_template"]
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


def test_chat_on_a_missing_checkpoint(tmp_path):
    proc = run_epd("chat", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert proc.returncode != 0 and "not a checkpoint directory" in proc.stderr


def test_chat_with_a_video_prints_the_offline_answer(tiny_model, tmp_path):
    from testkit.videos import encode_video, synthetic_frames

    from epd.llm import LLM
    from epd.transport.sampling import SamplingParams

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(encode_video(synthetic_frames(9, 48, 64, seed=2), "mp4", fps=4))
    proc = run_epd("chat", tiny_model, "--prompt", "What happens?", "--video", str(clip), "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    parts = [{"type": "video_url", "video_url": {"url": clip.as_uri()}}, {"type": "text", "text": "What happens?"}]
    [out] = LLM(tiny_model).chat([{"role": "user", "content": parts}], SamplingParams(temperature=0, max_tokens=8))
    assert proc.stdout.rstrip("\n") == out.outputs[0].text


def test_chat_on_a_file_that_is_not_a_video(tiny_model, tmp_path):
    bogus = tmp_path / "clip.mp4"
    bogus.write_text("this is text, not frames")
    proc = run_epd("chat", tiny_model, "--prompt", "hi", "--video", str(bogus))
    assert proc.returncode == 2
    assert "clip.mp4 is not a usable video (cannot open video" in proc.stderr
