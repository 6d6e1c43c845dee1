"""Facts about a checkpoint discovered when it is opened (not configuration).

Read from the Hugging Face directory: special token ids, EOS ids, the model
length, KV geometry, the dtype, and a fingerprint of the weights used in
embedding-cache keys so two checkpoints never share cache entries.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from epd.families.registry import check_family, family_of, load_hf_config, served_config

FINGERPRINT_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    model_dir: str
    family: str  # model_type of a family in epd/families/registry.py
    image_token_id: int  # config.json's: every image placeholder position holds it
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    spatial_merge_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    checkpoint_dtype: str
    fingerprint: str
    video_token_id: int = -1  # -1: none in config.json
    tokens_per_second: float = 1.0  # Qwen2.5-VL's vision config: video temporal positions per second

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config=None) -> "ModelInfo":
        model_dir = Path(model_dir)
        if hf_config is None:
            check_family(model_dir)  # before transformers, which may not know the type either
        cfg = served_config(hf_config) if hf_config is not None else load_hf_config(model_dir)
        family = family_of(cfg)
        tc = cfg.text_config
        return cls(
            model_dir=str(model_dir),
            family=family.model_type,
            image_token_id=_image_token_id(cfg),
            eos_token_ids=_eos_token_ids(model_dir, tc),
            max_model_len=int(tc.max_position_embeddings),
            spatial_merge_size=int(getattr(cfg.vision_config, "spatial_merge_size", None) or 1),
            num_layers=tc.num_hidden_layers,
            num_kv_heads=tc.num_key_value_heads or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            checkpoint_dtype=str(getattr(cfg, "dtype", None) or getattr(tc, "dtype", None) or "float32")
            .replace("torch.", ""),
            fingerprint=weights_fingerprint(model_dir),
            video_token_id=int(getattr(cfg, "video_token_id", None) or -1),
            tokens_per_second=float(getattr(cfg.vision_config, "tokens_per_second", None) or 1.0),
        )


def _image_token_id(cfg) -> int:
    """config.json's image token: `image_token_id`, or `image_token_index` as some families name it."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(cfg, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{cfg.model_type} config has no image_token_id")


def _eos_token_ids(model_dir: Path, text_config) -> tuple[int, ...]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    eos = getattr(text_config, "eos_token_id", None)
    ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap digest that changes when the weights change: config.json plus,
    for every safetensors file, its size and its first and last MiB."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + size.to_bytes(8, "little"))
        with path.open("rb") as f:
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
            if size > FINGERPRINT_SAMPLE_BYTES:
                f.seek(max(FINGERPRINT_SAMPLE_BYTES, size - FINGERPRINT_SAMPLE_BYTES))
                h.update(f.read())
    return h.hexdigest()
