"""`ModelFamily`: what one family gives the API, the engine and the encoders.

The API process reads `prompt_format` (torch-free); the engine builds the
language model with `load_text_model` and asks `positions` where its tokens
sit; the encoders build the vision side with `load_vision`. The heavy parts
are "module:attr" names, imported when first used, so that reading the
registry never loads torch or a model's code.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable

from epd.transport.media.prompt_format import PromptFormat


class UnsupportedModelError(ValueError):
    """The checkpoint is of a model family EPD does not serve, or has a part of one EPD cannot serve."""


def resolve(name: str):
    """The object a "package.module:attr" name points at."""
    module, _, attr = name.partition(":")
    return getattr(import_module(module), attr)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # as people call it: "Qwen3-VL-MoE"
    model_type: str  # config.json "model_type"
    architecture: str  # config.json "architectures" entry (transformers' class)
    prompt_format: PromptFormat  # its placeholders, their expansion, its image geometry (torch-free)
    # "module:attr" of (model_dir, hf_config, dtype, device) -> its language model, filled, in eval mode:
    # `cfg` (num_layers, num_heads, num_kv_heads, head_dim, hidden_size, vocab_size), `positions`,
    # forward(input_ids, batch), forward_with_aux(input_ids, batch, aux_layer_ids), compute_logits(hidden)
    text_model: str
    # "module:attr" of (model_dir, hf_config, dtype, device, processor_kwargs) -> its vision side:
    # `geometry`, patches(width, height), preprocess(images) -> (input, metas), forward(input, metas) -> [MMEntry]
    vision: str
    positions: Callable[[object], object]  # hf config -> its PositionRule (engine/models/positions.py)
    # vLLM's --tool-call-parser name of its chat template's tool calls (epd/api/tool_parsers/); None: not known.
    # Named in the error when --enable-auto-tool-choice comes without --tool-call-parser.
    tool_call_parser: str | None = None
    # whether an adapter's vision tower tensors can run on its tower (--enable-tower-lora: the names and
    # (in, out) of encoders/tower_adapter.py TowerShapes); False: such an adapter is refused by name
    tower_lora: bool = False
    # "module:attr" of (model_dir, hf_config, dtype, device, shard) -> one tensor-parallel rank's part of
    # its language model (engine/parallel/shard.py `Shard`); None: --tensor-parallel-size > 1 is refused by name
    text_shard: str | None = None
    # "module:attr" of (model_dir, hf_config, dtype, device) -> its audio side: `features(samples, sampling_rate)`
    # (the log-mel its feature extractor gives), forward(features) -> embeddings; None: the family takes no audio
    audio: str | None = None
    # transformers' config of a whole checkpoint -> the part EPD serves (a Qwen2.5-Omni checkpoint: its thinker's,
    # the speech talker left out); None: all of it
    served_config: Callable[[object], object] | None = None

    def load_text_model(self, model_dir, hf_config, dtype, device="cpu"):
        return resolve(self.text_model)(model_dir, hf_config, dtype, device)

    def load_text_shard(self, model_dir, hf_config, dtype, device, shard):
        if self.text_shard is None:
            raise UnsupportedModelError(f"{self.name} does not run with --tensor-parallel-size > 1 yet")
        return resolve(self.text_shard)(model_dir, hf_config, dtype, device, shard)

    def load_vision(self, model_dir, hf_config, dtype, device="cpu", processor_kwargs=None):
        return resolve(self.vision)(model_dir, hf_config, dtype, device, processor_kwargs)

    def load_audio(self, model_dir, hf_config, dtype, device="cpu"):
        if self.audio is None:
            raise UnsupportedModelError(f"{self.name} takes no audio")
        return resolve(self.audio)(model_dir, hf_config, dtype, device)
