"""file:// images read by the media fetcher: regular files only, never a hang,
never the server's resolved paths in an error (tests/e2e/hardening/test_file_media.py:
the same through a running server)."""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from testkit.api_checks import IMG

from epd.inputs.media import MediaConfig, MediaError, MediaFetcher, load_image_bytes


@pytest.fixture
def allowed(tmp_path):
    root = tmp_path / "allowed"
    root.mkdir()
    (root / "img.png").write_bytes(IMG)
    os.mkfifo(root / "pipe.png")
    (root / "folder.png").mkdir()
    (root / "empty.png").write_bytes(b"")
    (root / "loop.png").symlink_to(root / "loop.png")
    return root


@pytest.mark.parametrize("name, message", [
    ("pipe.png", "not a regular file"),  # opening it must not wait for a writer
    ("folder.png", "not a regular file"),
    ("empty.png", "empty"),
    ("missing.png", "cannot read the file"),
    ("loop.png", "malformed|cannot read"),  # a symlink loop
])
def test_only_regular_files_are_read(allowed, name, message):
    policy = MediaConfig(allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match=message) as err:
        load_image_bytes((allowed / name).as_uri(), policy)
    assert str(allowed) not in str(err.value) and str(allowed.resolve()) not in str(err.value)


def test_malformed_and_outside_paths_name_no_path(allowed, tmp_path):
    policy = MediaConfig(allowed_local_media_path=str(allowed))
    for url, message in (("file:///a%00b.png", "malformed"), ((tmp_path / "x.png").as_uri(), "outside the allowed"),
                         ("file://" + "/a" * 5000, "outside the allowed")):
        with pytest.raises(MediaError, match=message) as err:
            load_image_bytes(url, policy)
        assert str(tmp_path) not in str(err.value)
    assert load_image_bytes((allowed / "img.png").as_uri(), policy) == IMG


def test_file_reads_do_not_take_the_shared_thread_pool(allowed):
    """Eight file:// loads at once, with the event loop's default pool (what
    text requests' tokenizing uses) held to one thread that stays free."""
    policy = MediaConfig(allowed_local_media_path=str(allowed), fetch_timeout_s=5)

    async def scenario():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        fetcher = MediaFetcher(policy)
        try:
            loads = [fetcher.load((allowed / name).as_uri()) for name in ["pipe.png"] * 8 + ["img.png"]]
            results = await asyncio.gather(*loads, return_exceptions=True)
            text_work = await asyncio.to_thread(lambda: "tokenized")
            return results, text_work
        finally:
            await fetcher.aclose()

    results, text_work = asyncio.run(scenario())
    assert all(isinstance(r, MediaError) for r in results[:8]) and results[8] == IMG
    assert text_work == "tokenized"
