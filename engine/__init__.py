"""The engine: one model's requests scheduled and run step by step, in any process
(imports transport/ only; the process loop around it is engine/worker/).

engine_core.py       EngineCore: scheduler + model runner, one step at a time; its verbs
scheduler.py         continuous batching: chunked prefill, preemption, prefill priority
scheduler_config.py  the scheduler's launch-time limits
scheduler_output.py  what one step hands the model runner, and what `update` returns
prefill_order.py     the scheduler's order of requests
span_chunks.py       ChunkSizes: a prefill chunk's size (ledger bound, budget, whole image spans)
request.py           a request as the engine sees it: tokens, spans, progress, blocks
block_manager.py     paged KV blocks: reference counts, prefix cache
block_hash.py        a KV block's prefix-cache hash (shared with the API's cache-aware router)
kv_event_log.py      the prefix cache's changes as vLLM's KV events, for the worker to publish
kv_cache_sizer.py    how many KV blocks fit
state_cache.py       per-request state beside the KV (Gated DeltaNet layers): one slot per running request, snapshots
state_snapshots.py   which block boundaries hold a state snapshot, where a stateful model's prefix hits resume
image_ledger.py      every image the engine knows, by content key: present, waiting, failed
early_prefill.py     EarlyPrefill: prefill before every image is here, its settings and bound
model_runner.py      one step into tensors, the language model run, tokens sampled
sampler.py           logits -> next tokens (and logprobs) for a batch
structured_output.py constraints compiled into token masks (xgrammar)
cuda_graphs.py       CUDA graphs of decode-only steps
loader.py            the language model built for a checkpoint's family and filled
model_info.py        facts about a checkpoint found when it is opened
config.py            EngineConfig: the engine's launch-time configuration
models/              the language models, one module per family, and their registry
layers/              the shared layers the models are built from: attention, rotary, norm, MLP, MoE
attention/           attention backends: torch (CPU), the C kernel, Triton
lora/                multi-LoRA on the language model
spec/                speculative decoding: n-gram, draft model, EAGLE-3
parallel/            tensor parallelism: a language model over N ranks (rank 0 speaks, followers run shards)
worker/              the process loop around EngineCore (sockets in, steps, messages out)
"""
