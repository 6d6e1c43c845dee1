#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, each step's output saved under
# OUT_DIR (default gpu-results/):
#   1. the Triton kernels and the whole engine on the GPU against their references
#      (pytest -m gpu: kernels vs the torch backend, greedy tokens vs transformers);
#   2. the decode kernel's achieved memory bandwidth (python -m bench.dev.kernels);
#   3. offline throughput of our engine and of transformers on the GPU, small preset;
#   4. serving: aggregated against e-p-d on the one GPU, four images a request;
#   5. the same with half the requests text-only (issue 14: text-only P99 TTFT under image load);
#   6. --api-servers 1, 2, 4 on the machine's spare cores, the tiny checkpoint on the CPU
#      (issue 18: the API's token rate against the process count; needs no GPU, only cores);
#   7. CUDA graphs for decode steps against eager steps: offline tokens/s (graphs);
#   8. first-use stalls: the largest gap between two tokens of a fresh server's first 20
#      requests against the rest, without the kernel warm-up, eager, and with graphs (stall).
# `epd` must be installed (pip install -e . --no-deps beside its dependencies).
#
#     bash bench/dev/gpu_checks.sh [OUT_DIR]
#     GPU_STEPS="pytest_gpu serving" bash bench/dev/gpu_checks.sh   # some steps only
#
# A failed step does not stop the later ones; the exit status is the first failure's.
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
status=0
step() {  # step NAME CMD... : run CMD, tee its output to $out/NAME.txt, remember a failure
    local name=$1; shift
    case " ${GPU_STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    [ "$status" -ne 0 ] || status=$rc
}

step versions bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
    $python -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'"
step pytest_gpu "$python" -m pytest -q -m gpu -p no:cacheprovider \
    tests/unit/engine/test_attention.py tests/unit/engine/test_engine_vs_transformers.py tests/unit/engine/test_cuda_graphs.py \
    tests/unit/engine/test_moe.py tests/unit/engine/test_families_vs_transformers.py tests/e2e/serve/test_serve_gpu.py
step kernels "$python" -m bench.dev.kernels
model=${EPD_GPU_MODEL:-/tmp/epd-gpu-small}
case " ${GPU_STEPS:-offline_bf16} " in *" offline_bf16 "* | *" serving "* | *" text_only_mix "* | *" graphs "* | *" stall "*)
    [ -d "$model" ] || "$python" -m epd.cli make-model "$model" --preset small >/dev/null ;;
esac
step offline_bf16 "$python" -m epd.cli bench offline "$model" --device cuda --dtype bfloat16 \
    --concurrency 1,8,32 --save-result "$out/offline_bf16.json"
step serving timeout 360 "$python" -m epd.cli bench compare "$model" --modes aggregated,e-p-d \
    --rates 3,5,8,16 --num-prompts 48 --slo-scale 3 --images-per-request 4 --image-size 448x448 \
    --input-len 400 --output-len 64 --server-args "--dtype bfloat16" --output-dir "$out/serving" --no-progress
step text_only_mix timeout 420 "$python" -m epd.cli bench compare "$model" --modes aggregated,e-p-d \
    --rates 4,8,16 --num-prompts 48 --slo-scale 3 --images-per-request 4 --image-size 448x448 \
    --input-len 400 --output-len 64 --text-only-ratio 0.5 --server-args "--dtype bfloat16" \
    --output-dir "$out/text_only_mix" --no-progress
step graphs "$python" -m bench.dev.cuda_graphs throughput "$model" --dtype bfloat16 --concurrency 1,8,32,128 \
    --save-result "$out/graphs.json"
step stall bash -c "for flags in '--enforce-eager --no-warm-up' '--enforce-eager' ''; do \
    $python -m bench.dev.cuda_graphs stall $model \$flags || exit 1; done"
tiny=${EPD_TINY_MODEL:-/tmp/epd-gpu-tiny}
case " ${GPU_STEPS:-api_servers} " in *" api_servers "*)
    [ -d "$tiny" ] || "$python" -m epd.cli make-model "$tiny" --preset tiny >/dev/null ;;
esac
step api_servers timeout 420 "$python" -m bench.dev.overhead "$tiny" --modes aggregated --concurrency 128 \
    --requests-per-stream 2 --one-token-requests 2048 --cpus "${API_CPUS:-0-7}" --client-procs 2 \
    --server-args "--threads-per-worker 2" --server-args "--threads-per-worker 2 --api-servers 2" \
    --server-args "--threads-per-worker 2 --api-servers 4" --save-result "$out/api_servers.json"
exit "$status"
