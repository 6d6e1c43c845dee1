"""`python -m bench.dev.lora` on the tiny checkpoint, in miniature: its adapters are ones the engine
accepts, every row is measured against the base row, and the load cost is reported."""
from __future__ import annotations


def test_bench_lora_in_miniature(tiny_model, tmp_path):
    from transformers import AutoConfig

    from bench.dev.lora import build_parser, main, write_adapter
    from epd.engine.lora.adapter import ProjectionShapes, read_adapter

    shapes = ProjectionShapes.from_hf(AutoConfig.from_pretrained(tiny_model))
    spec = read_adapter("x", write_adapter(tmp_path / "x", shapes, rank=8, seed=0), shapes, max_lora_rank=8)
    assert spec.rank == 8 and spec.modules == {"q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"}

    args = build_parser().parse_args([tiny_model, "--concurrency", "4", "--input-len", "8",
                                      "--output-len", "3", "--num-adapters", "1,2", "--rank", "8",
                                      "--rounds", "1", "--load-rounds", "1", "--threads", "1"])
    result = main(args)
    assert [r["case"] for r in result["rows"]] == ["base", "base+lora", "1 adapters", "2 adapters"]
    assert all(r["tok_s"] > 0 and r["tpot_ms"] > 0 for r in result["rows"]) and result["rows"][0]["tok_s_vs_base"] == 1
    assert result["load"]["cold_request_ms"] > 0 and result["load"]["warm_request_ms"] > 0
