#!/usr/bin/env bash
# API-layer scaling: the same load against `epd serve --api-servers 1` and then
# `--api-servers 2` (one run, same machine), many streams of short outputs on a
# tiny checkpoint, so that the API processes, not the model, are the bottleneck.
# Reports served output tokens/s (`epd bench serve`) and the API processes' CPU
# seconds per 1000 output tokens (utime + stime from /proc), and the ratio.
#
#   bench/dev/api_servers.sh CHECKPOINT [OUT_DIR]
#   env: EPD (default: epd), PORT, NUM_PROMPTS, CONCURRENCY, OUTPUT_LEN, INPUT_LEN, SERVERS ("1 2")
set -euo pipefail
MODEL=${1:?usage: bench/dev/api_servers.sh CHECKPOINT [OUT_DIR]}
OUT=${2:-bench-results/api-servers}
EPD=${EPD:-epd}
PORT=${PORT:-18650}
NUM_PROMPTS=${NUM_PROMPTS:-400}
CONCURRENCY=${CONCURRENCY:-64}
INPUT_LEN=${INPUT_LEN:-16}
OUTPUT_LEN=${OUTPUT_LEN:-16}
SERVERS=${SERVERS:-"1 2"}
mkdir -p "$OUT"
TICKS=$(getconf CLK_TCK)

api_cpu_ticks() {  # utime + stime of the given pids
  local total=0
  for pid in "$@"; do
    read -r -a f < "/proc/$pid/stat"
    total=$((total + f[13] + f[14]))
  done
  echo "$total"
}

for N in $SERVERS; do
  LOG="$OUT/serve-$N.log"
  $EPD serve "$MODEL" --mode aggregated --api-servers "$N" --port "$PORT" --dtype float32 --device cpu \
      --max-num-seqs 128 --num-kv-blocks 2048 > "$LOG" 2>&1 &
  SERVER=$!
  until grep -q "^EPD ready" "$LOG"; do
    kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; exit 1; }
    sleep 0.5
  done
  if [ "$N" = 1 ]; then PIDS="$SERVER"; else PIDS=$(sed -n 's/^EPD: API server [0-9]* pid \([0-9]*\)$/\1/p' "$LOG"); fi
  BEFORE=$(api_cpu_ticks $PIDS)
  $EPD bench serve --base-url "http://127.0.0.1:$PORT" --dataset random --tokenizer "$MODEL" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
      --max-concurrency "$CONCURRENCY" --seed 0 --no-progress --save-result "$OUT/api-servers-$N.json" \
      > "$OUT/bench-$N.txt"
  AFTER=$(api_cpu_ticks $PIDS)
  echo "$N $(( AFTER - BEFORE ))" > "$OUT/cpu-$N.txt"
  kill -INT "$SERVER"
  wait "$SERVER" || true
done

python3 - "$OUT" "$TICKS" $SERVERS <<'EOF'
import json, sys
out, ticks, servers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = []
for n in servers:
    r = json.load(open(f"{out}/api-servers-{n}.json"))
    cpu_s = int(open(f"{out}/cpu-{n}.txt").read().split()[1]) / ticks
    rows.append((n, r["completed"], r["output_throughput"], r["median_tpot_ms"] if "median_tpot_ms" in r else float("nan"),
                 1000 * cpu_s / max(1, r["total_output_tokens"])))
base = rows[0][2]
print("| --api-servers | completed | output tok/s | vs first | median TPOT ms | API CPU s / 1k tokens |")
print("|---|---|---|---|---|---|")
for n, done, tps, tpot, cpu in rows:
    print(f"| {n} | {done} | {tps:.0f} | {tps / base:.2f}x | {tpot:.1f} | {cpu:.2f} |")
EOF
