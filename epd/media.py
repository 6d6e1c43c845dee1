"""Fetching the raw bytes of an image part: `data:` URLs and `file://` paths.

Raw bytes are what gets hashed (cache key) and sent to encoders; pixels are
decoded only in the encoder. Every refusal is a `MediaError` whose message
is fit for an HTTP 400.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024


class MediaError(ValueError):
    """An image reference that cannot or may not be loaded."""


@dataclass(frozen=True)
class MediaPolicy:
    """What a request may reference. `allowed_local_media_path=None` forbids `file://`."""

    allowed_local_media_path: str | None = None
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES


def image_part_source(part: dict):
    """The URL string (or PIL image) an image content part points to."""
    kind = part.get("type")
    if kind == "image_pil":
        return part.get("image_pil")
    if kind == "image_url":
        value = part.get("image_url")
        return value.get("url") if isinstance(value, dict) else value
    if kind == "image":
        return part.get("image")
    raise MediaError(f"content part of type {kind!r} is not an image")


def load_image_bytes(source, policy: MediaPolicy) -> bytes:
    """Raw encoded bytes of an image given as a data URL, file URL or PIL image."""
    if hasattr(source, "save") and hasattr(source, "size"):  # a PIL image
        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    if not isinstance(source, str) or not source:
        raise MediaError("image_url must be a non-empty string")
    if source.startswith("data:"):
        return _data_url_bytes(source, policy)
    if source.startswith("file://"):
        return _file_bytes(source, policy)
    scheme = source.split(":", 1)[0] if ":" in source else ""
    raise MediaError(f"unsupported image URL scheme {scheme!r}: use a data: URL"
                     + (" or file://" if policy.allowed_local_media_path else ""))


def _data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' separating header and payload")
    if not header.endswith(";base64"):
        raise MediaError("data URL images must be base64-encoded (data:image/...;base64,...)")
    # 4 base64 chars carry 3 bytes: refuse oversized payloads before decoding.
    if len(payload) * 3 // 4 > policy.max_image_bytes + 3:
        raise MediaError(f"image exceeds the limit of {policy.max_image_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 in data URL") from None
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"image of {len(data)} bytes exceeds the limit of {policy.max_image_bytes} bytes")
    if not data:
        raise MediaError("empty image in data URL")
    return data


def _file_bytes(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaError("file:// image URLs are not allowed (start the server with --allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL with a remote host {parsed.netloc!r} is not allowed")
    path = Path(unquote(parsed.path)).resolve()
    root = Path(policy.allowed_local_media_path).resolve()
    if path != root and root not in path.parents:
        raise MediaError(f"file {path} is outside the allowed media path {root}")
    try:
        size = os.path.getsize(path)
        if size > policy.max_image_bytes:
            raise MediaError(f"image of {size} bytes exceeds the limit of {policy.max_image_bytes} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(f"cannot read {path}: {exc.strerror}") from None
