"""Multi-LoRA on the language model.

    adapter.py      a PEFT adapter, read and checked against the language model
    config.py       `LoRAConfig`: the launch-time limits, vLLM's names and defaults
    manager.py      fixed device slots with LRU eviction to host memory
    layers.py       LoRAStep: the low-rank deltas of a batch of mixed adapters; wrap_model
    engine_adapters.py  EngineAdapters: EngineCore's adapter verbs (load, prefetch, unload, state)
    step_rows.py    which rows of a step run with which slot
    triton_lora.py  the gathered low-rank matmul in Triton (GPU)
"""
