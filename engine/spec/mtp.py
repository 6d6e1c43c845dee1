"""MTP speculation: a release's own multi-token-prediction layers draft for it.

`{"method": "mtp", "num_speculative_tokens": k}` (vLLM's; its older spellings "qwen3_5_mtp" and
"qwen3_next_mtp" read the same) takes the draft head from the target's own checkpoint: the model
builds it (`load_mtp_head`, e.g. epd/families/qwen3_5/mtp.py) with the draft-head interface the
EAGLE-3 proposer drives (engine/spec/eagle3_proposer.py: its paged KV sharing the target's block
ids, the catch-up after every target forward, k greedy drafts before every schedule), so an MTP
head is served exactly as an EAGLE-3 head is, reading the target's last hidden state instead of
three layers' streams. A model without MTP layers is refused by name at start-up.
"""
from __future__ import annotations

from pathlib import Path

import torch


def load_mtp_head(model, model_dir: str | Path, hf_config, dtype: torch.dtype, device: torch.device):
    """(shape, head) of the target's MTP layers; ValueError when the model has none to serve."""
    loader = getattr(model, "load_mtp_head", None)
    if loader is None:
        raise ValueError(f"--speculative-config: method mtp needs a model with MTP layers; "
                         f"{type(model).__name__} has none (use ngram, eagle3 or draft_model)")
    return loader(model_dir, hf_config, dtype, device)


def check_mtp_layers(hf_config) -> None:
    """ValueError unless the checkpoint's config declares MTP layers (`mtp_num_hidden_layers`,
    as the releases that ship them say), read before any weight is loaded."""
    text = getattr(hf_config, "text_config", hf_config)
    if not getattr(text, "mtp_num_hidden_layers", 0):
        raise ValueError(f"--speculative-config: method mtp needs the checkpoint's MTP layers, and its config "
                         f"declares none (no mtp_num_hidden_layers; model_type "
                         f"{getattr(hf_config, 'model_type', '?')!r})")
