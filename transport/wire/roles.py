"""The one definition of worker roles and serving modes.

    role         does                                          holds KV  takes prefill  encodes
    encoder      images -> embeddings (LMDB, EncodeDone)          -           -            x
    prefill      prompt -> token 1, ships KV to a decode worker   x           x            -
    decode       KV in -> tokens 2.., continuous batching         x           -            -
    pd           prefill + decode in one engine (mode e-pd)       x           x            -
    aggregated   pd + the vision encoder in-process (baseline)    x           x            x

    mode         workers (--encoders E --prefill P --decode D)
    aggregated   P aggregated
    e-pd         E encoder, P pd
    e-p-d        E encoder, P prefill, D decode

Both are `str` enums: a role read off the wire ("prefill") equals
`Role.PREFILL`, hashes the same and formats as its value.
"""
from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """A str whose str() and format() are its value (enum.StrEnum is Python 3.11+)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Role(_StrEnum):
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    PD = "pd"
    AGGREGATED = "aggregated"

    @classmethod
    def parse(cls, value: str) -> Role:
        """The role named `value`; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown role {value!r}; choose one of {', '.join(cls)}") from None

    @property
    def holds_kv(self) -> bool:
        """Runs an engine with a KV cache (every role but the encoder)."""
        return self is not Role.ENCODER

    @property
    def takes_prefill(self) -> bool:
        """Receives PrefillRequests from the API."""
        return self in (Role.PREFILL, Role.PD, Role.AGGREGATED)

    @property
    def encodes(self) -> bool:
        """Receives EncodeRequests (the aggregated worker encodes in-process)."""
        return self in (Role.ENCODER, Role.AGGREGATED)

    @property
    def scheduler_role(self) -> str:
        """The engine scheduler's role of a KV-holding worker: prefill, decode or pd (aggregated too)."""
        if not self.holds_kv:
            raise ValueError(f"role {self.value!r} runs no engine")
        return Role.PD.value if self is Role.AGGREGATED else self.value


class Mode(_StrEnum):
    AGGREGATED = "aggregated"
    E_PD = "e-pd"
    E_P_D = "e-p-d"

    @classmethod
    def parse(cls, value: str) -> Mode:
        """The mode named `value`; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"--mode must be one of {', '.join(cls)}, got {value!r}") from None

    def roles(self, num_encoders: int, num_prefill: int, num_decode: int) -> list[tuple[Role, int]]:
        """(role, index) of every worker of this mode; `num_prefill` counts the
        pd or aggregated workers in those modes."""
        if self is Mode.AGGREGATED:
            return [(Role.AGGREGATED, i) for i in range(num_prefill)]
        encoders = [(Role.ENCODER, i) for i in range(num_encoders)]
        if self is Mode.E_PD:
            return encoders + [(Role.PD, i) for i in range(num_prefill)]
        return encoders + [(Role.PREFILL, i) for i in range(num_prefill)] + \
            [(Role.DECODE, i) for i in range(num_decode)]
