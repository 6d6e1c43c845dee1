#!/usr/bin/env bash
# Time to first token of one long multi-image request on an idle e-p-d server,
# with and without early prefill, for each encoder count and core sharing:
#   bench/dev/early_prefill.sh MODEL_DIR OUT_DIR [ENCODERS="1 2"] [SHARING="shared split"] [N=3] [BENCH_FLAGS]
# BENCH_FLAGS go to `epd bench serve`, e.g. --text-first (the text before the
# images: the only layout in which early prefill has text to start on).
# Each configuration: a fresh server, N requests one at a time (2,000 text
# tokens counted by the model's tokenizer + four new 448x448 images each, 2
# output tokens), `epd bench serve`'s JSON in OUT_DIR, one summary line.
set -euo pipefail
model=$1 out=$2 encoders=${3:-"1 2"} sharings=${4:-"shared split"} n=${5:-3} flags=${6:-}
port=${PORT:-8470}
mkdir -p "$out"
for sharing in $sharings; do
  for enc in $encoders; do
    for early in early-prefill no-early-prefill; do
      name="enc${enc}-${sharing}-${early}"
      epd serve "$model" --mode e-p-d --encoders "$enc" --cpu-sharing "$sharing" --port "$port" \
          --"$early" >"$out/$name.log" 2>&1 &
      pid=$!
      until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 $pid 2>/dev/null || { echo "server $name died"; tail "$out/$name.log"; exit 1; }
        sleep 1
      done
      epd bench serve --base-url "http://127.0.0.1:$port" --dataset random-mm --num-prompts "$n" \
          --max-concurrency 1 --input-len 2000 --images-per-request 4 --image-size 448x448 \
          --output-len 2 --tokenizer "$model" --seed 7 --no-progress $flags \
          --save-result "$out/$name.json" >/dev/null
      python - "$out/$name.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:32s} median TTFT {r['median_ttft_ms']:8.0f} ms   mean {r['mean_ttft_ms']:8.0f} ms")
EOF
      kill -INT $pid; wait $pid || true
    done
  done
done
