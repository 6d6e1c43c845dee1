"""`python -m bench.dev.across_nodes`: what it accepts (its runs need root and minutes: docs/benchmarks.md)."""
from __future__ import annotations

import pytest

from bench.dev.across_nodes import build_parser, parse_placement


def test_placements_parse_and_a_typo_is_named():
    assert parse_placement("one-node") == ("one-node", None)
    assert parse_placement("nodes") == ("nodes", None)
    assert parse_placement("nodes@1gbit") == ("nodes", "1gbit")
    for bad in ("one-node@1gbit", "node", "ray"):
        with pytest.raises(ValueError, match=f"--placements: '{bad}' is not one-node, nodes or nodes@RATE"):
            parse_placement(bad)


def test_the_workload_flags_are_bench_compares():
    args = build_parser().parse_args(["/m", "--rates", "0.1", "--images-per-request", "4", "--image-size", "336x336"])
    assert args.placements.split(",") == ["one-node", "nodes", "nodes@1gbit"]
    assert (args.images_per_request, args.image_size, args.input_len, args.output_len) == (4, [(336, 336)], 400, 32)
