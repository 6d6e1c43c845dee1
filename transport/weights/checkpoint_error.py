"""`CheckpointError`, the one error for a checkpoint that cannot be served.

Torch-free, so that both sides raise and catch the same class: the API process
and the offline `LLM` reading config.json, the tokenizer and templates
(epd/inputs/model_files.py), and the workers loading the weights
(transport/weights/checkpoint.py, engine/loader.py). An `except CheckpointError` catches
both.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint cannot be served (missing, extra or misshaped tensors; a
    file that cannot be read); the message names the file or tensor and the problem."""
