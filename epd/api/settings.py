"""`ApiSettings`: what the HTTP app serves and whom (built once by the launcher)."""
from __future__ import annotations

from dataclasses import dataclass, field

from epd.inputs.sampling_defaults import SamplingDefaults


@dataclass(frozen=True)
class ApiSettings:
    served_model_name: str
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_images_per_prompt: int | None = None  # None: no limit
    max_request_body_bytes: int = 64 << 20  # larger bodies get 413 before they are read (--max-request-body-mb)
    # the values of omitted sampling fields (--generation-config), read from the checkpoint once at start-up
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
