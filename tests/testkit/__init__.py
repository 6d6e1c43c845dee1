"""Helpers the tests share (not tests): real `epd serve` processes
(`testkit.server`, `testkit.mode_servers`), test images and chats
(`testkit.media`), transformers' reference outputs (`testkit.hf_reference`),
checkpoints, fault injection and the bench tests' fake OpenAI server.
Importable as `testkit` because pyproject.toml's pytest `pythonpath` puts
tests/ on sys.path; a name of its own, so `from testkit.server import ...`
is never read as `epd/api/server.py`."""
