"""Qwen2.5-Omni's thinker (text out; the speech talker is not served): Qwen2.5-VL's decoder and
vision tower, an audio tower, TMRoPE.

    family.py          the registry entries (a whole Omni checkpoint, a thinker-only one) and its position rule
    thinker_config.py  how an Omni checkpoint is read: the thinker's config and `thinker.*` tensors only
    prompt_format.py   `<|IMAGE|>` / `<|AUDIO|>` placeholders, their expansion, a clip's token count (torch-free)
    text_loader.py     the language model: qwen_vl's Qwen2.5-VL decoder under the thinker's names
    vision.py          the vision side: qwen_vl's Qwen2.5-VL tower and image processor under the thinker's names
    positions.py       TMRoPE as a position rule: M-RoPE with audio placed like text
    audio_tower.py     the audio tower: windowed Whisper encoder, pooled and projected
    audio.py           the audio side the encoders use: resampling, log-mel features, the tower
    presets.py         `epd make-model` presets: random thinkers written with transformers' classes
"""
