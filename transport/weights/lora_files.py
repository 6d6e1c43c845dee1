"""A PEFT LoRA adapter's files, read and checked without torch: what the language
model's adapters (engine/lora/adapter.py) and the vision tower's
(encoders/tower_adapter.py) both need.

    <dir>/adapter_config.json        r, lora_alpha, use_rslora, target_modules, ...
    <dir>/adapter_model.safetensors  per adapted projection: `<module>.lora_A.weight` [r, in]
                                     and `<module>.lora_B.weight` [out, r]

`read_lora_files` checks the config (a rank above --max-lora-rank, options
that change the math beyond `x @ A^T @ B^T * scaling`) and reads the
safetensors header; each side then pairs and checks its own tensors. A
tensor of the vision tower (or its projector) is one whose name has a component
by which a family's transformers model or release names it (PEFT's names on
transformers' model: Qwen's and GLM's `...model.visual.blocks.N.attn.qkv...`,
Gemma 3's and InternVL's `vision_tower.` and `multi_modal_projector.`,
InternVL's original `vision_model.` and `mlp1.`), so none is ever read as a
language-model layer's (SigLIP's `encoder.layers.N.self_attn.q_proj`).
The header is bounded before it is parsed (`MAX_HEADER_BYTES`), and every
tensor's offsets are checked against its dtype, shape and the file's size
(safetensors' layout: the data ends where the file ends), so a sparse or
padded file is refused by its size, never read. `adapter_digest` hashes
the files in chunks: the embedding cache keys a tower
adapter's image embeddings by it (transport/embedding_cache/mm_cache.adapted_mm_hash), so
an adapter retrained in place is never served the old one's embeddings.
Here because encoders and engine may import only transport.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# a tensor of the vision tower: (module path inside the tower, "A" or "B")
TOWER_KEY = re.compile(r"(?:^|\.)visual\.(.+?)\.lora_([AB])(?:\.default)?\.weight$")
_TOWER_COMPONENT = re.compile(r"(?:^|\.)(?:visual|vision_tower|vision_model|multi_modal_projector|mlp1)\.")
# An adapter's header: ~150 bytes a tensor, so 2 MiB is ~14k tensors, 9x the ~1,500 of an adapter on
# every projection of an 80-layer model (7 a layer, A and B) and its tower's. safetensors allows 100 MB
# (78 MB took 11 s); json.loads holds the GIL, so even off the event loop a header stalls the API
# process while it is parsed: 2 MiB is ~0.15 s. A larger one is refused before it is read.
MAX_HEADER_BYTES = 2 << 20
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_CHUNK_BYTES = 1 << 20  # adapter_digest reads this much at a time


class LoRAAdapterError(ValueError):
    """The adapter cannot run on this model; the message names the field or tensor."""


class AdapterNotFoundError(LoRAAdapterError):
    """No adapter at the path: no directory, or one without adapter_config.json (answered
    alike over HTTP, as vLLM does: a key holder cannot map the server's directories)."""


@dataclass(frozen=True)
class LoRAFiles:
    """An adapter's checked config and its safetensors header (tensor name -> dtype, shape, offsets)."""

    where: str  # "LoRA adapter 'name' (path)": the start of every message about it
    rank: int
    scaling: float
    target_modules: object  # a list of names, a regex string (PEFT's forms) or None
    header: dict[str, dict]
    data_bytes: int = 0  # of the weights file's tensors (all of it but the header)

    def tower_keys(self) -> list[str]:
        """The names of the tensors that adapt the vision tower."""
        return [key for key in self.header if is_tower_key(key)]


def is_tower_key(key: str) -> bool:
    return _TOWER_COMPONENT.search(key) is not None


def read_lora_files(name: str, path: str | Path, max_lora_rank: int) -> LoRAFiles:
    """The adapter at `path`: config checked, header read; LoRAAdapterError naming what is wrong."""
    where = f"LoRA adapter {name!r} ({path})"
    cfg = _read_config(Path(path), where)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive int, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAAdapterError(f"{where}: r = {rank} is above --max-lora-rank {max_lora_rank}")
    if type(alpha) not in (int, float):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    _check_unsupported(cfg, where)
    header, data_bytes = _read_header(Path(path) / WEIGHTS_FILE, where)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoRAFiles(where, rank, float(scaling), cfg.get("target_modules"), header, data_bytes)


def touches_tower(path: str | Path) -> bool:
    """Whether the adapter at `path` holds weights of the vision tower (its header only)."""
    header, _ = _read_header(Path(path) / WEIGHTS_FILE, f"LoRA adapter at {path}")
    return any(is_tower_key(key) for key in header)


def adapter_digest(path: str | Path) -> str:
    """blake2b-256 of the adapter's config and weights files (64 hex chars), read in
    chunks (memory bounded whatever the files' size). OSError when they cannot be read."""
    digest = hashlib.blake2b(b"epd-lora-files-v1", digest_size=32)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with (Path(path) / file).open("rb") as f:
            digest.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def check_pairs(found: dict, where: str, describe) -> None:
    """Every adapted module has both lora_A and lora_B (`found[key] = {"A": name, "B": name}`)."""
    for key, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: {describe(key)} has lora_{next(iter(pair))} "
                                   f"but no lora_{'B' if 'A' in pair else 'A'}")


def check_shape(key: str, meta: dict, which: str, in_features: int, out_features: int, rank: int,
                what: str, where: str) -> None:
    """lora_A must be [r, in], lora_B [out, r]; `what` names the projection in the message."""
    want = [rank, in_features] if which == "A" else [out_features, rank]
    shape = list(meta.get("shape", []))
    if shape != want:
        raise LoRAAdapterError(f"{where}: tensor {key!r} has shape {shape}, expected {want} "
                               f"(r = {rank}; {what} is {in_features} -> {out_features} in this model: "
                               f"an adapter for another base model?)")


def _read_config(path: Path, where: str) -> dict:
    if not (path / CONFIG_FILE).is_file():
        raise AdapterNotFoundError(f"{where}: no {CONFIG_FILE} (a PEFT adapter directory is expected)")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _check_unsupported(cfg: dict, where: str) -> None:
    """PEFT options that change the math beyond x @ A^T @ B^T * scaling: refused, named."""
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{where}: use_dora is not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if cfg.get(name):
            raise LoRAAdapterError(f"{where}: {name} (per-module ranks or alphas) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not supported "
                               f"(an adapter may only add low-rank deltas to linear projections)")


def _read_header(path: Path, where: str) -> tuple[dict[str, dict], int]:
    """Tensor name -> {dtype, shape, data_offsets} from a safetensors file's header, and the
    bytes of its data; each tensor's offsets checked against its dtype and shape and the
    data against the file's size (what safetensors checks when it loads the file)."""
    if not path.is_file():
        extra = " (adapter_model.bin is not read: save with safe_serialization)" \
            if (path.parent / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"{where}: no {WEIGHTS_FILE}{extra}")
    try:
        with path.open("rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {size} bytes, above the {MAX_HEADER_BYTES} an adapter may have")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is not a safetensors file (its header is not a map)")
    header.pop("__metadata__", None)
    data_bytes = file_bytes - 8 - size
    end = _check_offsets(header, data_bytes, f"{where}: {WEIGHTS_FILE}")
    if end != data_bytes:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds {data_bytes} bytes of data, but its tensors "
                               f"take {end} (a padded, sparse or truncated file)")
    return header, data_bytes


def _check_offsets(header: dict, data_bytes: int, where: str) -> int:
    """Every tensor's [begin, end) within the data and as long as its dtype and shape say;
    returns where the last one ends."""
    end = 0
    for key, meta in header.items():
        shape, offsets = (meta.get("shape"), meta.get("data_offsets")) if isinstance(meta, dict) else (None, None)
        size = _DTYPE_BYTES.get(meta.get("dtype")) if isinstance(meta, dict) else None
        if size is None or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) \
                or not isinstance(offsets, list) or len(offsets) != 2 \
                or not all(type(o) is int for o in offsets):
            raise LoRAAdapterError(f"{where}: tensor {key!r} has no valid dtype, shape and data_offsets")
        begin, stop = offsets
        if not 0 <= begin <= stop <= data_bytes or stop - begin != math.prod(shape) * size:
            raise LoRAAdapterError(f"{where}: tensor {key!r} has data_offsets {offsets}, but its "
                                   f"{meta['dtype']} {shape} takes {math.prod(shape) * size} bytes "
                                   f"and the file holds {data_bytes}")
        end = max(end, stop)
    return end
