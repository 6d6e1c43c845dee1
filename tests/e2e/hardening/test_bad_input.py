"""Every bad input to the chat API is a 4xx with an OpenAI error body, and the
server goes on answering good requests with transformers' greedy text:
request bodies, images (inline, file:// and http(s) from the test's image
host), limits."""
from __future__ import annotations

import io

import pytest
from testkit.api_checks import (HUGE_BODY_BYTES, IMG, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_MODEL_LEN, MODEL,
                        TEXT_MESSAGES, answer_text, assert_error, assert_still_serving, chat_body, messages_with,
                        plain_server_model, post, url_part)
from testkit.media import image_bytes, image_part
from PIL import Image


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, format="PNG")  # 400 megapixels in ~50 KB
    return buf.getvalue()


BAD_BODIES = {  # name -> (body, status, message, param)
    "schema_missing_messages": ({"model": MODEL}, 400, "field required", "messages"),
    "schema_wrong_type": (chat_body("hello"), 400, "", "messages"),
    "schema_max_tokens_string": (chat_body(TEXT_MESSAGES, max_tokens="many"), 400, "", "max_tokens"),
    "empty_role": (chat_body([{"role": "", "content": "hi"}]), 400, "must be a non-empty string", "messages[0].role"),
    "role_not_a_string": (chat_body([{"role": ["user"], "content": "hi"}]), 400, "unsupported role",
                          "messages[0].role"),
    "temperature": (chat_body(TEXT_MESSAGES, temperature=7), 400, "", "temperature"),
    "top_p": (chat_body(TEXT_MESSAGES, top_p=0), 400, "", "top_p"),
    "n": (chat_body(TEXT_MESSAGES, n=0), 400, "", "n"),
    "presence_penalty": (chat_body(TEXT_MESSAGES, presence_penalty=3), 400, "", "presence_penalty"),
    "top_logprobs": (chat_body(TEXT_MESSAGES, logprobs=True, top_logprobs=99), 400, "", "top_logprobs"),
    "top_logprobs_without_logprobs": (chat_body(TEXT_MESSAGES, top_logprobs=2), 400, "requires logprobs", None),
    "min_tokens": (chat_body(TEXT_MESSAGES, min_tokens=9), 400, "min_tokens", "min_tokens"),
    "too_many_stops": (chat_body(TEXT_MESSAGES, stop=list("abcde")), 400, "stop", "stop"),
    "negative_seed_type": (chat_body(TEXT_MESSAGES, seed="x"), 400, "", "seed"),
    "too_long": (chat_body(TEXT_MESSAGES, max_tokens=MAX_MODEL_LEN + 1), 400, "cannot be greater than max_model_len",
                 "max_tokens"),  # vLLM's rule: a smaller max_tokens is cut to the room beside the prompt
    "unknown_model": ({**chat_body(TEXT_MESSAGES), "model": "gpt-17"}, 404, "does not exist", "model"),
}

BAD_MEDIA = {  # name -> (messages, message); all 400, param "messages"
    "bad_base64": (messages_with(url_part("data:image/png;base64,!!notbase64!!")), "invalid base64"),
    "not_an_image": (messages_with(image_part(b"just some text, no picture")), "cannot identify image"),
    "truncated": (messages_with(image_part(IMG[: len(IMG) // 2])), "could not be encoded"),
    "too_many_bytes": (messages_with(image_part(image_bytes(600, 600, seed=9))), "exceeds the limit"),
    "too_many_images": (messages_with(image_part(IMG), image_part(IMG), image_part(IMG)), "at most 2 images"),
    "too_many_pixels": (messages_with(image_part(image_bytes(400, 300, seed=5)), image_part(image_bytes(400, 300, seed=6))),
                        "pixels in all"),
    "unsupported_scheme": (messages_with(url_part("ftp://127.0.0.1/x.png")), "unsupported image url scheme"),
}


def test_malformed_json_is_400(server, expected):
    for content in (b'{"model": "epd-hardened", "messages": [', b"\xff\xfe garbage", b""):
        assert_error(post(server, content=content), 400)
    assert_error(post(server, content=b"[1, 2, 3]"), 400, "json object")
    assert_still_serving(server, expected)


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_request_body_is_refused(server, expected, name):
    body, status, message, param = BAD_BODIES[name]
    assert_error(post(server, body), status, message, param)
    assert_still_serving(server, expected)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", list(BAD_MEDIA))
def test_bad_image_is_refused_before_the_first_byte(server, expected, name, stream):
    """Streamed too: no 200 goes out before the image is known good, even for a
    truncated file only the encoder finds (EncodeDone(ok=False) -> prefill
    worker -> TokenOutput(error) -> RequestError)."""
    messages, message = BAD_MEDIA[name]
    assert_error(post(server, chat_body(messages), stream=stream), 400, message, "messages")
    assert_still_serving(server, expected, "image" if name == "truncated" else "text")


def test_decompression_bomb_is_refused_from_the_header(server, expected):
    encoded = server.settled_sum("epd:encoder_images_total", role="encoder")
    assert_error(post(server, chat_body(messages_with(image_part(_bomb())))), 400,
                 f"exceeds the limit of {MAX_IMAGE_PIXELS} pixels", "messages")
    assert server.settled_sum("epd:encoder_images_total", role="encoder") == encoded  # never reached an encoder
    assert_still_serving(server, expected, "image")


def test_file_urls_only_under_the_allowed_path(server, expected, media_dir):
    good = (media_dir / "allowed" / "img.png").as_uri()
    assert answer_text(post(server, chat_body(messages_with(url_part(good))))) == \
        answer_text(post(server, chat_body(messages_with(image_part(IMG)))))
    for url in ((media_dir / "outside.png").as_uri(), (media_dir / "allowed" / ".." / "outside.png").as_uri(),
                "file:///etc/passwd"):
        assert_error(post(server, chat_body(messages_with(url_part(url)))), 400, "outside the allowed", "messages")
    assert_error(post(server, chat_body(messages_with(url_part((media_dir / "allowed" / "nope.png").as_uri())))),
                 400, "cannot read", "messages")
    assert_still_serving(server, expected, "image")


# -- http(s) image URLs ----------------------------------------------------------------------------

def test_http_image_from_an_allowed_host(server, expected, media_host):
    base, _ = media_host
    reference = answer_text(post(server, chat_body(messages_with(image_part(IMG)))))
    for path in ("/img.png", "/redirect-ok"):
        for stream in (False, True):
            assert answer_text(post(server, chat_body(messages_with(url_part(base + path))), stream=stream)) \
                == reference


@pytest.mark.parametrize("path, message", [
    ("/missing.png", "answered http 404"),
    ("/text", "cannot identify image"),  # the header check, whatever Content-Type says
    ("/huge.png", f"exceeds the limit of {MAX_IMAGE_BYTES} bytes"),
    ("/redirect-away", "'localhost' is not in --allowed-media-domains"),
    ("/loop", "redirected more than 5 times"),
    ("/slow.png", "timed out after 1 s"),
])
def test_bad_http_image_is_refused(server, expected, media_host, path, message):
    base, httpd = media_host
    assert_error(post(server, chat_body(messages_with(url_part(base + path)))), 400, message, "messages")
    if path == "/huge.png":
        assert httpd.huge_sent < HUGE_BODY_BYTES / 2  # the fetcher stopped reading past the cap
    assert_still_serving(server, expected)


def test_disallowed_hosts_are_never_contacted(server, expected):
    for url in ("http://example.com/cat.png", "https://localhost/cat.png", "http://127.0.0.2/cat.png",
                "http://127.0.0.1@evil.example/cat.png"):
        assert_error(post(server, chat_body(messages_with(url_part(url)))), 400,
                     "is not in --allowed-media-domains", "messages")
    assert_still_serving(server, expected)


def test_defaults_refuse_http_and_file_urls(plain_server, media_host, media_dir):
    base, _ = media_host
    headers = {"authorization": "Bearer sk-hardening"}
    model = plain_server_model(plain_server)
    for url, message in ((base + "/img.png", "http(s) image urls are not allowed"),
                         ((media_dir / "allowed" / "img.png").as_uri(), "file:// image urls are not allowed")):
        body = {**chat_body(messages_with(url_part(url))), "model": model}
        assert_error(post(plain_server, body, headers=headers), 400, message, "messages")

