"""Early prefill: a request enters the engine before all its images are here and is
prefilled up to its first missing one (docs/decisions/early-prefill.md).

`EarlyPrefill` holds its settings and the decisions they make, in one place: made
once by `EngineCore` from the engine's config (`of`), and asked by

    the worker loop   `is_on`: admit a request with the images here so far
                      (engine/worker/image_arrivals.py), or hold it until all are here;
                      `max_image_wait_s`: how long a request waits for an image, held
                      by the worker or in the engine (`EngineCore.abort_overdue`),
                      before it is answered `gave_up_error`
    the scheduler     `may_wait`: the deadlock bound, whether one more request may
                      hold blocks while it waits for an image

Which images a request in the engine waits for is the image ledger's
(engine/image_ledger.py); which requests the worker holds, `ImageArrivals`'.
Pure Python (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epd.engine.config import EngineConfig

# A request waits at most this long for an image. The API's own deadline
# (--request-timeout) aborts it sooner; this bound holds when nobody will.
MAX_IMAGE_WAIT_S = 600.0


def gave_up_error(max_wait_s: float) -> str:
    """What a request that waited too long for an image is answered, held by the worker or in the engine."""
    return f"gave up waiting {max_wait_s:g} s for an image"


@dataclass(frozen=True)
class EarlyPrefill:
    is_on: bool = True  # --early-prefill
    max_num_image_waits: int = 4  # running requests that may hold blocks while they wait for an image
    max_image_wait_s: float = MAX_IMAGE_WAIT_S

    @classmethod
    def of(cls, config: EngineConfig) -> EarlyPrefill:
        """The engine's: `early_prefill` None is on (`epd serve` turns it off where the encoders
        share the CPUs: epd/config.py ServeConfig), the bound is the scheduler config's."""
        return cls(config.early_prefill is not False, config.scheduler.max_num_image_waits)

    def may_wait(self, num_image_waits: int, num_blocks: int, num_free_blocks: int) -> bool:
        """Whether a request that will stop at a missing image may start now, `num_image_waits`
        running requests holding blocks while they wait and its whole prompt needing
        `num_blocks`: fewer than `max_num_image_waits` wait, and the free blocks cover its
        prompt (so starting it never preempts a request whose images are all here)."""
        return num_image_waits < self.max_num_image_waits and num_blocks <= num_free_blocks
