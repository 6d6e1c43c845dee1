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
