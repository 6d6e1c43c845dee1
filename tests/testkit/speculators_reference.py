"""Speculators' own classes as the reference for EAGLE-3 heads, run in a child process.

speculators pins transformers (<= 5.19) and pulls torchvision, torchaudio and
datasets: installed into the venv it would downgrade transformers and move
`AutoImageProcessor` onto torchvision (changing image pixels for every other
test). So scripts/env.sh installs it with --no-deps into
.venv/reference-speculators, with its training-only imports stubbed, and only this
child puts that folder on sys.path.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SPECULATORS_DIR = Path(__file__).resolve().parents[2] / ".venv" / "reference-speculators"


def reference_available() -> bool:
    return (SPECULATORS_DIR / "speculators").is_dir()


def speculators_reference(head_dir: str | Path, aux: torch.Tensor, token_ids: torch.Tensor,
                          positions: torch.Tensor, embed: torch.Tensor, work: Path) -> tuple[dict, torch.Tensor]:
    """One child process (importing speculators takes long): what speculators'
    `SpeculatorModelConfig.from_pretrained` reads from the head's config.json, and the
    draft-vocabulary logits [T, draft_vocab] of its own Eagle3DraftModel (eager attention,
    one training-time-test step) on one sequence: aux [T, num_aux * target_hidden], the
    token at each position's input, their RoPE positions, and the embedding table."""
    work.mkdir(parents=True, exist_ok=True)
    torch.save({"head_dir": str(head_dir), "aux": aux, "token_ids": token_ids, "positions": positions,
                "embed": embed, "out": str(work / "logits.pt")}, work / "job.pt")
    proc = subprocess.run([sys.executable, __file__, str(work / "job.pt")], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"speculators reference failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(work / "logits.pt")


def _forward(job: dict) -> None:
    from safetensors.torch import load_file
    from speculators import Eagle3DraftModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(job["head_dir"])
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(cfg).eval()
    weights = load_file(str(Path(job["head_dir"]) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "verifier_norm.weight",
                                                "verifier_lm_head.weight"}, (missing, unexpected)
    model.embed_tokens.weight.data.copy_(job["embed"])
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    n = job["token_ids"].shape[0]
    with torch.no_grad():
        model(hidden_states=job["aux"][None], input_ids=job["token_ids"][None],
              document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=job["positions"][None], ttt_steps=1)
    torch.save(captured[0][0], job["out"])


def _config(head_dir: str) -> dict:
    from speculators import SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(head_dir)
    layer = cfg.transformer_layer_config
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    return {
        "class": type(cfg).__name__,
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": cfg.eagle_aux_hidden_state_layer_ids,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "transformer_layer_config": {
            "hidden_size": layer.hidden_size, "head_dim": layer.head_dim, "vocab_size": layer.vocab_size,
            "num_hidden_layers": layer.num_hidden_layers,
            "rope_theta": rope.get("rope_theta", getattr(layer, "rope_theta", None)),
        },
    }


def _stub_training_only_packages() -> None:
    """`import speculators` reaches its training data loaders, which import `datasets`
    and `hs_connectors` at module level; nothing here calls them, so they are stubs."""
    import types

    def placeholder(module: str):
        def getattr_(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__module__": module})
        return getattr_

    for name in ("datasets", "hs_connectors"):
        stub = types.ModuleType(name)
        stub.__getattr__ = placeholder(name)
        sys.modules[name] = stub


if __name__ == "__main__":
    sys.path.insert(0, str(SPECULATORS_DIR))
    _stub_training_only_packages()
    job = torch.load(sys.argv[1])
    _forward(job)
    print(json.dumps(_config(job["head_dir"])))
