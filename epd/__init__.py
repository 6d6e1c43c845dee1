"""EPD: disaggregated encode / prefill / decode serving for vision-language models.

`from epd import LLM, SamplingParams` for offline inference; `epd serve` for
the OpenAI-compatible server. Heavy imports (torch) happen on first use.
"""
from __future__ import annotations

from epd.version import __version__
__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "SamplingParams":
        from epd.transport.sampling import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from epd.transport.lora_request import LoRARequest

        return LoRARequest
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from epd import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'epd' has no attribute {name!r}")
