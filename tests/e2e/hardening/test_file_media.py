"""file:// images through a running server: a FIFO is a 400, never a hang or a
500, and the error names none of the server's resolved paths
(tests/unit/inputs/test_file_media.py checks the fetcher's rules themselves)."""
from __future__ import annotations

import os

from testkit.api_checks import assert_error, assert_still_serving, chat_body, messages_with, post, url_part


def test_a_fifo_url_is_a_400_and_the_server_keeps_serving(server, expected, media_dir):
    fifo = media_dir / "allowed" / "fifo.png"
    if not fifo.exists():
        os.mkfifo(fifo)
    for _ in range(8):  # each used to hold a thread for good
        error = assert_error(post(server, chat_body(messages_with(url_part(fifo.as_uri())))), 400,
                             "not a regular file", "messages")
        assert str(media_dir) not in error["message"]
    assert_error(post(server, chat_body(messages_with(url_part("file:///a%00b.png")))), 400, "", "messages")
    assert_still_serving(server, expected, "text")
    assert_still_serving(server, expected, "image")
