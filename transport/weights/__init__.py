"""What the engine and the encoders both need to load and run weights.

checkpoint.py        reading a safetensors checkpoint into our modules
checkpoint_error.py  CheckpointError, the one error for a checkpoint that cannot be served (torch-free)
lora_files.py        a PEFT LoRA adapter's files, read and checked without torch
lora_linear.py       LoRALinear: a projection plus a low-rank delta per adapter slot (engine and tower)
cpu_linear.py        linear layers on the CPU through oneDNN with pre-packed weights
c_library.py         a CPU kernel's C source built on first use, cached, loaded with ctypes
quant/               quantized checkpoints: their formats read, run in their bits or as float weights, and written
"""
