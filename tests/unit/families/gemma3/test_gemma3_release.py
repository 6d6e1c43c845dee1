"""Gemma 3 in its releases' file layout (google/gemma-3-4b-it's, made from the tiny checkpoint;
nothing is downloaded): weights in two shards with an index and the release's tensor names
(`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`, no
`lm_head`), the chat template in chat_template.json only, the release's generation config
(sampling defaults, `cache_implementation: hybrid`). The offline LLM serves it as it serves the
tiny checkpoint: same greedy tokens and logprobs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from testkit.media import MIXED_BATCH

from epd.transport.wire.sampling import SamplingParams

RELEASE_GENERATION = {"cache_implementation": "hybrid", "do_sample": True, "top_k": 64, "top_p": 0.95}
CHATS = [MIXED_BATCH[0], MIXED_BATCH[2], MIXED_BATCH[4]]  # text, two images, text around an image


def release_name(name: str) -> str:
    """transformers' saved name -> the release's."""
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def release_checkpoint(model_dir: str, out: Path) -> str:
    src = Path(model_dir)
    out.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "chat_template.jinja":
            shutil.copy(path, out / path.name)
    tensors = {release_name(k): v for k, v in load_file(src / "model.safetensors").items()}
    assert "lm_head.weight" not in tensors and any(k.startswith("vision_tower.vision_model.") for k in tensors)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "chat_template.json").write_text(json.dumps({"chat_template": tok_cfg.pop("chat_template")}))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **RELEASE_GENERATION}))
    return str(out)


def _greedy(model_dir: str) -> list:
    from epd import LLM

    llm = LLM(model_dir, dtype="float32")
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs]


def test_the_release_layout_serves_as_the_tiny_checkpoint(gemma3_model, tmp_path):
    release = release_checkpoint(gemma3_model, tmp_path / "release")
    assert not (Path(release) / "model.safetensors").exists()
    got, want = _greedy(release), _greedy(gemma3_model)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, got_top), (_, want_top) in zip(got, want):
        for g, w in zip(got_top, want_top):
            assert [i for i, _ in g] == [i for i, _ in w]
            torch.testing.assert_close(torch.tensor([lp for _, lp in g]), torch.tensor([lp for _, lp in w]))
