"""`python -m bench.dev.spec_decode` on the tiny checkpoint, in miniature: a row per method and stream
count, every request run to its length, acceptance only where drafts were verified,
and the disagreeing draft's drafts (nearly) all rejected."""
from __future__ import annotations


def test_bench_spec_in_miniature(tiny_model, tiny_draft, tmp_path, capsys):
    from bench.dev.spec_decode import build_parser, main
    from epd.tools.make_draft import make_draft

    wrong = make_draft(tiny_model, tmp_path / "wrong", num_layers=2, disagree=True)
    args = build_parser().parse_args([tiny_model, "--draft", tiny_draft, "--wrong-draft", str(wrong),
                                      "--streams", "1", "3", "--output-len", "6", "--kv-cache-gb", "0.05",
                                      "--save-result", str(tmp_path / "r.json")])
    rows = {(r["method"], r["streams"]): r for r in main(args)["rows"]}
    assert list(rows) == [(m, s) for m in ("none", "ngram", "draft_model", "rejected") for s in (1, 3)]
    assert all(r["decode_tok_s"] > 0 and r["tpot_ms"] > 0 for r in rows.values())
    assert rows["none", 3]["acceptance_rate"] is None
    assert rows["draft_model", 3]["acceptance_rate"] > 0 and rows["draft_model", 3]["acceptance_length"] > 1
    assert rows["rejected", 3]["acceptance_rate"] < 0.1
    assert (tmp_path / "r.json").exists() and "| draft_model | 3 |" in capsys.readouterr().out
