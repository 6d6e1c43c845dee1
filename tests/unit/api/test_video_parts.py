"""`video_url` content parts and per-request `mm_processor_kwargs` at the edge,
without a server: the shapes vLLM accepts, --limit-mm-per-prompt's video
count, and a 400 naming the field for anything else."""
from __future__ import annotations

import pytest

from epd.api.protocol import GenerateRequest, RequestError, parse_chat_request

VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
TEXT = {"type": "text", "text": "What happens?"}


def request(content, max_videos: int | None = 1, **fields) -> GenerateRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    return parse_chat_request(body).to_generate_request("chatcmpl-1", max_images_per_prompt=4,
                                                        max_videos_per_prompt=max_videos)


def refused(content, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        request(content, **fields)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_a_video_part_is_kept_in_place():
    req = request([TEXT, VIDEO], mm_processor_kwargs={"fps": 1, "max_pixels": 4096})
    assert req.messages[0]["content"] == [TEXT, VIDEO]
    assert req.mm_processor_kwargs == {"fps": 1, "max_pixels": 4096}
    assert request([VIDEO, VIDEO], max_videos=None).messages[0]["content"] == [VIDEO, VIDEO]


def test_more_videos_than_the_limit():
    err = refused([VIDEO, VIDEO])
    assert (err.param, err.message) == ("messages", "at most 1 video per request is allowed, got 2 "
                                                    "(--limit-mm-per-prompt)")
    assert "at most 0 videos" in refused([VIDEO], max_videos=0).message


@pytest.mark.parametrize("part, param, message", [
    ({"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}, "messages[0].content[0].video_url",
     "must be an object"),
    ({"type": "video_url", "video_url": {"url": ""}}, "messages[0].content[0].video_url.url", "non-empty string"),
    ({"type": "video_url"}, "messages[0].content[0].video_url", "must be an object"),
    ({"type": "input_video", "video_url": {"url": "x"}}, "messages[0].content[0].type", "'video_url'"),
])
def test_malformed_video_parts(part, param, message):
    err = refused([part])
    assert err.param == param and message in err.message


def test_videos_only_in_user_messages():
    body = {"model": "m", "messages": [{"role": "assistant", "content": [VIDEO]}]}
    with pytest.raises(RequestError, match="videos are only allowed in user messages"):
        parse_chat_request(body).to_generate_request("chatcmpl-1")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_frame_count": 8}, "max_frame_count cannot be applied"),
    ({"fps": 0}, "fps must be a positive number"),
    ({"fps": 2, "num_frames": 8}, "fps and num_frames exclude each other"),
    ({"num_frames": 1.5}, "num_frames must be a positive integer"),
    ({"do_sample_frames": "yes"}, "do_sample_frames must be true or false"),
])
def test_bad_mm_processor_kwargs_name_the_field(kwargs, message):
    err = refused([VIDEO, TEXT], mm_processor_kwargs=kwargs)
    assert err.param == "mm_processor_kwargs" and message in err.message
