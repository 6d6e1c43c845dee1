"""Video parts under the images' media policy, without a server: data: and
file:// videos with their own size cap (--max-video-mb), messages that say
"video", and --mm-processor-kwargs split between the image and video processors."""
from __future__ import annotations

import asyncio

import pytest
from testkit.media import data_url

from epd.inputs.media import MediaConfig, MediaError, MediaFetcher, load_image_bytes
from epd.inputs.model_files import ModelFilesConfig, split_processor_kwargs
from epd.inputs.video_header import loader_frames

VIDEO = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8  # bytes only: no header is read here
POLICY = MediaConfig(max_image_bytes=1000, max_video_bytes=4096)


def test_a_video_has_its_own_cap():
    assert load_image_bytes(data_url(VIDEO, "video/mp4"), POLICY, "video") == VIDEO
    with pytest.raises(MediaError, match="image exceeds the limit of 1000 bytes"):
        load_image_bytes(data_url(VIDEO, "image/png"), POLICY)
    with pytest.raises(MediaError, match="video exceeds the limit of 4096 bytes"):
        load_image_bytes(data_url(VIDEO * 3, "video/mp4"), POLICY, "video")


def test_file_videos_only_under_the_allowed_path(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "clip.mp4").write_bytes(VIDEO)
    (tmp_path / "big.mp4").write_bytes(VIDEO)
    policy = MediaConfig(allowed_local_media_path=str(tmp_path / "ok"), max_video_bytes=4096)
    fetcher = MediaFetcher(policy)
    assert asyncio.run(fetcher.load((tmp_path / "ok" / "clip.mp4").as_uri(), "video")) == VIDEO
    with pytest.raises(MediaError, match="outside the allowed media path"):
        asyncio.run(fetcher.load((tmp_path / "big.mp4").as_uri(), "video"))
    with pytest.raises(MediaError, match="file:// video URLs are not allowed"):
        load_image_bytes((tmp_path / "ok" / "clip.mp4").as_uri(), MediaConfig(), "video")


@pytest.mark.parametrize("url, message", [
    ("ftp://127.0.0.1/x.mp4", "unsupported video URL scheme 'ftp'"),
    ("https://videos.example/x.mp4", "http(s) video URLs are not allowed"),
    ("data:video/mp4,notbase64", "data URL videos must be base64-encoded"),
    ("data:video/mp4;base64,", "empty video in data URL"),
])
def test_refusals_name_the_video(url, message):
    with pytest.raises(MediaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(MediaFetcher(MediaConfig()).load(url, "video"))


def test_processor_kwargs_split_between_images_and_videos():
    assert split_processor_kwargs({"max_pixels": 4096, "fps": 1, "max_frames": 8}) == (
        {"max_pixels": 4096}, {"fps": 1, "max_frames": 8})
    with pytest.raises(ValueError, match="--mm-processor-kwargs: fps and num_frames exclude each other"):
        ModelFilesConfig(mm_processor_kwargs=(("fps", 1), ("num_frames", 4)))
    with pytest.raises(ValueError, match="size_divisor cannot be applied here"):
        ModelFilesConfig(mm_processor_kwargs=(("size_divisor", 1),))
    with pytest.raises(ValueError, match="num_frames must be a positive integer"):
        ModelFilesConfig(mm_processor_kwargs=(("num_frames", 0),))


def test_loader_frames_as_vllms_loader():
    """--media-io-kwargs video.num_frames: evenly spaced, truncated as numpy's int cast does."""
    assert loader_frames(10, 4) == [0, 3, 6, 9]
    assert loader_frames(11, 4) == [0, 3, 6, 10]  # linspace 0, 3.33, 6.67, 10 -> truncated
    assert loader_frames(10, -1) is None and loader_frames(10, 10) is None and loader_frames(3, 8) is None
