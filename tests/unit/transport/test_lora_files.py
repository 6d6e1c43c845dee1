"""transport/weights/lora_files.py's bounds (issue 44): a safetensors header above
MAX_HEADER_BYTES is refused before it is read, every tensor's data_offsets
must match its dtype and shape, the data must end where the file ends (no
padding, no sparse hole), and adapter_digest, which reads in chunks, gives
the digest of the whole files as before."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest

from epd.transport.weights.lora_files import (MAX_HEADER_BYTES, AdapterNotFoundError, LoRAAdapterError, adapter_digest,
                                      read_lora_files)

KEY = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_{}.weight"


def _adapter(path, header: dict, data: bytes, header_len: int | None = None, pad: int = 0):
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    blob = json.dumps(header).encode()
    with (path / "adapter_model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
        if pad:
            f.truncate(8 + len(blob) + len(data) + pad)
    return path


def _good(path):
    header = {KEY.format("A"): {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
              KEY.format("B"): {"dtype": "F16", "shape": [4, 2], "data_offsets": [32, 48]}}
    return _adapter(path, header, bytes(range(48)))


def test_a_well_formed_adapter_reads(tmp_path):
    files = read_lora_files("ok", _good(tmp_path / "ok"), max_lora_rank=8)
    assert files.rank == 2 and files.data_bytes == 48 and set(files.header) == {KEY.format("A"), KEY.format("B")}


def test_a_header_above_the_bound_is_refused_before_it_is_read(tmp_path):
    path = _adapter(tmp_path / "big", {}, b"", header_len=MAX_HEADER_BYTES + 1)  # claims more than it holds
    with pytest.raises(LoRAAdapterError, match=f"'big'.*a header of {MAX_HEADER_BYTES + 1} bytes, above"):
        read_lora_files("big", path, max_lora_rank=8)


@pytest.mark.parametrize("case, meta, pad, match", [
    ("short", {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 16]}, 0, "takes 32 bytes"),
    ("past the end", {"dtype": "F32", "shape": [2, 4], "data_offsets": [48, 80]}, 0, "the file holds 48"),
    ("no dtype", {"dtype": "Q4", "shape": [2, 4], "data_offsets": [0, 32]}, 0, "no valid dtype"),
    ("a sparse tail", None, 1 << 30, "holds 1073741872 bytes of data, but its tensors take 48"),
])
def test_offsets_are_checked_against_dtype_shape_and_file_size(tmp_path, case, meta, pad, match):
    header = {KEY.format("A"): {"dtype": "F32", "shape": [2, 4], "data_offsets": [0, 32]},
              KEY.format("B"): {"dtype": "F16", "shape": [4, 2], "data_offsets": [32, 48]}}
    if meta is not None:
        header[KEY.format("B")] = meta
    path = _adapter(tmp_path / "bad", header, bytes(48), pad=pad)
    with pytest.raises(LoRAAdapterError, match=match):
        read_lora_files("bad", path, max_lora_rank=8)


def test_no_config_is_not_found(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(AdapterNotFoundError):
            read_lora_files("x", path, max_lora_rank=8)


def test_the_chunked_digest_is_the_whole_files_digest(tmp_path):
    path = _good(tmp_path / "ok")
    whole = hashlib.blake2b(b"epd-lora-files-v1", digest_size=32)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (path / name).read_bytes()
        whole.update(len(data).to_bytes(8, "little"))
        whole.update(data)
    assert adapter_digest(path) == whole.hexdigest()
