#!/usr/bin/env bash
# n-gram speculative decoding against none, side by side, on a repetitive workload:
#   bench/dev/spec_ngram.sh MODEL_DIR OUT_DIR [N=16] [CONCURRENCY=4] [OUTPUT_LEN=64] [K=3]
# One aggregated server without --speculative-config, then one with
# {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
# each sent the same N greedy chat requests (a phrase of 4-8 words repeated
# 12 times; the random-weight tiny checkpoint's greedy output also loops),
# at most CONCURRENCY at once. `epd bench serve`'s JSON per run in OUT_DIR,
# then one table: throughput, TPOT and the acceptance it read from /metrics.
set -euo pipefail
model=$1 out=$2 n=${3:-16} conc=${4:-4} outlen=${5:-64} k=${6:-3}
port=${PORT:-8471}
mkdir -p "$out"
python - "$out/repeat.jsonl" "$n" "$outlen" <<'EOF_PY'
import json, random, sys
path, n, outlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
words = "red green blue cat dog sun moon tree river stone cloud bird fish wind".split()
rng = random.Random(0)
with open(path, "w") as f:
    for _ in range(n):
        phrase = " ".join(rng.sample(words, rng.randint(4, 8)))
        f.write(json.dumps({"prompt": (phrase + ". ") * 12, "output_len": outlen}) + "\n")
EOF_PY
spec="{\"method\": \"ngram\", \"num_speculative_tokens\": $k, \"prompt_lookup_min\": 1, \"prompt_lookup_max\": 3}"
for name in none ngram; do
  flags=()
  [ "$name" = ngram ] && flags=(--speculative-config "$spec")
  epd serve "$model" --mode aggregated --port "$port" "${flags[@]}" >"$out/$name.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server $name died"; tail "$out/$name.log"; exit 1; }
    sleep 1
  done
  epd bench serve --base-url "http://127.0.0.1:$port" --dataset jsonl --dataset-path "$out/repeat.jsonl" \
      --max-concurrency "$conc" --temperature 0 --num-warmups 2 --no-progress \
      --save-result "$out/$name.json" >/dev/null
  kill -INT $pid; wait $pid || true
done
python - "$out" <<'EOF_PY'
import json, sys
print(f"| {'speculation':12s} | output tok/s | median TPOT (ms) | P99 TPOT (ms) | acceptance rate | acceptance length |")
print("|---|---|---|---|---|---|")
for name in ("none", "ngram"):
    r = json.load(open(f"{sys.argv[1]}/{name}.json"))
    rate, length = r.get("spec_decode_acceptance_rate"), r.get("spec_decode_mean_acceptance_length")
    print(f"| {name:12s} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} "
          f"| {'-' if rate is None else f'{100 * rate:.1f}%'} | {'-' if length is None else f'{length:.2f}'} |")
EOF_PY
