"""GLM-4.1V (`glm4v`, transformers' Glm4vForConditionalGeneration) and GLM-4.5V
(`glm4v_moe`, Glm4vMoeForConditionalGeneration): their language side.

    text_model.py   the GLM decoder on the paged cache: GLM-4.1V's sandwich norms and pair-wise partial
                    rotary, GLM-4.5V's grouped-routing MoE, as options of one model
    positions.py    their 3-D positions (get_rope_index): M-RoPE over one span per image or video frame group
    text_loader.py  the release's tensor names -> our parameters: `load_text_model`
    presets.py      `epd make-model` presets and the writer of a checkpoint's files
"""
