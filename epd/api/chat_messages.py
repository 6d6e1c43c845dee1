"""OpenAI chat messages, checked at the edge: roles, content parts, images,
videos, audio clips, assistant `tool_calls` and `tool` messages -> the form the chat template reads."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from epd.requests import RequestError

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def validate_messages(messages: list[dict[str, Any]], max_images: int | None = None,
                      max_videos: int | None = None, max_audios: int = 0) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content"}] with role in system/user/assistant/tool
    ("developer" becomes "system") or any other name, which the chat template renders
    (vLLM's custom roles), and content a string or a list of
    {"type": "text", "text"} / {"type": "image_url", "image_url": {"url"}} /
    {"type": "video_url", "video_url": {"url"}} parts; an assistant message keeps its
    `tool_calls` (arguments parsed, for the template) and a tool message its
    `tool_call_id`. Audio clips, where the model takes them (`max_audios` > 0):
    {"type": "input_audio", "input_audio": {"data": base64, "format"}} (OpenAI's) and
    {"type": "audio_url", "audio_url": {"url"}} (vLLM's); else such a part is refused by
    its type. More than `max_images` images, `max_videos` videos or `max_audios` clips:
    400 (--limit-mm-per-prompt), before anything is fetched."""
    out = []
    num_images = num_videos = num_audios = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{where}.role: unsupported role {role!r}: must be a non-empty string "
                               f"({', '.join(CHAT_ROLES)}, or a role the chat template renders)", param=f"{where}.role")
        tool_calls = msg.get("tool_calls")
        if tool_calls and role != "assistant":
            raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise RequestError(f"{where}.content: field required", param=f"{where}.content")
            content = ""
        elif isinstance(content, list):
            content = [_content_part(part, role, f"{where}.content[{j}]", max_audios > 0)
                       for j, part in enumerate(content)]
            num_audios += sum(1 for part in content if part["type"] in ("input_audio", "audio_url"))
            num_images += sum(1 for part in content if part["type"] == "image_url")
            num_videos += sum(1 for part in content if part["type"] == "video_url")
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content: must be a string or a list of content parts",
                               param=f"{where}.content")
        clean = {"role": CHAT_ROLES.get(role, role), "content": content}
        if tool_calls:
            clean["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise RequestError(f"{where}.tool_call_id: field required", param=f"{where}.tool_call_id")
            clean["tool_call_id"] = msg["tool_call_id"]
        out.append(clean)
    if max_images is not None and num_images > max_images:
        raise RequestError(f"at most {max_images} images per request are allowed, got {num_images}",
                           param="messages")
    if max_videos is not None and num_videos > max_videos:
        raise RequestError(f"at most {max_videos} video{'s' if max_videos != 1 else ''} per request "
                           f"{'are' if max_videos != 1 else 'is'} allowed, got {num_videos} "
                           "(--limit-mm-per-prompt)", param="messages")
    if num_audios > max_audios:
        raise RequestError(f"at most {max_audios} audio clip{'s' if max_audios != 1 else ''} per request "
                           f"{'are' if max_audios != 1 else 'is'} allowed, got {num_audios} "
                           "(--limit-mm-per-prompt)", param="messages")
    return out


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """[{"id", "type": "function", "function": {"name", "arguments": JSON text}}] -> the
    same with arguments parsed (the chat template renders them with tojson)."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}: must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{j}].function.name: field required", param=f"{where}[{j}].function.name")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise RequestError(f"{where}[{j}].function.arguments: not valid JSON",
                                   param=f"{where}[{j}].function.arguments") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _image_part(part: dict, where: str) -> dict:
    """{"type": "image_url", "image_url": {"url"}} and vLLM's optional `uuid` naming the
    image; with a uuid the url may be left out (or null, or ""): the image sent under
    that uuid before (epd/inputs/media_uuids.py). A bare-string image_url: 400, as in vLLM."""
    image, uuid = part.get("image_url"), part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not uuid):
        raise RequestError(f"{where}.uuid: must be a non-empty string", param=f"{where}.uuid")
    if image is not None and not isinstance(image, dict):
        raise RequestError(f"{where}.image_url: must be an object {{\"url\": ...}}", param=f"{where}.image_url")
    url = (image or {}).get("url")
    if uuid is not None and not url:
        return {"type": "image_url", "image_url": {"url": None}, "uuid": uuid}
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.image_url.url: must be a non-empty string", param=f"{where}.image_url.url")
    return {"type": "image_url", "image_url": {"url": url}, **({"uuid": uuid} if uuid is not None else {})}


def _video_part(part: dict, where: str) -> dict:
    """{"type": "video_url", "video_url": {"url"}}: data:video/...;base64, file:// or http(s)://."""
    video = part.get("video_url")
    if not isinstance(video, dict):
        raise RequestError(f"{where}.video_url: must be an object {{\"url\": ...}}", param=f"{where}.video_url")
    url = video.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.video_url.url: must be a non-empty string", param=f"{where}.video_url.url")
    return {"type": "video_url", "video_url": {"url": url}}


def _audio_part(part: dict, where: str) -> dict:
    """OpenAI's {"type": "input_audio", "input_audio": {"data": base64, "format"}} or vLLM's
    {"type": "audio_url", "audio_url": {"url"}} (data:audio/...;base64, file:// or http(s)://)."""
    kind = part["type"]
    value = part.get(kind)
    if not isinstance(value, dict):
        raise RequestError(f"{where}.{kind}: must be an object", param=f"{where}.{kind}")
    if kind == "audio_url":
        url = value.get("url")
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}.audio_url.url: must be a non-empty string", param=f"{where}.audio_url.url")
        return {"type": "audio_url", "audio_url": {"url": url}}
    data, fmt = value.get("data"), value.get("format")
    if not isinstance(data, str) or not data:
        raise RequestError(f"{where}.input_audio.data: must be a non-empty base64 string",
                           param=f"{where}.input_audio.data")
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}.input_audio.data: not base64", param=f"{where}.input_audio.data") from None
    if fmt is not None and not isinstance(fmt, str):
        raise RequestError(f"{where}.input_audio.format: must be a string (\"wav\", \"mp3\", ...)",
                           param=f"{where}.input_audio.format")
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def _content_part(part: Any, role: str, where: str, takes_audio: bool = False) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text: must be a string", param=f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        if role != "user":
            raise RequestError(f"{where}.type: images are only allowed in user messages", param=f"{where}.type")
        return _image_part(part, where)
    if kind == "video_url":
        if role != "user":
            raise RequestError(f"{where}.type: videos are only allowed in user messages", param=f"{where}.type")
        return _video_part(part, where)
    if kind in ("input_audio", "audio_url") and takes_audio:
        if role != "user":
            raise RequestError(f"{where}.type: audio is only allowed in user messages", param=f"{where}.type")
        return _audio_part(part, where)
    expected = ("'text', 'image_url', 'video_url', 'input_audio' or 'audio_url'" if takes_audio else
                "'text', 'image_url' or 'video_url' (audio: only where the model takes it)")
    raise RequestError(f"{where}.type: unsupported content part type {kind!r}; expected {expected}",
                       param=f"{where}.type")
