"""`OrchestratorLike`: all the HTTP edge knows of the serving layer behind it
(epd/serve/orchestrator.py is one; the API tests serve a fake)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from epd.requests import Delta, GenerateRequest
from epd.transport.wire.lora_request import LoRARequest


class OrchestratorLike(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids a client names must be below it

    def missing_roles(self) -> list[str]:
        """Roles the deployment needs that have no live worker now ([]: healthy)."""
        ...

    def metrics_text(self) -> bytes: ...

    def decode_token(self, token_id: int) -> str: ...

    async def tokenize(self, request: GenerateRequest, add_special_tokens: bool = False) -> list[int]:
        """The prompt token ids `generate(request)` would send, image placeholders included
        (/tokenize); RequestError for bad input, as generate() raises it."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included (/detokenize)."""
        ...

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's string of each token (/tokenize's return_token_strs)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """One sequence; raises RequestError before the first Delta for bad input;
        the last Delta has finish_reason set; aclose() aborts it."""
        ...

    async def update_lora(self, lora: LoRARequest, is_load: bool) -> None:
        """A runtime adapter load (checked against the model first: ValueError naming what
        is wrong) or unload, announced to every worker that runs adapters."""
        ...
