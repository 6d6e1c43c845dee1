"""`epd bench compare`'s pure parts: mode labels and the side-by-side table."""
from __future__ import annotations

import pytest

from epd.bench.compare import format_comparison, parse_mode


def test_mode_labels():
    assert parse_mode("e-p-d/shared", "split") == ("e-p-d", "shared")
    assert parse_mode("aggregated", "shared") == ("aggregated", "shared")
    assert parse_mode("e-pd/", "split") == ("e-pd", "split")  # an empty suffix is the default
    for bad in ("e-p-d/spread", "epd"):
        with pytest.raises(ValueError, match="MODE\\[/SHARING\\]"):
            parse_mode(bad, "split")


def _summary(goodputs: dict[str, tuple[float, float]]) -> dict:
    return {"modes": list(goodputs), "rates": [0.05, 0.1, 0.2], "slo_ttft_ms": 5000.0, "slo_tpot_ms": 96.0,
            "per_mode": {m: {"goodput_distserve": a, "goodput_p99": b} for m, (a, b) in goodputs.items()}}


def test_table_gives_ratios_and_bounds_when_the_baseline_passes_no_rate():
    rows = format_comparison(_summary({"aggregated": (0.1, 0.05), "e-p-d": (0.2, 0.2)})).splitlines()
    assert rows[2].split() == ["aggregated", "0.1", "1.00", "0.05", "1.00"]
    assert rows[3].split() == ["e-p-d", "0.2", "2.00", "0.2", "4.00"]
    rows = format_comparison(_summary({"aggregated": (0.0, 0.0), "e-pd": (0.0, 0.1),
                                       "e-p-d": (0.2, 0.2)})).splitlines()
    assert rows[2].split() == ["aggregated", "<0.05", "-", "<0.05", "-"]
    assert rows[3].split() == ["e-pd", "<0.05", "-", "0.1", ">2.00"]  # at least 0.1 / 0.05
    assert rows[4].split() == ["e-p-d", "0.2", ">4.00", "0.2", ">4.00"]
