"""Media policy and its flags, without a server: which URLs a request may name,
and how `epd serve` flags become `MediaConfig`."""
from __future__ import annotations

import asyncio

import pytest
from testkit.media import data_url, image_bytes

from epd.cli import build_parser, serve_config
from epd.inputs.media import MediaConfig, MediaError, MediaFetcher, check_remote_url, load_image_bytes

IMG = image_bytes(16, 16)
ALLOWED = MediaConfig(allowed_media_domains=("images.example", "127.0.0.1"))


@pytest.mark.parametrize("url", ["http://images.example/a.png", "https://IMAGES.example:8443/a.png?x=1",
                                 "http://127.0.0.1:9/a.png"])
def test_allowed_hosts_match_exactly_any_port(url):
    assert check_remote_url(url, ALLOWED) in ("images.example", "127.0.0.1")


@pytest.mark.parametrize("url, message", [
    ("http://evil.example/a.png", "'evil.example' is not in"),
    ("http://images.example.evil.example/a.png", "is not in"),
    ("http://sub.images.example/a.png", "is not in"),
    ("http://images.example@evil.example/a.png", "'evil.example' is not in"),  # userinfo is not the host
    ("http://localhost/a.png", "'localhost' is not in"),
    ("http://127.0.0.1:notaport/a.png", "malformed"),
    ("http:///a.png", "malformed"),
])
def test_other_hosts_are_refused(url, message):
    with pytest.raises(MediaError, match=message):
        check_remote_url(url, ALLOWED)


def test_http_is_off_by_default():
    with pytest.raises(MediaError, match="not allowed .*--allowed-media-domains"):
        load_image_bytes("https://images.example/a.png", MediaConfig())
    with pytest.raises(MediaError, match="not allowed"):
        asyncio.run(MediaFetcher(MediaConfig()).load("http://images.example/a.png"))


def test_fetcher_loads_local_sources_in_a_thread():
    assert asyncio.run(MediaFetcher(MediaConfig()).load(data_url(IMG))) == IMG
    with pytest.raises(MediaError, match="invalid base64"):
        asyncio.run(MediaFetcher(MediaConfig()).load("data:image/png;base64,@@"))


def test_refused_before_any_connection_for_a_disallowed_host():
    fetcher = MediaFetcher(ALLOWED)
    with pytest.raises(MediaError, match="is not in"):
        asyncio.run(fetcher.load("http://10.255.255.1/a.png"))  # unroutable: a connection attempt would hang
    assert fetcher._client is None


def serve_args(model, *flags):
    return build_parser().parse_args(["serve", model, *flags])


def test_serve_flags_build_the_media_config(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    config = serve_config(serve_args(tiny_model, "--allowed-media-domains", "Images.Example, 127.0.0.1,",
                                     "--media-fetch-timeout", "2.5", "--max-image-bytes", "1000",
                                     "--max-image-pixels", "500", "--limit-mm-per-prompt", "image=3",
                                     "--allowed-local-media-path", str(tmp_path)))
    assert config.media == MediaConfig(allowed_local_media_path=str(tmp_path),
                                       allowed_media_domains=("images.example", "127.0.0.1"), max_image_bytes=1000,
                                       max_image_pixels=500, fetch_timeout_s=2.5, limit_images_per_prompt=3)
    assert config.host == "127.0.0.1" and config.api_key is None
    assert serve_config(serve_args(tiny_model)).media == MediaConfig()  # http(s) and file:// off
    video = serve_config(serve_args(tiny_model, "--limit-mm-per-prompt", '{"image": 2, "video": 3}',
                                    "--max-video-mb", "2", "--max-video-frames", "90", "--video-decode-timeout", "7",
                                    "--max-request-video-pixels", "1000000",
                                    "--media-io-kwargs", '{"video": {"num_frames": 8}}')).media
    assert (video.limit_images_per_prompt, video.limit_videos_per_prompt, video.max_video_bytes,
            video.max_video_frames, video.video_decode_timeout_s, video.max_request_video_pixels,
            video.video_num_frames) == (2, 3, 2 << 20, 90, 7.0, 1000000, 8)
    assert video.max_blob_bytes == MediaConfig().max_image_bytes  # an encoder's inbox takes the larger of the two
    monkeypatch.setenv("EPD_API_KEY", "from-env")
    assert serve_config(serve_args(tiny_model)).api_key == "from-env"
    assert serve_config(serve_args(tiny_model, "--api-key", "from-flag")).api_key == "from-flag"


@pytest.mark.parametrize("flags, message", [
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be positive"),
    (["--max-image-bytes", "0"], "--max-image-bytes must be at least 1"),
    (["--allowed-media-domains", "http://images.example"], "--allowed-media-domains takes"),
    (["--allowed-media-domains", "images.example:8080"], "--allowed-media-domains takes"),
    (["--allowed-local-media-path", "/no/such/dir"], "is not a directory"),
    (["--limit-mm-per-prompt", '{"video": -1}'], "video must be a count"),
    (["--max-video-mb", "0"], "--max-video-bytes must be at least 1"),
    (["--max-video-frames", "0"], "--max-video-frames must be at least 1"),
    (["--video-decode-timeout", "0"], "--video-decode-timeout must be positive"),
    (["--media-io-kwargs", '{"video": {"num_frames": 0}}'], "num_frames must be -1 \\(all\\) or positive"),
    (["--media-io-kwargs", '{"video": {"fps": 2}}'], "video.fps cannot be applied"),
    (["--media-io-kwargs", '{"image": {"size": 2}}'], "only video loading arguments, not image"),
    (["--media-io-kwargs", '[1]'], "--media-io-kwargs takes a JSON object"),
    (["--limit-mm-per-prompt", "pictures=2"], "EPD serves image, video"),
])
def test_bad_media_flags_are_clear_errors(tiny_model, flags, message):
    with pytest.raises(ValueError, match=message):
        serve_config(serve_args(tiny_model, *flags))
