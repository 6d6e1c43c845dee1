"""What the engine and the encoders both need to load and run weights.

checkpoint.py        reading a safetensors checkpoint into our modules
checkpoint_error.py  CheckpointError, the one error for a checkpoint that cannot be served (torch-free)
lora_files.py        a PEFT LoRA adapter's files, read and checked without torch
lora_linear.py       LoRALinear: a projection plus a low-rank delta per adapter slot (engine and tower)
cpu_linear.py        linear layers on the CPU through oneDNN with pre-packed weights
quant/               quantized checkpoints: their formats read (as float weights) and written
"""
