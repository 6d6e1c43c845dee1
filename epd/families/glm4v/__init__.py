"""GLM-4.1V (`glm4v`, transformers' Glm4vForConditionalGeneration): its language side.

    text_model.py   the GLM-4 decoder on the paged cache: sandwich norms, partial rotary on adjacent pairs
    positions.py    its 3-D positions (get_rope_index): M-RoPE over one span per image or video frame group
    text_loader.py  the release's tensor names -> our parameters: `load_text_model`
    presets.py      `epd make-model` presets and the writer of a checkpoint's files
"""
