"""Qwen3.5 and Qwen3.5-MoE (Qwen3.6 alike): hybrid Gated DeltaNet / gated attention decoders.

    family.py       the two families' registry entries (torch-free)
    text_model.py   the language model over engine/layers/: Gated DeltaNet and gated attention layers,
                    dense or shared-expert MoE MLPs
    text_loader.py  the language model built and filled from the release's tensor names
    mtp.py          the release's MTP layers (`mtp.*`) as a draft head for speculative decoding
    presets.py      `epd make-model` presets: random checkpoints written with transformers' classes
    chat_template.py  the releases' chat template (its thinking switch), which the presets write

The image and video placeholders, M-RoPE positions and vision tower are Qwen3-VL's (epd/families/qwen_vl/).
"""
