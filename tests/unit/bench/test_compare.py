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
            "num_prompts": 40,
            "per_mode": {m: {"goodput_distserve": a, "goodput_p99": b} for m, (a, b) in goodputs.items()}}


def test_table_gives_ratios_and_bounds_when_the_baseline_passes_no_rate():
    rows = format_comparison(_summary({"aggregated": (0.1, 0.05), "e-p-d": (0.2, 0.2)})).splitlines()
    assert rows[2].split() == ["aggregated", "0.1", "-", "1.00", "0.05", "1.00"]  # "-": no interval given
    assert rows[3].split() == ["e-p-d", "0.2", "-", "2.00", "0.2", "4.00"]
    rows = format_comparison(_summary({"aggregated": (0.0, 0.0), "e-pd": (0.0, 0.1),
                                       "e-p-d": (0.2, 0.2)})).splitlines()
    assert rows[2].split() == ["aggregated", "<0.05", "-", "-", "<0.05", "-"]
    assert rows[3].split() == ["e-pd", "<0.05", "-", "-", "0.1", ">2.00"]  # at least 0.1 / 0.05
    assert rows[4].split() == ["e-p-d", "0.2", "-", ">4.00", "0.2", ">4.00"]


def test_table_shows_goodput_and_attainment_intervals():
    summary = _summary({"aggregated": (0.05, 0.05), "e-p-d": (0.2, 0.1)})
    summary["per_mode"]["aggregated"]["goodput_distserve_ci"] = [0.0, 0.1]
    summary["per_mode"]["e-p-d"]["goodput_distserve_ci"] = [0.1, 0.2]
    for mode, attainments in (("aggregated", (0.9, 0.8, 0.5)), ("e-p-d", (1.0, 0.95, 0.925))):
        summary["per_mode"][mode]["rows"] = [{"slo_attainment": a, "slo_attainment_ci": [a - 0.1, min(1.0, a + 0.05)]}
                                             for a in attainments]
    rows = format_comparison(summary).splitlines()
    assert rows[2].split() == ["aggregated", "0.05", "[<0.05,0.1]", "1.00", "0.05", "1.00"]
    assert rows[3].split() == ["e-p-d", "0.2", "[0.1,0.2]", "4.00", "0.1", "2.00"]
    assert rows[4] == "SLO attainment, 95% CI (bootstrap over 40 requests a rate):"
    assert rows[6].split() == ["0.05", "90%", "[80%,95%]", "100%", "[90%,100%]"]
    assert rows[8].split() == ["0.2", "50%", "[40%,55%]", "92%", "[82%,98%]"]
