"""Datasets: real image bytes of the asked sizes, image counts, repeat and text-only ratios, jsonl."""
from __future__ import annotations

import base64
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from epd.bench.datasets import (IMAGE_POOL_SIZE, load_jsonl, load_tokenizer, make_image_bytes, parse_image_sizes,
                            sample_random, sample_random_mm)


def _decode(url: str) -> Image.Image:
    header, payload = url.split(",", 1)
    assert header.startswith("data:image/") and header.endswith(";base64")
    img = Image.open(io.BytesIO(base64.b64decode(payload)))
    img.load()
    return img


@pytest.mark.parametrize("fmt, pil_format", [("jpeg", "JPEG"), ("png", "PNG")])
def test_images_are_real_files_of_the_requested_size(fmt, pil_format):
    data = make_image_bytes(96, 40, seed=1, fmt=fmt)
    img = Image.open(io.BytesIO(data))
    assert img.format == pil_format and img.size == (96, 40)
    assert data == make_image_bytes(96, 40, seed=1, fmt=fmt)
    assert data != make_image_bytes(96, 40, seed=2, fmt=fmt)


def test_random_mm_requests_carry_decodable_images_of_listed_sizes():
    sizes = [(64, 48), (32, 80)]
    requests = sample_random_mm(20, input_len=12, output_len=7, images_per_request=2, image_sizes=sizes,
                                image_format="png", seed=0)
    seen_sizes = set()
    for r in requests:
        assert r.output_len == 7 and len(r.prompt.split()) == 12
        assert r.num_images == 2
        for url in r.image_urls:
            img = _decode(url)
            assert img.format == "PNG"
            seen_sizes.add(img.size)
    assert seen_sizes == set(sizes)
    again = sample_random_mm(20, 12, 7, images_per_request=2, image_sizes=sizes, image_format="png", seed=0)
    assert again == requests
    assert sample_random_mm(20, 12, 7, images_per_request=2, image_sizes=sizes, seed=1) != requests


def test_images_per_request_range():
    requests = sample_random_mm(300, 4, 2, images_per_request=4, images_range_ratio=0.5,
                                image_sizes=[(16, 16)], seed=0)
    counts = Counter(r.num_images for r in requests)
    assert set(counts) == {2, 3, 4, 5, 6}  # uniform over [4 * 0.5, 4 * 1.5]
    assert min(counts.values()) > 300 / 5 * 0.5


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_repeat_image_ratio_is_the_share_of_pooled_images(ratio):
    requests = sample_random_mm(400, 4, 2, images_per_request=1, image_sizes=[(24, 24)],
                                repeat_image_ratio=ratio, seed=3)
    urls = [u for r in requests for u in r.image_urls]
    counts = Counter(urls)
    pooled = {u for u, n in counts.items() if n > 1}
    assert len(pooled) <= IMAGE_POOL_SIZE
    share = sum(counts[u] for u in pooled) / len(urls)
    assert share == pytest.approx(ratio, abs=0.07)


def test_text_only_ratio_mixes_requests_without_images():
    requests = sample_random_mm(400, 4, 2, images_per_request=2, image_sizes=[(16, 16)],
                                text_only_ratio=0.3, seed=0)
    counts = Counter(r.num_images for r in requests)
    assert set(counts) == {0, 2}
    assert counts[0] / 400 == pytest.approx(0.3, abs=0.07)


def test_random_text_dataset():
    requests = sample_random(5, input_len=30, output_len=9, seed=4)
    assert all(r.num_images == 0 and len(r.prompt.split()) == 30 and r.output_len == 9 for r in requests)
    assert len({r.prompt for r in requests}) == 5
    assert requests == sample_random(5, 30, 9, seed=4)


def test_with_a_tokenizer_a_prompt_is_input_len_tokens(tiny_model):
    """The tiny checkpoint's small vocabulary splits words, so words != tokens there."""
    tokenizer = load_tokenizer(tiny_model)
    for n in (1, 50, 400):
        requests = sample_random_mm(3, n, 4, images_per_request=1, image_sizes=[(16, 16)], seed=n,
                                    tokenizer=tokenizer)
        for r in requests:
            assert abs(len(tokenizer.encode(r.prompt, add_special_tokens=False)) - n) <= 2
        assert requests == sample_random_mm(3, n, 4, images_per_request=1, image_sizes=[(16, 16)], seed=n,
                                            tokenizer=tokenizer)
    words = sample_random(1, 400, 4, seed=0)[0].prompt
    assert len(tokenizer.encode(words, add_special_tokens=False)) > 500  # why --tokenizer exists
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(Path(tiny_model) / "no-such-dir"))


def test_videos_and_images_keep_their_own_caps_per_request():
    """vLLM's random-mm limits: K = 3 items a request from an image and a video bucket,
    at most 2 images and 1 video each; a modality at its cap is drawn no more, so every
    request holds exactly 3 items; and a repeat pool needs an image size."""
    from epd.bench.datasets import draw_random_mm

    draws = draw_random_mm(200, 4, images_per_request=3, image_sizes=[(32, 32), (64, 48, 8)],
                           image_weights=[0.2, 0.8], max_images=2, max_videos=1, seed=5)
    kinds = [Counter(len(item) for item in draw.images) for draw in draws]
    assert all(k[2] + k[3] == 3 and k[3] <= 1 and k[2] <= 2 for k in kinds)
    assert all(k == Counter({2: 2, 3: 1}) for k in kinds)  # the caps force it: 2 images + 1 video
    capped = draw_random_mm(50, 4, images_per_request=5, image_sizes=[(64, 48, 8)], max_videos=2, seed=5)
    assert {len(d.images) for d in capped} == {2}  # K capped at the video limit
    with pytest.raises(ValueError, match="pool of images"):
        draw_random_mm(2, 4, image_sizes=[(64, 48, 8)], repeat_image_ratio=0.5)


def test_bad_dataset_options_raise():
    with pytest.raises(ValueError, match="WxH"):
        parse_image_sizes("64by64")
    with pytest.raises(ValueError, match="positive"):
        parse_image_sizes("0x64")
    assert parse_image_sizes("64x48, 32X32") == [(64, 48), (32, 32)]
    with pytest.raises(ValueError, match="repeat-image-ratio"):
        sample_random_mm(1, 4, 2, repeat_image_ratio=1.5)


def test_jsonl_reads_prompts_images_and_output_lens(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "cat.png").write_bytes(make_image_bytes(40, 30, seed=0, fmt="png"))
    lines = [{"prompt": "describe", "images": ["imgs/cat.png", "imgs/cat.png"]},
             {"prompt": "just text", "output_len": 3},
             {"prompt": "third"}]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    requests = load_jsonl(path, num_prompts=None, default_output_len=16)
    assert [r.prompt for r in requests] == ["describe", "just text", "third"]
    assert [r.output_len for r in requests] == [16, 3, 16]
    assert [r.num_images for r in requests] == [2, 0, 0]
    assert _decode(requests[0].image_urls[0]).size == (40, 30)
    assert requests[0].image_urls[0].startswith("data:image/png;base64,")
    assert len(load_jsonl(path, num_prompts=2, default_output_len=16)) == 2


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "JSON object"),
    ('{"images": []}', '"prompt" must be a string'),
    ('{"prompt": "x", "output_len": 0}', "output_len"),
    ('{"prompt": "x", "images": ["missing.png"]}', "missing.png"),
    ('{"prompt": "x", "extra": 1}', "unknown keys"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "also fine"}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=f"reqs.jsonl:3: .*{message}"):
        load_jsonl(path, None, 8)
