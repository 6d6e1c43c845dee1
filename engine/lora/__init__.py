"""Multi-LoRA on the language model.

    adapter.py      a PEFT adapter, read and checked against the language model
    config.py       `LoRAConfig`: the launch-time limits, vLLM's names and defaults
    manager.py      fixed device slots with LRU eviction to host memory
    layers.py       the per-projection low-rank delta for a batch of mixed adapters
    step_rows.py    which rows of a step run with which slot
    triton_lora.py  the gathered low-rank matmul in Triton (GPU)
"""
