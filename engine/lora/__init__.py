"""Multi-LoRA on the language model (issue 28): PEFT adapters read and checked
(adapter.py), fixed device slots with LRU eviction to host memory
(manager.py), and the per-projection low-rank delta (layers.py)."""
