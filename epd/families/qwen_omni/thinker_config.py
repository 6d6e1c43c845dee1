"""How a Qwen2.5-Omni checkpoint is read: its thinker only (torch-free).

A whole Omni checkpoint (config.json model_type "qwen2_5_omni") nests the
thinker's config under `thinker_config` beside the talker's and token2wav's,
and prefixes its tensors `thinker.`, `talker.`, `token2wav.`; EPD serves the
thinker (text out), so it reads `thinker_config` and the `thinker.` tensors
and never the speech side. A thinker-only checkpoint ("qwen2_5_omni_thinker")
is read the same way, its names with or without the prefix.
"""
from __future__ import annotations

_SPEECH = ("talker.", "token2wav.")


def thinker_config(hf_config):
    """The thinker's config of a whole Omni config, or the thinker config itself."""
    return getattr(hf_config, "thinker_config", None) or hf_config


def strip_thinker(name: str) -> str | None:
    """A checkpoint name without its `thinker.` prefix; None for the speech side's."""
    if name.startswith(_SPEECH):
        return None
    return name[len("thinker."):] if name.startswith("thinker.") else name
