"""`check_speculative_model`: whether `--speculative-config`'s "model" (an EAGLE-3 head
or a draft model) drafts for the target, read from its files (config.json, the
tokenizer) without loading a weight; a ValueError names what does not fit.

`epd serve` (epd/cli/serve_command.py check_checkpoint) and the offline `LLM` call it
before any worker or engine starts: a head or a draft for another target is one line
and exit code 2, not a traceback from each decode-side worker. The workers check again
as they load (engine/spec/eagle3_proposer.py load_head, engine/spec/draft_model.py).
Pure Python (no torch).
"""
from __future__ import annotations

import json
from pathlib import Path

from epd.engine.spec.config import SpeculativeConfig
from epd.engine.spec.eagle3_config import Eagle3Config


def check_speculative_model(spec: SpeculativeConfig | None, model_dir: str | Path, tokenizer_dir: str | Path | None,
                            hf_config) -> None:
    """`hf_config`: the target's transformers config (its `text_config` gives hidden
    size, vocabulary and layers); `tokenizer_dir`: --tokenizer (None: the checkpoint's)."""
    if spec is None or spec.method == "ngram":
        return
    if spec.method == "eagle3":
        text = hf_config.text_config
        head_config(spec.model, text.num_hidden_layers).check_fits(spec.model, text.hidden_size, text.vocab_size,
                                                                   text.num_hidden_layers)
    elif spec.method == "mtp":
        from epd.engine.spec.mtp import check_mtp_layers

        check_mtp_layers(hf_config)
    elif spec.method == "draft_model":
        from epd.families.registry import check_family

        check_family(spec.model)  # UnsupportedModelError (a ValueError) names the families served
        check_same_vocab(tokenizer_dir or model_dir, spec.model)


def head_config(path: str | Path, target_num_layers: int) -> Eagle3Config:
    """The EAGLE-3 head's config at `path`, read and checked as the loader reads it."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except OSError as exc:
        raise ValueError(f"--speculative-config: cannot read the EAGLE-3 head at {path}: {exc.strerror} "
                         f"({path / 'config.json'})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--speculative-config: {path / 'config.json'} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--speculative-config: {path / 'config.json'} is not a JSON object")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"--speculative-config: the EAGLE-3 head at {path} holds no *.safetensors")
    try:
        return Eagle3Config.from_dict(raw, target_num_layers)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"--speculative-config: {path / 'config.json'} is not an EAGLE-3 head's config "
                         f"(missing or wrong {exc})") from None


def check_same_vocab(target_dir: str | Path, draft_dir: str | Path) -> None:
    """ValueError unless the two tokenizers map the same tokens to the same ids: a
    draft's token ids are verified as the target's."""
    from transformers import AutoTokenizer

    try:
        draft = AutoTokenizer.from_pretrained(str(draft_dir)).get_vocab()
    except (OSError, ValueError) as exc:
        raise ValueError(f"--speculative-config: the draft model {draft_dir} has no tokenizer to check "
                         f"against the target's: {exc}") from None
    target = AutoTokenizer.from_pretrained(str(target_dir)).get_vocab()
    if draft != target:
        moved = sum(1 for token, i in target.items() if draft.get(token) != i)
        raise ValueError(f"--speculative-config: the draft model {draft_dir} has another vocabulary than the "
                         f"target's ({len(draft)} tokens against {len(target)}; {moved} of the target's tokens "
                         "missing or with another id): a draft model must use the target's tokenizer")
