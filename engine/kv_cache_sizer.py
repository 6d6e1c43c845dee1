"""How many KV blocks fit: from a fixed count, a byte budget, or GPU profiling
(`profile_forward`: the largest forward an engine step runs)."""
from __future__ import annotations

import torch

from epd.engine.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """K and V of every KV-holding layer for one block of tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def num_kv_blocks(config: EngineConfig, block_bytes: int, device: str,
                  profile_forward=None, reserved_bytes: int = 0) -> int:
    """The number of KV blocks to allocate.

    `profile_forward()` runs the largest forward pass the engine will run
    (max_num_batched_tokens) so its peak activation memory is counted before
    the GPU budget is split; it is only called on CUDA without an explicit size.
    `reserved_bytes` come out of the budget first: the state cache's slots and
    snapshots (engine/state_cache.py), which share it with the KV blocks.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_gb is not None:
        budget = int(config.kv_cache_gb * (1 << 30))
    elif device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        if profile_forward is not None:
            profile_forward()
        torch.cuda.synchronize(device)
        # As in vLLM, gpu_memory_utilization is this engine's share of the whole card (workers
        # sharing one GPU split it: ServeConfig.worker_engines), weights and peak activations
        # included, so engines starting side by side do not depend on each other's timing.
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        budget = int(total * config.gpu_memory_utilization) - peak
        available = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if budget > available:
            gib = 1 << 30
            raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization:.2f} of {device} leaves "
                             f"{budget / gib:.1f} GiB for the KV cache, but only {available / gib:.1f} GiB is free: "
                             "other processes hold the rest; lower --gpu-memory-utilization or set --kv-cache-gb")
    else:
        budget = int(DEFAULT_CPU_KV_CACHE_GB * (1 << 30))
    if reserved_bytes and budget - reserved_bytes < block_bytes:
        raise ValueError(f"the per-request state cache takes {reserved_bytes / (1 << 30):.2f} GiB (one slot per "
                         f"--max-num-seqs, and as many prefix-cache snapshots) of a {budget / (1 << 30):.2f} GiB cache budget, leaving no room for KV "
                         "blocks; lower --max-num-seqs or raise --kv-cache-gb / --gpu-memory-utilization")
    budget -= reserved_bytes
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"no room for a single KV block ({block_bytes} bytes) in a budget of {budget} bytes; "
                         "lower the model size or raise kv_cache_gb / gpu_memory_utilization")
    return blocks


@torch.inference_mode()
def profile_forward(model, config: EngineConfig, device: str) -> torch.Tensor:
    """The largest forward an engine step runs (a full token budget, logits for
    max_num_seqs rows, times 1 + k with speculative decoding) on a throwaway
    cache, so its peak activation memory is measured before the KV cache takes
    the rest of the GPU."""
    from epd.engine.attention import get_backend
    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.layers.forward_batch import ForwardBatch
    from epd.engine.models.causal_lm import num_kv_layers
    from epd.engine.state_cache import StateCache, state_shapes

    cfg, n, bs = model.cfg, config.scheduler.max_num_batched_tokens, config.scheduler.block_size
    blocks = n // bs + 1
    dtype = model.model.embed_tokens.weight.dtype  # lm_head may be a PackedLinear (no .weight)
    num_layers = num_kv_layers(model)
    cache = torch.zeros(2, num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    batch = ForwardBatch(positions=torch.zeros(model.positions.position_dims, n, dtype=torch.long, device=device),
                         attn_meta=AttentionMetadata.build([n], [n], [list(range(blocks))], bs, device=device),
                         backend=get_backend(config.resolved_backend(device)),
                         kv_caches=[(cache[0, i], cache[1, i]) for i in range(num_layers)],
                         state_caches=StateCache(state_shapes(model), 1, dtype, torch.device(device)).layers,
                         state_slots=[0])
    hidden = model(torch.zeros(n, dtype=torch.long, device=device), batch)
    spec = config.speculative_config
    rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)  # a draft's rows are sampled too
    return model.compute_logits(hidden[-min(n, config.scheduler.max_num_seqs * rows_per_seq):])  # [rows, vocab]
