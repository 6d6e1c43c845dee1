"""Pydantic models the structured-output tests constrain outputs to: nested
objects, arrays, enums and bounded numbers (the issue's list), shared by the
offline and the serving tests."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Point(BaseModel):
    x: int = Field(ge=-5, le=5)
    y: float = Field(ge=0.0, le=1.0)


class Invoice(BaseModel):
    vendor: str = Field(max_length=8)
    kind: Literal["food", "travel", "office"]
    total: int = Field(ge=0, le=999)
    paid: bool
    where: Point
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
