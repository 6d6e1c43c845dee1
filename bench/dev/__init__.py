"""Developer experiments: kept runnable from a checkout, not installed with epd.

The wheel ships bench/ without this folder (pyproject's packages list;
tests/unit/repo/test_packaging.py checks). Run each from the repository root, where
`bench.dev` is importable, with `epd` installed (`source scripts/env.sh dev`):

    python -m bench.dev.<name> --help      # a Python experiment
    bash bench/dev/<name>.sh ARGS          # a shell script (usage in its header)

They import epd (the product bench modules included) as they need; nothing installed
imports them (tests/unit/repo/test_layering.py). docs/benchmarks.md gives the command
behind each figure they measured.

Peer comparisons, against vLLM in its own environment (scripts/vllm_env.sh):
vs_vllm.py            EPD against `vllm serve` and vLLM's LLM: served, image, goodput, offline rows
vs_vllm_goodput.py    its goodput rows (`epd bench compare`'s sweep over every server)
vs_vllm_offline.py    its offline row: EPD's LLM against vLLM's on the same token ids
vs_vllm_table.py      its pure half: per-round values in, ratios with ranges and the table out
vllm_servers.py       the vLLM servers it starts: `vllm serve`, vLLM's encoder disaggregation
vllm_ec_proxy.py      the front of vLLM's encoder disaggregation (1E + 1PD)
vllm_offline_peer.py  vLLM's side of the offline rows, run by vLLM's own Python
offline_cpu_time.py   CPU seconds of one offline workload, EPD's LLM or vLLM's
gemma3_image_mask.py  whose Gemma 3 image texts follow transformers' bidirectional image attention
greedy_reference.py   whose greedy texts of a vs_vllm run are transformers', the logit gap where not

What one feature or flag costs:
overhead.py           served against offline tokens/s; the API process's CPU per token
quant_decode.py       offline decode tokens/s of quantized checkpoints against their float original
light_client.py       a client light enough not to be the bottleneck (overhead's)
lora.py               multi-LoRA's tokens/s with 1, 4, 16 adapters against the base
spec_decode.py        speculative decoding's tokens/s and TPOT per method, offline
video_chunks.py       one long video's TTFT, whole against in chunks over 1, 2, 4 encoders
cache_hit.py          a cached image's TTFT against a text prompt of the same length
multi_turn_prefix.py  prefix caching's hit rate and time on a multi-turn workload, on against off
encoder_routing.py    encoder routers side by side on one trace
router_compare.py     every --router on four engine workers (x4, 2P+2D), multi-turn with images
body_memory.py        the API process's memory and time for large request bodies
api_servers.sh        `--api-servers 1` against 2 under many short streams
core_lease.sh         `--core-lease` against fixed threads, e-p-d, text only
early_prefill.sh      one long multi-image request's TTFT with and without early prefill
spec_ngram.sh         n-gram speculative decoding against none, served

Micro-benchmarks of the engine's pieces:
kernels.py            the Triton paged decode attention kernel's bandwidth (GPU)
cuda_graphs.py        CUDA graphs for decode steps, and first-use stalls (GPU)
cpu_decode_attention.py  the CPU paged decode attention kernel against gather + SDPA
cpu_linear.py         the CPU GEMM behind every projection against torch's F.linear
cpu_step_pieces.py    one decoder layer's non-GEMM pieces, eager against fused
moe_cpu.py            one MoE layer's routed experts on CPU: the old per-expert loop, run_experts, packed
state_rollback.py     a rejected draft's Gated DeltaNet state: checkpoints against recompute
tp_allreduce.py       a tensor-parallel decode step's collectives (gloo) alone, and the offline LLM at TP=1 / TP=N
gpu_checks.sh         every GPU test and benchmark in one run, on a lent GPU

Faults and reliability:
fault.py              a worker killed mid-trace: requests completed, time until goodput is back
reliability_probe.py  the hardening probes against live servers; the exit code counts failures
reliability_probe_lora.py, reliability_probe_poison.py, reliability_probe_shutdown.py,
reliability_probe_spec.py, reliability_probe_tower.py, reliability_probe_video.py,
reliability_probe_video_prompt.py   its cases, one module each

Several nodes on one machine (root):
netns.py              hosts as network namespaces on a private bridge (the multi-node tests' too)
link_kv.py            KV- and embedding-sized messages over `tc`-shaped links
across_nodes.py       `epd bench compare`'s sweep with e-p-d's workers in their own namespaces

checkout.py           the checkout's root on a child's PYTHONPATH, for `python -m bench.dev.<name>` children
"""
