"""Fetching the raw bytes of an image or video part: `data:` URLs, `file://`
paths and, on the server, `http(s)://` URLs from allowed hosts, under one
policy for both (a video has its own size cap, `--max-video-mb`).

Raw bytes are what gets hashed (cache key) and sent to encoders; pixels are
decoded only in the encoder. Every refusal is a `MediaError` whose message
is fit for an HTTP 400.

`load_image_bytes` is synchronous and local (data:, file://, PIL images);
`MediaFetcher` is the server's asynchronous front: it fetches http(s) URLs
itself and hands everything else to `load_image_bytes` in a thread. Both take
the modality ("image" or "video"), which names the cap and the messages.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from epd.encoders.image_io import DEFAULT_MAX_IMAGE_PIXELS
from epd.encoders.video_io import DecodeLimits
from epd.transport.wire.frame_limits import DEFAULT_MAX_IMAGE_BYTES

MAX_REDIRECTS = 5
DEFAULT_MAX_VIDEO_BYTES = 64 << 20  # --max-video-mb
DEFAULT_MAX_VIDEO_FRAMES = 4096  # frames a video's container may hold (its header's count)
DEFAULT_MAX_REQUEST_VIDEO_PIXELS = 1 << 33  # pixels the encoder decodes for one request's videos
DEFAULT_VIDEO_DECODE_TIMEOUT_S = 60.0
MAX_FILE_READERS = 4  # threads reading file:// images; a stuck read never takes a text request's thread


class MediaError(ValueError):
    """An image or video reference that cannot or may not be loaded."""


@dataclass(frozen=True)
class MediaConfig:
    """What requests may reference (`epd serve`'s media flags).

    `allowed_local_media_path=None` forbids `file://`; an empty
    `allowed_media_domains` forbids `http(s)://`, otherwise it names hosts
    that match exactly, any port (lower-case host names or IP addresses; IPv6
    without brackets). Images are refused past `max_image_bytes` of encoded
    data or `max_image_pixels` (read from the header), requests past
    `limit_images_per_prompt` images or `max_request_pixels` in all (the
    encoder decodes every pixel: a bound on its memory and time).

    Videos: refused past `max_video_bytes` of encoded data, a container of
    more than `max_video_frames` frames or frames larger than
    `max_image_pixels` (from the header), requests past
    `limit_videos_per_prompt` videos or `max_request_video_pixels` decoded
    pixels in all (frames up to the last sampled one, full size: what the
    encoder decodes). `video_num_frames` (--media-io-kwargs' video.num_frames,
    vLLM's loader): the frames taken evenly from the container before the
    processor sees them (-1: all, the processor samples). The encoder gives up
    decoding one video after `video_decode_timeout_s`. `video_chunk_frames`
    (the API's): a video sampling more frames is encoded in chunks of that many
    (transport/media/video_chunks.py), each its own EncodeRequest; 0: whole."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout_s: float = 5.0
    limit_images_per_prompt: int | None = 16
    limit_videos_per_prompt: int = 1
    max_request_pixels: int = 2 * DEFAULT_MAX_IMAGE_PIXELS
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_request_video_pixels: int = DEFAULT_MAX_REQUEST_VIDEO_PIXELS
    video_num_frames: int = -1
    video_decode_timeout_s: float = DEFAULT_VIDEO_DECODE_TIMEOUT_S  # the encoder's, per video
    video_chunk_frames: int = 0  # a longer video is encoded in chunks of this many sampled frames (0: whole)
    limit_audios_per_prompt: int = 1  # audio clips (a family with an audio side; others refuse any)
    max_audio_seconds: float = 600.0  # a clip's duration from its header; its bytes capped as a video's

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_request_pixels", "max_video_bytes",
                     "max_video_frames", "max_request_video_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.video_num_frames == 0 or self.video_num_frames < -1:
            raise ValueError(f"--media-io-kwargs video.num_frames must be -1 (all) or positive, "
                             f"got {self.video_num_frames}")
        if self.video_chunk_frames < 0:
            raise ValueError(f"--video-chunk-frames must be 0 (no chunks) or positive, got {self.video_chunk_frames}")
        if not self.video_decode_timeout_s > 0:
            raise ValueError(f"--video-decode-timeout must be positive, got {self.video_decode_timeout_s}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"--media-fetch-timeout must be positive, got {self.fetch_timeout_s}")
        if self.limit_images_per_prompt is not None and self.limit_images_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt image=N needs N >= 0, got {self.limit_images_per_prompt}")
        if self.limit_audios_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt audio=N needs N >= 0, got {self.limit_audios_per_prompt}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"--max-audio-seconds must be positive, got {self.max_audio_seconds}")
        if self.limit_videos_per_prompt < 0:
            raise ValueError(f"--limit-mm-per-prompt video=N needs N >= 0, got {self.limit_videos_per_prompt}")
        if any(not d or d != d.strip().lower() or "/" in d or d.count(":") == 1 for d in self.allowed_media_domains):
            raise ValueError("--allowed-media-domains takes lower-case host names separated by commas "
                             f"(no scheme, port or path), got {','.join(self.allowed_media_domains)!r}")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path} is not a directory")

    def max_bytes(self, modality: str) -> int:
        """The encoded-size cap of one item of `modality` (an audio file's: a video's)."""
        return self.max_video_bytes if modality in ("video", "audio") else self.max_image_bytes

    def decode_limits(self) -> DecodeLimits:
        """What an encoder may spend decoding one video (it checks them again: a peer's plan)."""
        return DecodeLimits(max_frame_pixels=self.max_image_pixels, max_decoded_pixels=self.max_request_video_pixels,
                            deadline_s=self.video_decode_timeout_s)

    @property
    def max_blob_bytes(self) -> int:
        """The largest item an EncodeRequest may carry (an encoder inbox's cap)."""
        return max(self.max_image_bytes, self.max_video_bytes)


def image_part_source(part: dict):
    """The URL string (or PIL image) an image content part points to."""
    kind = part.get("type")
    if kind == "video_url":
        value = part.get("video_url")
        return value.get("url") if isinstance(value, dict) else value
    if kind == "image_pil":
        return part.get("image_pil")
    if kind == "image_url":
        value = part.get("image_url")
        return value.get("url") if isinstance(value, dict) else value
    if kind == "image":
        return part.get("image")
    raise MediaError(f"content part of type {kind!r} is not an image or a video")


def is_remote(source) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def load_image_bytes(source, policy: MediaConfig, modality: str = "image") -> bytes:
    """Raw encoded bytes of an image (or a video: `modality`) given as a data URL,
    file URL or PIL image."""
    if modality == "image" and hasattr(source, "save") and hasattr(source, "size"):  # a PIL image
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    if not isinstance(source, str) or not source:
        raise MediaError(f"{modality}_url must be a non-empty string")
    if source.startswith("data:"):
        return _data_url_bytes(source, policy, modality)
    if source.startswith("file://"):
        return _file_bytes(source, policy, modality)
    if is_remote(source):
        check_remote_url(source, policy, modality)
        raise MediaError(f"http(s) {modality} URLs are fetched by the server only (epd serve)")
    scheme = source.split(":", 1)[0] if ":" in source else ""
    raise MediaError(f"unsupported {modality} URL scheme {scheme!r}: use a data: URL"
                     + (" or file://" if policy.allowed_local_media_path else "")
                     + (" or http(s)://" if policy.allowed_media_domains else ""))


def check_remote_url(url: str, policy: MediaConfig, modality: str = "image") -> str:
    """The host of an http(s) URL the policy allows; MediaError otherwise."""
    if not policy.allowed_media_domains:
        raise MediaError(f"http(s) {modality} URLs are not allowed (start the server with --allowed-media-domains)")
    try:
        parsed = urlparse(url)
        host = (parsed.hostname or "").lower()
        parsed.port  # noqa: B018 -- raises ValueError for a malformed port
    except ValueError:
        raise MediaError(f"malformed {modality} URL") from None
    if parsed.scheme.lower() not in ("http", "https") or not host:
        raise MediaError(f"malformed {modality} URL: expected http(s)://host/...")
    if host not in policy.allowed_media_domains:
        raise MediaError(f"{modality} URL host {host!r} is not in --allowed-media-domains")
    return host


def _data_url_bytes(url: str, policy: MediaConfig, modality: str) -> bytes:
    header, sep, payload = url.partition(",")
    cap = policy.max_bytes(modality)
    if not sep:
        raise MediaError("malformed data URL: no ',' separating header and payload")
    if not header.endswith(";base64"):
        raise MediaError(f"data URL {modality}s must be base64-encoded (data:{modality}/...;base64,...)")
    # 4 base64 chars carry 3 bytes: refuse oversized payloads before decoding.
    if len(payload) * 3 // 4 > cap + 3:
        raise MediaError(f"{modality} exceeds the limit of {cap} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 in data URL") from None
    if len(data) > cap:
        raise MediaError(f"{modality} of {len(data)} bytes exceeds the limit of {cap} bytes")
    if not data:
        raise MediaError(f"empty {modality} in data URL")
    return data


def _file_bytes(url: str, policy: MediaConfig, modality: str) -> bytes:
    """A regular file under the allowed path. Messages never show the resolved
    path (it would tell a client about the server's file system)."""
    if policy.allowed_local_media_path is None:
        raise MediaError(f"file:// {modality} URLs are not allowed (start the server with --allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL with a remote host {parsed.netloc!r} is not allowed")
    try:
        path = Path(unquote(parsed.path)).resolve()
        root = Path(policy.allowed_local_media_path).resolve()
    except (OSError, ValueError, RuntimeError):  # NUL bytes, symlink loops
        raise MediaError("malformed file:// URL") from None
    if path != root and root not in path.parents:
        raise MediaError("the file is outside the allowed media path (--allowed-local-media-path)")
    cap = policy.max_bytes(modality)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        raise MediaError(f"cannot read the file: {getattr(exc, 'strerror', None) or 'invalid path'}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError("cannot read the file: not a regular file")
        if info.st_size > cap:
            raise MediaError(f"{modality} of {info.st_size} bytes exceeds the limit of {cap} bytes")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(cap + 1)  # the size can lie (/proc, a file growing)
    except OSError as exc:
        raise MediaError(f"cannot read the file: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise MediaError(f"{modality} exceeds the limit of {cap} bytes")
    if not data:
        raise MediaError("cannot read the file: it is empty")
    return data


class MediaFetcher:
    """The server's loader: `await load(source, modality)` -> raw bytes or MediaError.

    http(s): one shared httpx client (no proxies from the environment, no
    automatic redirects: each hop is checked against the allowed hosts, at most
    `MAX_REDIRECTS`), the body streamed undecoded (`Accept-Encoding: identity`,
    so a compressed bomb never expands) and abandoned past the modality's cap
    (`max_image_bytes`, `max_video_bytes`), the whole fetch bounded by
    `fetch_timeout_s`. Whether the body is an image or a video is decided by
    the caller's header check, not by Content-Type.
    """

    def __init__(self, policy: MediaConfig):
        self.policy = policy
        self._client = None  # httpx.AsyncClient, made on the first remote fetch
        # file:// reads (a slow disk, a network mount) wait in their own threads, bounded by the fetch timeout
        self._file_readers = ThreadPoolExecutor(MAX_FILE_READERS, thread_name_prefix="epd-file-media")

    async def load(self, source, modality: str = "image") -> bytes:
        if isinstance(source, str) and source.startswith("file://"):
            loop = asyncio.get_running_loop()
            read = loop.run_in_executor(self._file_readers, load_image_bytes, source, self.policy, modality)
            try:
                return await asyncio.wait_for(read, self.policy.fetch_timeout_s)
            except asyncio.TimeoutError:
                raise MediaError(f"reading the file timed out after {self.policy.fetch_timeout_s:g} s") from None
        if not is_remote(source):
            return await asyncio.to_thread(load_image_bytes, source, self.policy, modality)
        check_remote_url(source, self.policy, modality)
        import httpx

        try:
            return await asyncio.wait_for(self._fetch(source, modality), self.policy.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise MediaError(f"fetching the {modality} URL timed out after {self.policy.fetch_timeout_s:g} s") \
                from None
        except httpx.HTTPError as exc:
            raise MediaError(f"cannot fetch the {modality} URL: {exc.__class__.__name__}") from None

    async def _fetch(self, url: str, modality: str) -> bytes:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False,
                                             timeout=self.policy.fetch_timeout_s,
                                             headers={"accept-encoding": "identity"})
        cap = self.policy.max_bytes(modality)
        for _ in range(MAX_REDIRECTS + 1):
            check_remote_url(url, self.policy, modality)
            async with self._client.stream("GET", url, headers={"accept": f"{modality}/*"}) as resp:
                if resp.is_redirect:
                    location = resp.headers.get("location")
                    if not location:
                        raise MediaError(f"{modality} URL answered HTTP {resp.status_code} without a Location")
                    url = str(resp.url.join(location))
                    continue
                if not 200 <= resp.status_code < 300:
                    raise MediaError(f"{modality} URL answered HTTP {resp.status_code}")
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > cap:
                    raise MediaError(f"{modality} of {declared} bytes exceeds the limit of {cap} bytes")
                body = bytearray()
                async for chunk in resp.aiter_raw():
                    body += chunk
                    if len(body) > cap:  # stop reading: the rest never arrives here
                        raise MediaError(f"{modality} exceeds the limit of {cap} bytes")
                if not body:
                    raise MediaError(f"{modality} URL answered with an empty body")
                return bytes(body)
        raise MediaError(f"{modality} URL redirected more than {MAX_REDIRECTS} times")

    async def aclose(self) -> None:
        self._file_readers.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
