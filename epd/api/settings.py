"""`ApiSettings`: what the HTTP app serves and whom (built once by the launcher)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from epd.api.tool_calls import DEFAULT_TOOL_PARSER
from epd.inputs.sampling_defaults import SamplingDefaults
from epd.lora_modules import LoRAModule, LoRARegistry
from epd.transport.wire.lora_request import LoRARequest
from epd.version import __version__


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_images_per_prompt: int | None = None  # None: no limit
    max_videos_per_prompt: int | None = None  # None: no limit
    max_audios_per_prompt: int = 0  # 0: audio parts refused (a model without an audio side, or the limit 0)
    max_request_body_bytes: int = 64 << 20  # larger bodies get 413 before they are read (--max-request-body-mb)
    metrics_require_key: bool = False  # --metrics-require-key: /metrics behind the API key too (vLLM leaves it open)
    metrics_model_name: str | None = None  # the model_name label of /metrics (None: served_model_name); never a path
    # the values of omitted sampling fields (--generation-config), read from the checkpoint once at start-up
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_logprobs: int = 20  # --max-logprobs: logprobs / top_logprobs a request may ask (-1: the wire's 20)
    log_requests: bool = False  # --enable-log-requests: one log line per generation request
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser: tool_choice "auto"'s format (epd/api/tool_parsers/)
    # CORS (--allowed-origins ...): no origins, no CORS middleware
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    version: str = __version__  # what /version answers
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules: adapters a request's `model` may name
    # --allow-runtime-lora-updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, an explicit flag here)
    allow_runtime_lora_updating: bool = False
    # --api-servers N > 1: the registry file every API process shares (epd/shared_lora_registry.py)
    lora_registry_path: str | None = None

    @cached_property
    def loras(self) -> LoRARegistry:
        """The adapters served by name now: --lora-modules, then runtime loads and unloads
        (in the file every API process shares, when there is one)."""
        if self.lora_registry_path is not None:
            from epd.shared_lora_registry import SharedLoRARegistry

            return SharedLoRARegistry(self.lora_registry_path, self.lora_modules)
        return LoRARegistry(self.lora_modules)

    def adapter(self, requested: str) -> LoRARequest | None:
        """The adapter a request's `model` names: None for the served model itself,
        a 404 model_not_found (vLLM's body) for a name served by neither."""
        if requested == self.served_model_name:
            return None
        lora = self.loras.get(requested)
        if lora is None:
            from epd.api.protocol import check_model

            check_model(requested, self.served_model_name)  # raises its 404
        return lora

    @property
    def keyed_paths(self) -> tuple[str, ...]:
        """Path prefixes that need the API key when one is set: the API (the tokenizer endpoints
        too: they fetch media as a chat does), its schema and docs pages, and /metrics by choice;
        /health and /version stay open for probes."""
        docs = ("/docs", "/redoc", "/openapi.json")
        return ("/v1", "/tokenize", "/detokenize", *docs, *(("/metrics",) if self.metrics_require_key else ()))
