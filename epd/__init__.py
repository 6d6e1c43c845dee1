"""EPD: disaggregated encode / prefill / decode serving for vision-language models.

`from epd import LLM, SamplingParams` for offline inference; `epd serve` for
the OpenAI-compatible server. Heavy imports (torch) happen on first use.

api/                     the HTTP edge: OpenAI routes, request bodies, response formats
serve/                   the request plane: prepare, place, route, retry, collect
processes/               the process plane: start, supervise, scale and stop the workers
families/                the model families served: one package each, one registry
inputs/                  request inputs: media fetching, prompts, the checkpoint's files
cli/                     the `epd` command
families/                the model families, one package each
tools/                   `epd make-model` and the speculative heads' makers
llm.py                   offline inference (`LLM`)
requests.py              the types the HTTP edge and the orchestrator speak
config.py                the composed, frozen configuration of each command
detokenizer.py           token ids -> stable text chunks
output_processor.py      one sequence's outputs -> text, stop strings, logprobs (LLM and server)
flag_values.py           flag values written as vLLM writes them
lora_modules.py          `--lora-modules`: the adapters served by name
shared_lora_registry.py  one adapter registry for every API process
multiprocess_metrics.py  whether this process's metrics are one of several API processes'
version.py               the package version
"""
from __future__ import annotations

from epd.version import __version__
__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "SamplingParams":
        from epd.transport.wire.sampling import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from epd.transport.wire.lora_request import LoRARequest

        return LoRARequest
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from epd import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'epd' has no attribute {name!r}")
