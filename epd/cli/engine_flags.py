"""The engine flags `epd serve` and `epd worker` share: `add_engine_args`, `engine_config`;
`engine_config_of` reads them from a list of `epd serve` flags (the planner's `--server-args`)."""
from __future__ import annotations

import argparse

from epd.engine.config import DTYPES, KV_CACHE_DTYPES, VLLM_DTYPES, EngineConfig
from epd.engine.lora.config import MAX_LORA_RANKS
from epd.engine.scheduler_config import PREFILL_PRIORITIES

# flag (without --) -> the engine setting it fills (EngineConfig.from_flat)
ENGINE_FLAGS = ("num_kv_blocks", "kv_cache_gb", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "enable_prefix_caching", "dtype", "kv_cache_dtype", "device", "attention_backend",
                "early_prefill", "prefill_priority", "max_local_prefill_tokens", "block_size", "seed",
                "speculative_config", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
                "enable_tower_lora", "enforce_eager", "max_cudagraph_capture_size", "kv_events_config",
                "tensor_parallel_size")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default after its help, unless the help already says it."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def add_input_processing_args(p) -> None:
    """--mm-processor-kwargs and --tokenizer: `epd serve`'s, and each `epd worker`'s (given the same values)."""
    p.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help="the image processor's settings over preprocessor_config.json's, e.g. "
                        "'{\"max_pixels\": 200704}': min_pixels, max_pixels (the API's placeholder counts and "
                        "the encoders alike)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="take the tokenizer (and its chat template) from this directory (default: the checkpoint)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    defaults = EngineConfig.flat_defaults()
    g = p.add_argument_group("engine")
    g.add_argument("--num-kv-blocks", type=int, default=defaults["num_kv_blocks"],
                   help="KV cache blocks of each engine worker (None: from --kv-cache-gb or the GPU's free memory)")
    g.add_argument("--kv-cache-gb", type=float, default=defaults["kv_cache_gb"],
                   help="GiB of KV cache per engine worker (None: 1 on CPU, --gpu-memory-utilization on GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=defaults["gpu_memory_utilization"],
                   help="share of each GPU's memory the server may take (split among the KV workers on it)")
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"],
                   help="sequences one engine step may hold")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"],
                   help="tokens one engine step may compute (longer prompts are prefilled in chunks)")
    g.add_argument("--max-model-len", type=int, default=defaults["max_model_len"],
                   help="prompt + output tokens of one request (None: the model's max_position_embeddings; "
                        "more is refused)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=defaults["enable_prefix_caching"],
                   help="reuse the KV blocks of a prompt prefix already computed (images included, by mm_hash)")
    g.add_argument("--block-size", type=int, default=defaults["block_size"], help="tokens in one KV cache block")
    g.add_argument("--dtype", default=defaults["dtype"], choices=[*DTYPES, *VLLM_DTYPES],
                   help="weights and activations: auto (the checkpoint's own dtype), float32, float16, bfloat16; "
                        "vLLM's half (float16) and float (float32) too")
    g.add_argument("--kv-cache-dtype", default=defaults["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2, one byte a value "
                        "with a scale per token and kv head: twice bf16's tokens per GiB, four times float32's "
                        "(torch attention backend: CPU, or --attention-backend torch on GPU)")
    g.add_argument("--seed", type=int, default=defaults["seed"],
                   help="torch seed of every engine worker, as vLLM's: requests with no seed sample from it "
                        "(a request's own seed gives the same tokens whatever else runs)")
    g.add_argument("--device", default=defaults["device"], help="auto, cpu, cuda or cuda:N")
    g.add_argument("--attention-backend", default=defaults["attention_backend"], choices=["auto", "torch", "triton"],
                   help="paged attention kernels (auto: torch on CPU, triton on GPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=defaults["tensor_parallel_size"],
                   help="each engine worker's language model over this many processes on its host (CPU, gloo; "
                        "dense Qwen3-VL and Qwen2.5-VL so far)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=defaults["enforce_eager"],
                   help="GPU: run every step eagerly (no CUDA graphs for decode steps)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=defaults["max_cudagraph_capture_size"],
                   help="GPU: decode steps of up to this many sequences replay a CUDA graph "
                        "(None: min(2 x --max-num-seqs, 512), at most --max-num-seqs; 0: none)")
    g.add_argument("--early-prefill", action=argparse.BooleanOptionalAction, default=defaults["early_prefill"],
                   help="prefill a request up to its first image not yet encoded (default: on, except in an "
                        "epd serve on CPU with --cpu-sharing shared, where the encoders take every core "
                        "such a prefill would use)")
    g.add_argument("--prefill-priority", default=defaults["prefill_priority"], choices=list(PREFILL_PRIORITIES),
                   help="which prefill gets the token budget: fcfs, or cost (fewest tokens first, aged)")
    g.add_argument("--max-local-prefill-tokens", type=int, default=defaults["max_local_prefill_tokens"],
                   help="e-p-d: text-only prompts of at most this many tokens are prefilled on a decode worker "
                        "(no KV transfer), which computes at most this many prompt tokens a step; 0: off")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on the decode-side workers, vLLM's JSON: "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' or "
                        "'{\"method\": \"eagle3\", \"model\": HEAD_DIR, \"num_speculative_tokens\": 3}' "
                        "(an EAGLE-3 head in Speculators' format) or "
                        "'{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 3}' "
                        "(a small model with the target's tokenizer) or "
                        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' (the checkpoint's own MTP layers: "
                        "Qwen3.5); default: none")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish each engine worker's prefix-cache changes as vLLM's KV events, vLLM's JSON: "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}' (also publisher, buffer_steps, hwm, topic); "
                        "the k-th engine worker of an epd serve adds k to the ports; default: none")
    _add_lora_args(p, defaults)


def _add_lora_args(p: argparse.ArgumentParser, defaults: dict) -> None:
    """vLLM's LoRA flags, names and defaults (the adapters themselves: serve's --lora-modules)."""
    g = p.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true", default=defaults["enable_lora"],
                   help="serve LoRA adapters (PEFT format) on the language model; a request's model picks one")
    g.add_argument("--max-loras", type=int, default=defaults["max_loras"],
                   help="adapters resident in one engine worker at once (and so in one step)")
    g.add_argument("--max-lora-rank", type=int, default=defaults["max_lora_rank"], choices=list(MAX_LORA_RANKS),
                   help="the largest adapter rank served (a larger one is refused)")
    g.add_argument("--max-cpu-loras", type=int, default=defaults["max_cpu_loras"],
                   help="adapters kept read in host memory (None: --max-loras; at least --max-loras)")
    g.add_argument("--enable-tower-lora", "--enable-tower-connector-lora", dest="enable_tower_lora",
                   action="store_true", default=defaults["enable_tower_lora"],
                   help="with --enable-lora: an adapter's vision tower weights run on the encoders (their "
                        "embeddings cached apart); without it they are ignored with a warning, as vLLM "
                        "does (vLLM's experimental --enable-tower-connector-lora is the same flag)")


def engine_config(args) -> EngineConfig:
    return EngineConfig.from_flat(**{name: getattr(args, name) for name in ENGINE_FLAGS})


def engine_config_of(argv: list[str]) -> EngineConfig:
    """The engine settings among `epd serve` flags, with serve's defaults; other flags are ignored.
    A bad value raises ValueError (the planner reads `--server-args` with it)."""
    p = argparse.ArgumentParser(prog="epd serve", add_help=False, allow_abbrev=False, exit_on_error=False)
    add_engine_args(p)
    try:
        known, _ = p.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    return engine_config(known)
