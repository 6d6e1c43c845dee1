"""`epd serve --cluster ray`: where the workers go. Plain data, no Ray import,
so the CLI builds it (and refuses bad flags) where Ray is not installed.

Each role asks Ray for a set of resources per worker, as an actor's options
do: `{"CPU": 4}`, `{"GPU": 0.5}`, or custom node resources such as
`{"CPU": 1, "epd_encoder_node": 1}` that an operator gives one node type
(`ray start --resources '{"epd_encoder_node": 8}'`) to pin encoders there.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from epd.transport.wire.roles import Role

DEFAULT_RESOURCES = (("CPU", 1.0),)
ROLE_FLAGS = {Role.ENCODER: "--encoder-resources", Role.PREFILL: "--prefill-resources",
              Role.DECODE: "--decode-resources"}


def parse_resources(flag: str, text: str) -> tuple[tuple[str, float], ...]:
    """'{"CPU": 4, "GPU": 0.5}' -> (("CPU", 4.0), ("GPU", 0.5)); ValueError naming `flag`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} takes a JSON object such as '{{\"CPU\": 2}}', got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{flag} takes a non-empty JSON object such as '{{\"CPU\": 2}}', got {text!r}")
    out = []
    for name, amount in value.items():
        if type(amount) not in (int, float) or not math.isfinite(amount) or amount < 0:
            raise ValueError(f"{flag}: resource {name!r} needs a non-negative number, got {amount!r}")
        out.append((name, float(amount)))
    return tuple(out)


@dataclass(frozen=True)
class RayConfig:
    """Where `epd serve --cluster ray` runs its workers."""

    address: str | None = None  # a running cluster (`ray start --head`); None: start a local Ray
    encoder_resources: tuple[tuple[str, float], ...] = DEFAULT_RESOURCES
    prefill_resources: tuple[tuple[str, float], ...] = DEFAULT_RESOURCES  # prefill, pd and aggregated workers
    decode_resources: tuple[tuple[str, float], ...] = DEFAULT_RESOURCES

    def resources(self, role: Role | str) -> dict[str, float]:
        """What one worker of `role` asks Ray for."""
        role = Role.parse(role)
        if role == Role.ENCODER:
            return dict(self.encoder_resources)
        return dict(self.decode_resources if role == Role.DECODE else self.prefill_resources)
