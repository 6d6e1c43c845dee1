"""An EAGLE-3 head that drafts what the tiny target says on given sequences.

A random head (`epd make-model --preset tiny-eagle3`) almost never guesses the
target's next tokens, so its acceptance is ~0: the engine's wiring would be
exercised but its acceptance counters would not show it. `fit_eagle3` keeps the
head's random layer and fits only its output head (`lm_head`, logistic
regression on the head's own hidden states) to the target's tokens two steps
ahead, on the token sequences given (prompts and their greedy continuations),
and widens the draft vocabulary (d2t / t2d) to cover them. Its first draft on
those sequences is then mostly right (later ones, fed its own hidden, less so):
acceptance well above 0, as a trained head would give on text like its training's.
The aux states are the engine's own model's (epd/families/qwen_vl/text_model.py
`forward_with_aux`), whose outputs the engine tests hold to transformers.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@torch.no_grad()
def _aux_states(model, token_ids: list[int], aux_layer_ids) -> list[torch.Tensor]:
    from epd.engine.attention import get_backend
    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.layers.forward_batch import ForwardBatch

    cfg, n, bs = model.cfg, len(token_ids), 16
    blocks = -(-n // bs)
    cache = torch.zeros(2, cfg.num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    batch = ForwardBatch(positions=torch.arange(n).expand(3, -1),
                         attn_meta=AttentionMetadata.build([n], [n], [list(range(blocks))], bs),
                         backend=get_backend("torch"), kv_caches=[(cache[0, i], cache[1, i]) for i in range(cfg.num_layers)])
    _, aux = model.forward_with_aux(torch.tensor(token_ids), batch, tuple(aux_layer_ids))
    return aux


def fit_eagle3(head_dir: str | Path, target_dir: str, sequences: list[list[int]], steps: int = 300) -> Path:
    """Rewrites the head in `head_dir` (made by make_eagle3 for `target_dir`'s preset)
    to predict token j + 1 from its entry for token j on each of `sequences`."""
    from transformers import AutoConfig

    from epd.engine.spec.eagle3 import DenseKV, load_eagle3
    from epd.engine.loader import load_language_model

    head_dir = Path(head_dir)
    cfg, head = load_eagle3(head_dir)
    model = load_language_model(target_dir, AutoConfig.from_pretrained(target_dir), torch.float32, "cpu")
    embed = model.model.embed_tokens.weight.detach()
    features, targets = [], []
    for seq in sequences:
        aux = _aux_states(model, seq, cfg.aux_layer_ids)
        with torch.no_grad():
            fused = head.combine([a[:-2] for a in aux])  # positions 0..T-3 -> entries of tokens 1..T-2
            entries = torch.tensor(seq[1:-1])
            normed, _ = head(fused, embed[entries], torch.arange(1, len(seq) - 1), DenseKV(cfg.num_layers).attend)
        features.append(normed)
        targets.append(torch.tensor(seq[2:]))  # entry of token j predicts token j + 1
    x, y = torch.cat(features), torch.cat(targets)
    needed = sorted(set(y.tolist()))
    others = [i for i in torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
              if i not in set(needed)]
    draft_ids = torch.tensor(sorted(needed + others[:cfg.draft_vocab_size - len(needed)]))
    labels = torch.searchsorted(draft_ids, y)
    weight = torch.zeros(cfg.draft_vocab_size, cfg.hidden_size, requires_grad=True)
    opt = torch.optim.Adam([weight], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(x @ weight.T, labels).backward()
        opt.step()
    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors["lm_head.weight"] = weight.detach().contiguous()
    tensors["d2t"] = draft_ids - torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(head_dir / "model.safetensors"), metadata={"format": "pt"})
    return head_dir
