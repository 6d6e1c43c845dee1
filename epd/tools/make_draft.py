"""`epd make-model DIR --draft-of TARGET --num-layers N`: a draft model for
`{"method": "draft_model", ...}` made from a target checkpoint.

Nothing can be downloaded here, and a random small model would almost never
agree with a random target, so the draft is the target *truncated*: its
first N decoder layers, its embeddings, final norm and output head, the same
tokenizer and vision tower (it stays a checkpoint of the target's family,
which the engine serves). With random weights each layer adds a random
perturbation to the residual stream, so the fewer layers are cut the more
often the draft's argmax is the target's: acceptance is a knob, not a
property of the method. `--disagree` rolls the output head by one row, so
the draft proposes the id after its argmax: a draft the target (nearly)
never accepts, to measure what a rejected draft costs.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^(model\.language_model\.|language_model\.model\.|model\.)layers\.(\d+)\.")
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def make_draft(target_dir: str | Path, out_dir: str | Path, num_layers: int, disagree: bool = False) -> Path:
    """Writes the truncated copy of `target_dir` to `out_dir`; returns it.
    ValueError when `num_layers` is not in 1..the target's layers, or `disagree`
    asks to roll a head the target ties to its embeddings."""
    from safetensors.torch import load_file, save_file

    target, out = Path(target_dir), Path(out_dir)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    total = text["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers must be in 1..{total} (the target's layers), got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    for path in target.iterdir():  # tokenizer, chat template, generation and processor configs
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                               "model.safetensors.index.json"):
            shutil.copy2(path, out / path.name)
    for cfg in {id(c): c for c in (config, text)}.values():
        if "num_hidden_layers" in cfg:
            cfg["num_hidden_layers"] = num_layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            m = _LAYER.match(name)
            if m is None or int(m[2]) < num_layers:
                tensors[name] = tensor
    if disagree:
        heads = [name for name in _HEADS if name in tensors]
        if not heads or config.get("tie_word_embeddings") or text.get("tie_word_embeddings"):
            raise ValueError("--disagree rolls the output head, and this target ties it to its embeddings")
        for name in heads:  # logits'[i] = logits[i - 1]: the draft proposes the id after its argmax
            tensors[name] = tensors[name].roll(1, dims=0).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
