"""`epd bench offline` on the tiny checkpoint: a smoke run through the real command."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from testkit.family_checkpoints import family_checkpoint


def test_offline_run_reports_consistent_rates_and_the_matmul_ceiling(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "offline", tiny_model, "--concurrency", "1,3",
                           "--input-len", "12", "--output-len", "4", "--range-ratio", "0.5",
                           "--hf-sequential-max", "1", "--threads", "1", "--matmul-floor", "--save-result", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert r["epd_tok_s"] > 0 and r["hf_sequential_tok_s"] > 0 and r["hf_static_batch_tok_s"] > 0
        assert abs(r["vs_hf_static_batch"] - r["epd_tok_s"] / r["hf_static_batch_tok_s"]) < 1e-9
    last = result["rows"][-1]
    assert 0 < last["epd_matmul_s"] and 0 < last["hf_static_batch_matmul_s"]
    assert abs(last["ceiling_vs_hf_static_batch"] - last["hf_static_batch_wall_s"] / last["epd_matmul_s"]) < 1e-9
    assert result["tpot_over_bare_step"] > 0
    assert (result["device"], result["dtype"]) == ("cpu", "torch.float32")
    assert "x hf-pad" in proc.stdout and "matmuls take" in proc.stdout


def test_matmul_floor_is_cpu_only(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "offline", tiny_model, "--device", "cuda",
                           "--matmul-floor"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--matmul-floor profiles CPU matmuls" in proc.stderr


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen2_5_vl"])
def test_offline_runs_on_every_family(family, tmp_path):
    out = tmp_path / "offline.json"
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "offline", family_checkpoint(family),
                           "--concurrency", "2", "--input-len", "8", "--output-len", "3", "--hf-sequential-max", "1",
                           "--threads", "1", "--save-result", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["epd_tok_s"] > 0 and row["hf_static_batch_tok_s"] > 0


def test_offline_run_with_a_json_schema_constraint(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    schema = '{"type": "array", "items": {"type": "integer"}}'
    proc = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "offline", tiny_model, "--concurrency", "2",
                           "--input-len", "12", "--output-len", "6", "--hf-sequential-max", "1", "--threads", "1",
                           "--json-schema", schema, "--save-result", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["json_schema"] == json.loads(schema) and result["rows"][0]["epd_tok_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "epd.cli", "bench", "offline", tiny_model, "--json-schema", "[1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--json-schema" in bad.stderr
