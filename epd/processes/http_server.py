"""`api_settings`: the HTTP app's settings from the config, for `epd serve`
(epd/processes/launcher.py) and each API process of `--api-servers N`
(epd/processes/api_servers.py). Both serve it with `epd.api.fast_path.HttpServer`
(uvicorn with EPD's signals)."""
from __future__ import annotations

from epd.api.settings import ApiSettings
from epd.api.tool_calls import DEFAULT_TOOL_PARSER
from epd.config import ServeConfig
from epd.inputs.sampling_defaults import SamplingDefaults


def api_settings(config: ServeConfig, sampling_defaults: SamplingDefaults | None = None,
                 lora_registry_path: str | None = None, takes_audio: bool = False) -> ApiSettings:
    """What the HTTP app of `epd serve` serves and whom, from its one config and the
    checkpoint's sampling defaults (the orchestrator's `ModelFiles`; None: neutral);
    `lora_registry_path`: the adapters' registry file of --api-servers N (None: the process's own);
    `takes_audio`: the model's family has an audio side (else every audio part is refused by its type)."""
    return ApiSettings(served_model_name=config.model_name, api_key=config.api_key,
                       max_images_per_prompt=config.media.limit_images_per_prompt,
                       max_videos_per_prompt=config.media.limit_videos_per_prompt,
                       max_audios_per_prompt=config.media.limit_audios_per_prompt if takes_audio else 0,
                       max_request_body_bytes=config.limits.max_request_body_bytes,
                       metrics_require_key=config.metrics_require_key, metrics_model_name=config.metrics_model_name,
                       sampling_defaults=sampling_defaults or SamplingDefaults(),
                       max_logprobs=config.max_logprobs, log_requests=config.enable_log_requests,
                       tool_call_parser=config.tool_call_parser or DEFAULT_TOOL_PARSER,
                       allowed_origins=config.allowed_origins, allowed_methods=config.allowed_methods,
                       allowed_headers=config.allowed_headers, allow_credentials=config.allow_credentials,
                       lora_modules=config.lora_modules,
                       allow_runtime_lora_updating=config.allow_runtime_lora_updating,
                       lora_registry_path=lora_registry_path)
