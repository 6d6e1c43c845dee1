"""`LoRARequest`: which adapter a request runs with (vLLM's `LoRARequest`).

It travels with the request (PrefillRequest, then KVTransfer to the decode
worker), so every worker loads the adapter from `lora_path` itself and keys
its prefix cache by it and the digest of the files it read (engine/block_manager.py). Torch-free (the API
process imports it through epd/requests.py); the wire form is read in
transport/wire/request_messages.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's fields and order: `LoRARequest(lora_name, lora_int_id, lora_path)`.

    `lora_int_id` must be positive (vLLM's rule; 0 would mean no adapter). Two
    requests share an adapter (its slot, its cached KV) when name and path are equal
    and the worker read the same files (`Request.lora_key`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must name the adapter's directory")

    @property
    def key(self) -> tuple[str, str]:
        """What a worker reads an adapter by: name and directory."""
        return self.lora_name, self.lora_path

    def to_list(self) -> list:
        return [self.lora_name, self.lora_int_id, self.lora_path]

    @classmethod
    def from_list(cls, value) -> LoRARequest:
        """[name, id, path] as `to_list` writes it; ValueError otherwise."""
        ok = isinstance(value, list) and len(value) == 3 and type(value[0]) is str \
            and type(value[1]) is int and type(value[2]) is str
        if not ok:
            raise ValueError(f"expected [lora_name, lora_int_id, lora_path] or None, got {value!r:.80}")
        return cls(*value)
