"""Video parts under the media policy of the hardened e-p-d server: file:// from
the allowed path only, http(s) from the allowed host with every redirect
checked again, --max-video-mb and --max-video-frames, mm_processor_kwargs that
would cost more than the video or the server's budget allow (issue 44: found
from the header, the API process's peak memory flat); each refusal a 400 with
an OpenAI error body, and the server answers good requests after it."""
from __future__ import annotations

from pathlib import Path

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


def _peak_growth_mib(pid: int, send):
    """(send()'s result, the peak RSS it added to process `pid`, MiB)."""
    def kib(field: str) -> int:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1])
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    result = send()
    return result, (kib("VmHWM") - before) / 1024


@pytest.mark.parametrize("kwargs, message", [
    # before issue 44: 7,000,028 placeholder tokens expanded and tokenized, 70 s and +3 GB in the API
    ({"num_frames": 10**6}, "num_frames=1000000 exceeds what this video of 9 frames allows: 1..9"),
    ({"num_frames": 10**30}, f"num_frames={10**30} exceeds what this video of 9 frames allows"),  # was a 500
    # 4 frames of 48x64 upscaled to 1664x1248 each (8,294,400 pixels in all): past one image's budget
    ({"min_pixels": 8294400}, "they would resize the video's frames to 1664x1248, past this server's limit"),
    ({"min_pixels": 10**15}, "min_pixels=1000000000000000 exceeds this server's video pixel budget: "
                             "allowed 1..25165824"),  # was a 500
])
def test_costly_video_kwargs_are_refused_from_the_header(server, expected, kwargs, message):
    body = chat_body(video_messages(data_url(CLIP, "video/mp4")), mm_processor_kwargs=kwargs)
    response, growth_mib = _peak_growth_mib(server.proc.pid, lambda: post(server, body))
    assert_error(response, 400, "mm_processor_kwargs: " + message, "mm_processor_kwargs")
    assert growth_mib < 120
    assert_still_serving(server, expected)
