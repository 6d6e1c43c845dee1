"""The offline `LLM.chat` loads a video part as a video (epd/inputs/media.py with
modality "video"): under the video size cap, not the image's, and every refusal
names the video."""
from __future__ import annotations

import dataclasses
import re

import pytest

from epd.inputs.media import MediaError
from epd.transport.wire.sampling import SamplingParams
from testkit.media import data_url
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
CLIP = encode_video(synthetic_frames(5, 32, 32, seed=2), "mp4", fps=4)


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd.llm import LLM

    return LLM(tiny_model)


def _chat(llm, url: str):
    part = {"type": "video_url", "video_url": {"url": url}}
    return llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}],
                    SamplingParams(temperature=0, max_tokens=2))


@pytest.mark.parametrize("url, message", [
    ("data:video/mp4;base64,", "empty video in data URL"),
    ("data:video/mp4,AAAA", "data URL videos must be base64-encoded"),
    ("ftp://host/v.mp4", "unsupported video URL scheme 'ftp'"),
    ("http://host/v.mp4", "http(s) video URLs are not allowed"),
])
def test_a_bad_video_url_names_the_video(llm, url, message):
    with pytest.raises(MediaError, match=re.escape(message)):
        _chat(llm, url)


def test_videos_are_capped_by_the_video_limit_not_the_image_one(llm, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)
    small_images = dataclasses.replace(llm.media, max_image_bytes=len(CLIP) // 2)
    llm.media = small_images  # an image cap below the clip's size: the video still loads
    [out] = _chat(llm, f"file://{path}")
    assert len(out.outputs[0].token_ids) == 2
    llm.media = dataclasses.replace(small_images, max_video_bytes=len(CLIP) - 1)
    for url in (f"file://{path}", data_url(CLIP, "video/mp4")):
        with pytest.raises(MediaError, match=f"video of {len(CLIP)} bytes exceeds the limit of {len(CLIP) - 1} bytes"):
            _chat(llm, url)
