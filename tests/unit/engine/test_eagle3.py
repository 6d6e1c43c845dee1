"""EAGLE-3 heads (engine/spec/eagle3.py): the forward against a reference written from the
published architecture, the d2t vocabulary map, the loader, and `make-model --preset tiny-eagle3`."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epd.cli import build_parser
from epd.engine.spec.eagle3 import DenseKV, Eagle3Config, Eagle3Head, config_dict, load_eagle3, propose
from epd.tools.make_eagle3 import make_eagle3
from testkit.speculators_reference import reference_available, speculators_reference

BASE = Eagle3Config(hidden_size=32, target_hidden_size=48, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=100,
                    draft_vocab_size=40, aux_layer_ids=(1, 3, 5), num_speculative_tokens=3)
VARIANTS = {
    "llama": BASE,
    "norm-before-residual": replace(BASE, norm_before_residual=True),
    "qwen3-qk-norm": replace(BASE, qk_norm=True, model_type="qwen3"),
    "two-layers-norm-before-fc": replace(BASE, num_layers=2, norm_before_fc=True, norm_output=True),
    "fc-norm": replace(BASE, fc_norm=True, target_hidden_size=32),
}


def random_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
    """A head whose norms and biases are random too, so that each of them matters."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or "_norm." in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
        head.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
        head.t2d[ids] = True
    return head.eval()


# ---- the reference: the published architecture, written out on the raw tensors ----

def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # x [N, H, D], Llama's rotate-half layout
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]  # [N, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def reference(t: dict[str, torch.Tensor], cfg: Eagle3Config, aux: list[torch.Tensor], embeds, positions,
              hidden=None):
    """Full causal sequence at once: logits over the target vocab, and the hidden to feed back."""
    eps, n = cfg.rms_norm_eps, embeds.shape[0]
    if hidden is None:
        if cfg.fc_norm:
            aux = [rms(a, t[f"fc_norm.{i}.weight"], eps) for i, a in enumerate(aux)]
        x = torch.cat(aux, -1)
        if cfg.norm_before_fc:
            x = rms(x, t["input_norm.weight"], eps)
        hidden = x @ t["fc.weight"].T
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        if i == 0:
            normed = rms(hidden, t[p + "hidden_norm.weight"], eps)
            residual = normed if cfg.norm_before_residual else hidden
            x = torch.cat([rms(embeds, t[p + "input_layernorm.weight"], eps), normed], -1)
        else:
            residual, x = hidden, rms(hidden, t[p + "input_layernorm.weight"], eps)
        q = (x @ t[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_heads, cfg.head_dim)
        k = (x @ t[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = rms(q, t[p + "self_attn.q_norm.weight"], eps), rms(k, t[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.einsum("nhd,mhd->hnm", q, k) / cfg.head_dim ** 0.5
        o = torch.einsum("hnm,mhd->nhd", att.masked_fill(mask, float("-inf")).softmax(-1), v).reshape(n, -1)
        hidden = residual + o @ t[p + "self_attn.o_proj.weight"].T
        h = rms(hidden, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        hidden = hidden + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    normed = rms(hidden, t["norm.weight"], eps)
    draft = normed @ t["lm_head.weight"].T  # [N, draft_vocab]
    logits = torch.full((n, cfg.vocab_size), float("-inf"))
    for i in range(cfg.draft_vocab_size):  # draft id i is target id i + d2t[i]
        logits[:, i + int(t["d2t"][i])] = draft[:, i]
    return logits, (normed if cfg.norm_output else hidden)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_head_equals_the_reference_in_chunks_and_steps(name):
    cfg = VARIANTS[name]
    head = random_head(cfg)
    t = {k: v.detach() for k, v in head.state_dict().items()}
    torch.manual_seed(1)
    n = 7
    aux = [torch.randn(n, cfg.target_hidden_size) for _ in range(cfg.num_aux)]
    embeds, positions = torch.randn(n, cfg.hidden_size), torch.arange(10, 10 + n)
    want, want_feed = reference(t, cfg, aux, embeds, positions)
    kv = DenseKV(cfg.num_layers)
    with torch.no_grad():  # a prompt chunk, then the rest, through the head's KV cache
        first, feed1 = head.draft_logits([a[:4] for a in aux], embeds[:4], positions[:4], kv)
        second, feed2 = head.draft_logits([a[4:] for a in aux], embeds[4:], positions[4:], kv)
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([feed1, feed2]), want_feed, rtol=1e-5, atol=1e-5)
    # A later draft step feeds the head's own hidden (no fc): same as the reference on that input.
    step_embeds = torch.randn(1, cfg.hidden_size)
    with torch.no_grad():
        normed, _ = head(feed2[-1:], step_embeds, positions[-1:] + 1, kv.attend)
        got = head.compute_logits(normed)
    hidden_in = torch.cat([head.combine(aux).detach(), feed2[-1:]])
    ref_all, _ = reference(t, cfg, aux, torch.cat([embeds, step_embeds]), torch.cat([positions, positions[-1:] + 1]),
                           hidden=hidden_in)
    torch.testing.assert_close(got, ref_all[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "two-layers-norm-before-fc"])
def test_propose_drafts_greedily_and_keeps_only_target_fed_positions(name):
    """Drafts over two steps equal the reference run on the whole sequence: prompt positions
    fed with the target's features, then each draft fed with the head's previous hidden."""
    cfg = VARIANTS[name]
    head = random_head(cfg, seed=2)
    t = {k: v.detach() for k, v in head.state_dict().items()}
    table = torch.randn(cfg.vocab_size, cfg.hidden_size)
    torch.manual_seed(4)
    n, k = 5, 3
    aux = [torch.randn(n, cfg.target_hidden_size) for _ in range(cfg.num_aux)]
    next_ids, positions = torch.randint(0, cfg.vocab_size, (n,)), torch.arange(n)
    kv = DenseKV(cfg.num_layers)
    with torch.no_grad():
        drafts = propose(head, kv, aux, next_ids, positions, lambda ids: table[ids], k)
        fused = head.combine(aux)
    assert kv.length == n and drafts.shape == (k,)
    # the reference, one draft at a time, on the whole sequence so far
    hidden, ids, pos, want = fused, next_ids, positions, []
    for _ in range(k):
        logits, feed = reference(t, cfg, aux, table[ids], pos, hidden=hidden)
        want.append(int(logits[-1].argmax()))
        hidden, ids, pos = torch.cat([hidden, feed[-1:]]), torch.cat([ids, ids.new_tensor([want[-1]])]), \
            torch.cat([pos, pos[-1:] + 1])
    assert drafts.tolist() == want
    assert all(bool(head.t2d[d]) for d in want)  # drafts are target ids the draft vocab names
    # the next step starts from the n target-fed positions: as if the drafts had never run
    fresh = DenseKV(cfg.num_layers)
    with torch.no_grad():
        head(fused, table[next_ids], positions, fresh.attend)
    assert all(torch.equal(a, b) for a, b in zip(kv.k + kv.v, fresh.k + fresh.v))


def test_logits_land_on_the_target_ids_of_the_draft_vocab():
    head = random_head(BASE)
    normed = torch.randn(3, BASE.hidden_size)
    with torch.no_grad():
        logits, draft = head.compute_logits(normed), head.lm_head(normed)
    allowed = head.t2d
    assert int(allowed.sum()) == BASE.draft_vocab_size
    assert torch.isinf(logits[:, ~allowed]).all() and torch.isfinite(logits[:, allowed]).all()
    torch.testing.assert_close(logits[:, allowed], draft)  # ids ascending on both sides
    # truncating the cache drops rejected drafts: attending again gives the same output
    kv = DenseKV(1)
    x = torch.randn(5, 4, 8)
    first = kv.attend(0, x[:3], x[:3, :2], x[:3, :2], 0.3)
    kv.attend(0, x[3:], x[3:, :2], x[3:, :2], 0.3)
    kv.truncate(2)
    torch.testing.assert_close(kv.attend(0, x[2:3], x[2:3, :2], x[2:3, :2], 0.3), first[2:3])


def test_tiny_eagle3_matches_the_tiny_target_and_loads(tmp_path, tiny_model):
    out = make_eagle3(tmp_path / "head", "tiny-eagle3", seed=0)
    target = json.loads((Path(tiny_model) / "config.json").read_text())["text_config"]
    cfg, head = load_eagle3(out, target_num_layers=target["num_hidden_layers"])
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size) == \
        (target["hidden_size"], target["hidden_size"], target["vocab_size"])
    assert max(cfg.aux_layer_ids) <= target["num_hidden_layers"] and cfg.num_aux == 3
    assert cfg.draft_vocab_size == 512 and int(head.t2d.sum()) == 512 and head.embed_tokens is None
    assert cfg.num_speculative_tokens == 3 and cfg.norm_before_residual
    # the same seed writes the same head
    again = make_eagle3(tmp_path / "again", "tiny-eagle3", seed=0)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_loader_reads_eagle_midlayer_names_and_rejects_bad_maps(tmp_path):
    head = random_head(BASE)
    (tmp_path / "a").mkdir()
    cfg_json = json.dumps(config_dict(BASE))
    tensors = {k.replace("layers.0.", "midlayer."): v.contiguous() for k, v in head.state_dict().items()}
    del tensors["t2d"]  # rebuilt from d2t
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "a" / "config.json").write_text(cfg_json)
    _, loaded = load_eagle3(tmp_path / "a")
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    tensors["d2t"] = tensors["d2t"] + BASE.vocab_size  # maps past the target vocabulary
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        load_eagle3(tmp_path / "a")
    del tensors["fc.weight"]
    tensors["d2t"] = head.d2t.clone()
    save_file(tensors, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_eagle3(tmp_path / "a")


def test_default_aux_ids_need_the_target_depth():
    cfg = json.loads(json.dumps(config_dict(BASE)))
    del cfg["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(ValueError, match="number of layers"):
        Eagle3Config.from_dict(cfg)
    assert Eagle3Config.from_dict(cfg, target_num_layers=28).aux_layer_ids == (2, 14, 25)


def test_cli_writes_a_head(tmp_path, capsys):
    args = build_parser().parse_args(["make-model", str(tmp_path / "h"), "--preset", "tiny-eagle3"])
    assert args.func(args) == 0 and "tiny-eagle3" in capsys.readouterr().out
    assert json.loads((tmp_path / "h" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert "fc.weight" in load_file(str(tmp_path / "h" / "model.safetensors"))


@pytest.mark.skipif(not reference_available(), reason="scripts/env.sh dev installs the speculators reference")
def test_speculators_reads_our_head(tmp_path):
    """speculators' own config class reads the config.json `tiny-eagle3` writes as we do, and its
    own Eagle3DraftModel (first training-time-test step, eager attention) on our weights gives
    the logits our head gives."""
    out = make_eagle3(tmp_path / "head", "tiny-eagle3", seed=0)
    cfg, head = load_eagle3(out)
    torch.manual_seed(3)
    n = 6
    aux = [torch.randn(n, cfg.target_hidden_size) for _ in range(cfg.num_aux)]
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    token_ids, positions = torch.randint(0, cfg.vocab_size, (n,)), torch.arange(1, n + 1)
    theirs, their_logits = speculators_reference(out, torch.cat(aux, -1), token_ids, positions, embed,
                                                 tmp_path / "ref")
    assert theirs["class"] == "Eagle3SpeculatorConfig"
    assert theirs["draft_vocab_size"] == cfg.draft_vocab_size
    assert theirs["eagle_aux_hidden_state_layer_ids"] == list(cfg.aux_layer_ids)
    assert theirs["norm_before_residual"] is True and theirs["target_hidden_size"] == cfg.target_hidden_size
    assert theirs["speculative_tokens"] == cfg.num_speculative_tokens
    layer = theirs["transformer_layer_config"]
    assert (layer["hidden_size"], layer["head_dim"], layer["num_hidden_layers"], layer["vocab_size"]) == \
        (cfg.hidden_size, cfg.head_dim, cfg.num_layers, cfg.vocab_size)
    assert layer["rope_theta"] == cfg.rope_theta
    with torch.no_grad():
        normed, _ = head(head.combine(aux), embed[token_ids], positions, DenseKV(cfg.num_layers).attend)
        ours = head.lm_head(normed)
    torch.testing.assert_close(ours, their_logits, rtol=1e-5, atol=1e-5)
