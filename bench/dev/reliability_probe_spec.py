"""Issue 44, item 8 (speculative decoding), as a reliability-probe case: `epd serve`
with a `--speculative-config` that cannot serve the target — an EAGLE-3 head for
another target (its config says hidden size 2048), a draft model with another
vocabulary, `num_speculative_tokens` 100000, `prompt_lookup_max` 10^6 — must stop
with one line naming the problem and exit code 2 before any worker starts. Recorded
per case: the exit code, the seconds it took, the error line, tracebacks, workers started.

`probe_speculative_refusals(p, model_dir, out)` makes the head (`epd make-model
--preset tiny-eagle3`) and the draft (the target with two token ids swapped) under
`out`, and runs each `epd serve` (bounded)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.dev.reliability_probe import Probe
from epd.bench.compare import _free_port

SERVE_TIMEOUT_S = 300


def probe_speculative_refusals(p: Probe, model_dir: str, out: Path) -> None:
    shutil.rmtree(out / "spec", ignore_errors=True)
    head = out / "spec" / "head-for-2048"
    subprocess.run([sys.executable, "-m", "epd.cli", "make-model", str(head), "--preset", "tiny-eagle3"],
                   check=True, capture_output=True, timeout=SERVE_TIMEOUT_S)
    config = json.loads((head / "config.json").read_text())
    config["target_hidden_size"] = 2048  # trained for another target
    (head / "config.json").write_text(json.dumps(config))
    draft = out / "spec" / "draft-other-vocab"  # the target itself as a draft, with another tokenizer
    shutil.copytree(model_dir, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]  # two ordinary tokens swap ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    cases = {
        "an EAGLE-3 head for another target": ({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
                                               "is for a target of hidden size 2048"),
        "a draft model with another vocabulary": ({"method": "draft_model", "model": str(draft),
                                                   "num_speculative_tokens": 3}, "has another vocabulary"),
        "num_speculative_tokens 100000": ({"method": "ngram", "num_speculative_tokens": 100000},
                                          "num_speculative_tokens must be an integer from 1 to 32"),
        "prompt_lookup_max 10^6": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 10 ** 6},
                                   "prompt_lookup_max must be an integer from 1 to 64"),
    }
    for name, (spec, problem) in cases.items():
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "epd.cli", "serve", model_dir, "--mode", "e-p-d",
                                   "--port", str(_free_port()), "--speculative-config", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=SERVE_TIMEOUT_S)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:  # it served: nothing refused it
            code, stdout, stderr = None, str(exc.stdout or ""), str(exc.stderr or "")
        errors = [line for line in stderr.splitlines() if line.startswith("epd serve:")]
        saw = {"exit_code": code, "seconds": round(time.monotonic() - started, 1), "error": errors[:1],
               "tracebacks": stderr.count("Traceback"), "workers_started": stdout.count("EPD: worker ")}
        p.check("8 (speculative config)", f"{name}: one line naming it, exit 2, no worker started",
                code == 2 and len(errors) == 1 and problem in errors[0] and not saw["tracebacks"]
                and not saw["workers_started"], saw)


if __name__ == "__main__":  # python -m bench.dev.reliability_probe_spec MODEL_DIR OUT_DIR
    probe = Probe(Path(sys.argv[2]))
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    probe_speculative_refusals(probe, sys.argv[1], Path(sys.argv[2]))
    sys.exit(sum(not row["ok"] for row in probe.rows))
