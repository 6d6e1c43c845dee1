"""The model families EPD serves: one package per family, one registry.

    model_family.py  `ModelFamily`: what a family gives the API, the engine and the encoders
    registry.py      the families, told apart by a checkpoint's config.json (one line adds one)
    random_checkpoints.py  what every family's `epd make-model` presets share (tokenizer, logit scale)
    qwen_vl/         Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL
    internvl/        InternVL (InternVL3.5, InternVL3)
    glm4v/           GLM-4.1V and GLM-4.5V
    qwen3_5/         Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet: per-request state)
    gemma3/          Gemma 3
    qwen_omni/       Qwen2.5-Omni's thinker (text, images and audio in; text out)

A family's package holds everything that is its own: its registry entries
(torch-free), its prompt format and image geometry (torch-free, the API's),
its language model over engine/layers/ and its checkpoint names, its vision
tower and image processor (encoder side), its position rule. The engine and
the encoders reach a family only through `registry.py`, which names the heavy
parts as "module:attr" strings imported on first use; they never name a
family themselves (docs/decisions/family-packages.md).
"""
