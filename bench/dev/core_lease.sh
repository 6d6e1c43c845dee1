#!/usr/bin/env bash
# e-p-d on this host, the core lease (`--core-lease`) against fixed threads, text only,
# interleaved rounds (these machines are noisy: compare within a round):
#   bench/dev/core_lease.sh MODEL_DIR OUT_DIR [ROUNDS=2] [FIXED="1"]
# Each round, for short prompts (256 in, C=32, 32 prompts: prefilled on the decode
# worker) and long ones (1024 in, C=16, 16 prompts: the prefill worker busy too):
# a fresh `epd serve --mode e-p-d --kv-cache-gb 4 --core-lease`, then one with
# `--threads-per-worker N` for each N in FIXED; 128 output tokens, --ignore-eos.
# One line each: output tok/s, median TTFT and TPOT, the decode worker's CPU
# seconds per thread (two busy threads: it ran on both cores), the host's steal time.
set -euo pipefail
model=$1 out=$2 rounds=${3:-2} fixed=${4:-1}
port=${PORT:-8480}
mkdir -p "$out"
steal() { awk '/^cpu /{print $9}' /proc/stat; }
one() {  # name, input len, concurrency, prompts, serve flags...
  local name=$1 inlen=$2 c=$3 n=$4; shift 4
  epd serve "$model" --mode e-p-d --kv-cache-gb 4 --port "$port" "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server $name died"; tail "$out/$name.log"; exit 1; }
    sleep 1
  done
  local decode s0 s1
  decode=$(grep -o "worker decode-0 pid [0-9]*" "$out/$name.log" | awk '{print $4}')
  s0=$(steal)
  epd bench serve --port "$port" --model "$model" --dataset random --input-len "$inlen" --output-len 128 \
      --num-prompts "$n" --max-concurrency "$c" --ignore-eos --no-progress --seed 7 >"$out/$name.bench" 2>&1
  s1=$(steal)
  printf '%-16s %s | decode threads CPU s: %s | steal %s jiffies\n' "$name" \
      "$(grep -E 'Output token throughput|Median TTFT|Median TPOT' "$out/$name.bench" | tr -s ' ' | tr '\n' ' ')" \
      "$(for t in /proc/$decode/task/*; do awk '{s=($14+$15)/100; if (s >= 1) printf "%.0f ", s}' "$t/stat"; done)" \
      "$((s1 - s0))"
  kill -INT $pid; wait $pid || true
}
for r in $(seq "$rounds"); do
  for shape in "short 256 32 32" "long 1024 16 16"; do
    set -- $shape
    one "$1-lease-r$r" "$2" "$3" "$4" --core-lease
    for t in $fixed; do one "$1-fixed$t-r$r" "$2" "$3" "$4" --threads-per-worker "$t"; done
  done
done
