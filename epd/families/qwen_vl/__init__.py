"""Qwen3-VL, Qwen3-VL-MoE and Qwen2.5-VL: one decoder with knobs, M-RoPE, one prompt format.

    family.py                the three families' registry entries and their position rule (torch-free)
    prompt_format.py         `<|vision_start|>...` placeholders, their expansion, smart_resize geometry
    text_model.py            the language model (Qwen3 / Qwen2 decoder layers, deepstack) over engine/layers/
    text_configs.py          each family's Hugging Face text config -> `TextConfig`
    text_loader.py           the language model built and filled from the checkpoint's names
    positions.py             M-RoPE as a position rule (three rows)
    mrope.py                 M-RoPE positions of a prompt with images and videos
    vision.py                the vision side the encoders use: tower + image processor -> entries
    vision_tower.py          Qwen3-VL's vision tower (deepstack)
    qwen2_5_vision_tower.py  Qwen2.5-VL's vision tower (windowed attention)
    image_processor.py       decoded images -> the tower's input (the checkpoint's image processor)
    presets.py               `epd make-model` presets: random checkpoints written with transformers' classes
"""
