"""Video parts under the media policy of the hardened e-p-d server: file:// from
the allowed path only, http(s) from the allowed host with every redirect
checked again, --max-video-mb and --max-video-frames; each refusal a 400 with
an OpenAI error body, and the server answers good requests after it."""
from __future__ import annotations

import numpy as np
import pytest
from testkit.api_checks import (MAX_VIDEO_FRAMES, MAX_VIDEO_MB, answer_text, assert_error, assert_still_serving,
                                chat_body, post)
from testkit.media import data_url
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
CLIP = encode_video(synthetic_frames(9, 48, 64, seed=21), "mp4", fps=4)
LONG = encode_video(np.full((MAX_VIDEO_FRAMES + 5, 48, 64, 3), 90, np.uint8), "mp4", fps=10)  # small, many frames
BIG = CLIP + bytes(int(MAX_VIDEO_MB * (1 << 20)))  # refused by its size alone


def video_messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]


@pytest.fixture(scope="module")
def reference(server):
    """The server's answer for CLIP sent inline."""
    return answer_text(post(server, chat_body(video_messages(data_url(CLIP, "video/mp4")))))


def test_file_and_http_videos_answer_as_inline(server, reference, media_dir, media_host):
    base, httpd = media_host
    httpd.videos["/clip.mp4"] = CLIP
    (media_dir / "allowed" / "clip.mp4").write_bytes(CLIP)
    for url in ((media_dir / "allowed" / "clip.mp4").as_uri(), base + "/clip.mp4", base + "/redirect-clip"):
        assert answer_text(post(server, chat_body(video_messages(url)))) == reference, url


@pytest.mark.parametrize("where, message", [
    ("outside", "outside the allowed media path"),
    ("redirect-away", "video url host 'localhost' is not in --allowed-media-domains"),
    ("missing", "video url answered http 404"),
    ("too_big", f"exceeds the limit of {int(MAX_VIDEO_MB * (1 << 20))} bytes"),
    ("too_many_frames", f"the video has {MAX_VIDEO_FRAMES + 5} frames; the limit is {MAX_VIDEO_FRAMES}"),
])
def test_refused_videos(server, expected, media_dir, media_host, where, message):
    base, httpd = media_host
    assert len(BIG) > MAX_VIDEO_MB * (1 << 20) > len(LONG)
    httpd.videos["/clip.mp4"] = CLIP
    (media_dir / "outside.mp4").write_bytes(CLIP)
    url = {"outside": (media_dir / "outside.mp4").as_uri(), "redirect-away": base + "/redirect-away-clip",
           "missing": base + "/missing.mp4", "too_big": data_url(BIG, "video/mp4"),
           "too_many_frames": data_url(LONG, "video/mp4")}[where]
    assert_error(post(server, chat_body(video_messages(url))), 400, message, "messages")
    assert_still_serving(server, expected)
