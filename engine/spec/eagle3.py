"""EAGLE-3 draft heads in the format Speculators and vLLM publish: config, loader, forward.

An EAGLE-3 head drafts tokens from the target's own features. For each
position the target runs, it takes the residual stream *entering* three target
layers (`aux_layer_ids`: vLLM captures hidden + residual just before layer
id runs, so id 0 is the token embeddings; Speculators' default ids are
[2, L // 2, L - 3] for L target layers, and it also admits id L, the final
hidden state, which vLLM's layer loop never reaches: its exact form is to be
checked before a head that uses it is served), concatenated in ascending id order, and fuses
them with `fc` ([num_aux * target_hidden] -> hidden). Its first decoder layer
("midlayer" in EAGLE's own checkpoints) attends over
cat(input_layernorm(token embedding), hidden_norm(fused)) — q/k/v take
2 * hidden — with the fused (or, norm_before_residual, the normed fused) state
as the residual; further layers, if any, are plain Llama/Qwen3 layers. The final
`norm` and `lm_head` score a reduced draft vocabulary; `d2t` maps draft id i to
target id i + d2t[i] (`t2d` marks the target ids the draft can name).

Drafting, as vLLM and Speculators' training align it: the head's input at a
position is (the embedding of the *next* token, the target's fused features
at this position), and it predicts the token after that. Drafting k tokens:
step 1 feeds the target's features with the token the target just sampled;
step j > 1 feeds the head's own output hidden (pre-norm, or post-norm with
norm_output) with the token drafted at step j - 1; no `fc` there. RoPE
positions only matter up to a constant offset (vLLM uses the hidden state's
position; Speculators trains with the token's). The head keeps its own KV
cache: `DenseKV.attend` is that cache for one sequence; the engine may pass
its own (paged) attention with the same signature. `propose` is the whole
drafting step for one sequence (greedy drafts: the verifier's q is one-hot).

The token embedding is the target's unless the checkpoint has `embed_tokens`.
config.json: `speculators_model_type: "eagle3"` with `transformer_layer_config`
(a Llama or Qwen3 config), `draft_vocab_size`, `norm_before_residual`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_fc`,
`fc_norm`, `norm_output`, and `speculators_config` (proposal methods with
`speculative_tokens`, the verifier); EAGLE's older flat configs (the Llama
fields at the top level) load too. Weights: model.safetensors with `fc.*`,
`layers.N.*` (or `midlayer.*`), `norm.*`, `lm_head.*`, `d2t`, `t2d`.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from epd.engine.layers.norm import RMSNorm
from epd.engine.layers.rotary import rotate_half
from epd.engine.spec.eagle3_config import Eagle3Config
from epd.transport.weights.checkpoint import unfilled_embedding

# attend(layer_idx, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D], scale) -> [N, Hq, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, head_dim] float32 (Llama's half-split RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq  # [N, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, layer_idx: int):
        super().__init__()
        in_size = 2 * cfg.hidden_size if layer_idx == 0 else cfg.hidden_size  # layer 0: [embeds, hidden]
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        o = attend(self.layer_idx, q, k, v, self.head_dim ** -0.5)  # [N, Hq, D]
        return self.o_proj(o.reshape(n, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, layer_idx: int):
        super().__init__()
        self.is_first = layer_idx == 0
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Eagle3Attention(cfg, layer_idx)
        self.mlp = Eagle3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cos, sin, attend: Attend) -> torch.Tensor:
        if self.is_first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [N, 2 * hidden]
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        hidden = residual + self.self_attn(x, cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The head's modules, named as the published checkpoints name their tensors."""

    def __init__(self, cfg: Eagle3Config, has_embed_tokens: bool = False):
        super().__init__()
        self.cfg = cfg
        fused = cfg.num_aux * cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(fused, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(fused, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(Eagle3Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = unfilled_embedding(cfg.vocab_size, cfg.hidden_size) if has_embed_tokens else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def combine(self, aux_hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's states at `aux_layer_ids` (each [N, target_hidden], in id order) -> [N, hidden]."""
        assert len(aux_hidden_states) == self.cfg.num_aux, len(aux_hidden_states)
        if self.cfg.fc_norm:
            aux_hidden_states = [norm(h) for norm, h in zip(self.fc_norm, aux_hidden_states)]
        x = torch.cat(list(aux_hidden_states), dim=-1)  # [N, num_aux * target_hidden]
        if self.cfg.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    def forward(self, hidden: torch.Tensor, input_embeds: torch.Tensor, positions: torch.Tensor,
                attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] (combined target features, or the head's previous output),
        input_embeds [N, hidden], positions [N] -> (normed [N, hidden] for `compute_logits`,
        the hidden to feed back at the next draft step [N, hidden])."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers:
            hidden = layer(hidden, input_embeds, cos, sin, attend)
        normed = self.norm(hidden)
        return normed, normed if self.cfg.norm_output else hidden

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, target vocab]: the draft vocab's logits at their target ids
        (i + d2t[i]), -inf at the ids the draft cannot name."""
        draft = self.lm_head(normed)  # [N, draft_vocab]
        out = draft.new_full((draft.shape[0], self.cfg.vocab_size), float("-inf"))
        targets = torch.arange(self.cfg.draft_vocab_size, device=draft.device) + self.d2t
        out[:, targets] = draft
        return out

    def draft_logits(self, aux_hidden_states: Sequence[torch.Tensor], input_embeds: torch.Tensor,
                     positions: torch.Tensor, kv: DenseKV) -> tuple[torch.Tensor, torch.Tensor]:
        """First draft step from the target's features: (logits [N, vocab], hidden to feed back)."""
        normed, feed = self(self.combine(aux_hidden_states), input_embeds, positions, kv.attend)
        return self.compute_logits(normed), feed


class DenseKV:
    """The head's KV for one sequence, contiguous: [T, Hkv, D] per layer; causal in cache order."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        past = 0 if self.k[layer] is None else self.k[layer].shape[0]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        keys, values = self.k[layer], self.v[layer]  # [T, Hkv, D]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q.float(), keys.float()) * scale  # [Hq, N, T]
        query_pos = past + torch.arange(q.shape[0], device=q.device)
        mask = torch.arange(keys.shape[0], device=q.device)[None, :] > query_pos[:, None]  # [N, T]
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return torch.einsum("hnt,thd->nhd", probs, values.float()).to(q.dtype)

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def truncate(self, length: int) -> None:
        """Drops the entries past `length` (the rejected drafts' positions)."""
        self.k = [None if k is None else k[:length] for k in self.k]
        self.v = [None if v is None else v[:length] for v in self.v]


def propose(head: Eagle3Head, kv: DenseKV, aux_hidden_states: Sequence[torch.Tensor], next_token_ids: torch.Tensor,
            positions: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor], num_tokens: int) -> torch.Tensor:
    """One sequence's drafts, greedily (a deterministic proposer: the verifier takes q one-hot).

    The head first catches up on the N positions the target just ran (their aux
    states [N, target_hidden] each, the token that followed each, their
    positions); the last of them yields draft 1, and drafts 2.. feed the head's
    own hidden back. The KV keeps the N target-fed positions only: the drafts'
    entries are dropped, since accepted drafts come back next step with the
    target's features. Returns [num_tokens] int64 target ids.
    """
    kept = kv.length + len(next_token_ids)
    normed, feed = head(head.combine(aux_hidden_states), embed(next_token_ids), positions, kv.attend)
    drafts = [head.compute_logits(normed[-1:]).argmax(dim=-1)]  # [1]
    position = positions[-1:]
    for _ in range(num_tokens - 1):
        position = position + 1
        normed, feed = head(feed[-1:], embed(drafts[-1]), position, kv.attend)
        drafts.append(head.compute_logits(normed).argmax(dim=-1))
    kv.truncate(kept)
    return torch.cat(drafts)


def _renamed(name: str) -> str:
    """EAGLE's own checkpoints call layer 0 `midlayer`; vLLM-prefixed names lose `model.`."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def load_eagle3(path: str | Path, target_num_layers: int | None = None, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> tuple[Eagle3Config, Eagle3Head]:
    """config.json + *.safetensors in a directory -> (config, head in eval mode)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = Eagle3Config.from_dict(json.loads((path / "config.json").read_text()), target_num_layers)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update({_renamed(k): v for k, v in load_file(str(file)).items()})
    if not tensors:
        raise ValueError(f"{path}: no *.safetensors")
    head = Eagle3Head(cfg, has_embed_tokens="embed_tokens.weight" in tensors)
    if "d2t" not in tensors:  # no vocab map: the draft vocab is the target's
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"{path}: draft vocab {cfg.draft_vocab_size} != target {cfg.vocab_size} and no d2t")
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    tensors["t2d"] = _check_vocab_map(path, cfg, tensors["d2t"], tensors.get("t2d"))
    ignored = {"verifier_lm_head.weight", "verifier_norm.weight"}  # training-only, sometimes saved
    missing, unexpected = head.load_state_dict({k: v for k, v in tensors.items() if k not in ignored}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: EAGLE-3 weights do not match the config: missing {missing}, unexpected {unexpected}")
    return cfg, head.to(device=device, dtype=dtype).eval()


def _check_vocab_map(path: Path, cfg: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    """The t2d that d2t implies, after checking d2t names distinct target ids (and agrees with t2d)."""
    targets = torch.arange(len(d2t)) + d2t
    if len(d2t) != cfg.draft_vocab_size or int(targets.min()) < 0 or int(targets.max()) >= cfg.vocab_size:
        raise ValueError(f"{path}: d2t maps outside the target vocabulary of {cfg.vocab_size}")
    implied = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    implied[targets] = True
    if int(implied.sum()) != cfg.draft_vocab_size or (t2d is not None and not torch.equal(t2d.bool(), implied)):
        raise ValueError(f"{path}: d2t and t2d do not describe the same {cfg.draft_vocab_size} target ids")
    return implied


def config_dict(cfg: Eagle3Config, verifier_architectures: Sequence[str] = ()) -> dict:
    """Speculators' config.json for `cfg` (what `epd make-model --preset tiny-eagle3` writes)."""
    layer = {
        "model_type": cfg.model_type, "architectures": ["LlamaForCausalLM"] if cfg.model_type == "llama" else
        ["Qwen3ForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
        "mlp_bias": False, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    }
    fields = asdict(cfg)
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        **{k: fields[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": "float32",
    }
