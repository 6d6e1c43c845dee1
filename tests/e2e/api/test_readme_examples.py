"""Every Python example in README.md and docs/openai_api.md runs as written.

The blocks are read from the two pages themselves, so they cannot drift from
what works. They run in order in one namespace, as a reader pastes them into
one session (docs/openai_api.md's Responses, structured-output and tool
examples use the `client`, `model` and `image_url` README's OpenAI-client
example made), against the shared
aggregated server of the tiny checkpoint. Three placeholders a reader
replaces are replaced, nothing else: the server's address (the README says
127.0.0.1:8000), the checkpoint (`./ckpt`) and the picture
(`file:///path/to/picture.png`).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "openai_api.md")  # README's examples first: the API page goes on from them


def python_blocks() -> list[str]:
    return [block for page in PAGES
            for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)]


def test_the_readme_has_its_examples():
    blocks = python_blocks()
    assert len(blocks) >= 4, "README.md / docs/openai_api.md lost their Python examples (or their ```python fences)"
    assert any("OpenAI(" in b for b in blocks) and any("LLM(" in b for b in blocks)


@pytest.mark.parametrize("mode_server", ["aggregated"], indirect=True)
def test_every_python_example_in_the_readme_runs(mode_server, tiny_model):
    port = mode_server.base_url.rsplit(":", 1)[1]
    picture = "file://" + str(ROOT / "docs" / "demo.png")
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)  # the examples open docs/demo.png as the README's reader would, from the checkout
    try:
        for i, block in enumerate(python_blocks()):
            code = (block.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace('"./ckpt"', repr(tiny_model))
                    .replace("file:///path/to/picture.png", picture))
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"python block {i}", "exec", dont_inherit=True), namespace)  # noqa: S102
            if "print(" in block:
                assert printed.getvalue().strip(), f"python block {i} printed nothing"
    finally:
        os.chdir(cwd)
    # what the examples promise
    assert namespace["out"][0].outputs[0].text  # offline LLM.chat
    assert namespace["response"].status in ("completed", "incomplete")  # the Responses API stream, folded
    assert namespace["label"] in ("yes", "no")  # the structured-outputs choice
    assert namespace["call"].function.name == "get_weather" and isinstance(namespace["args"]["city"], str)
