"""GLM-4.1V (`glm4v`, transformers' Glm4vForConditionalGeneration) and GLM-4.5V
(`glm4v_moe`, Glm4vMoeForConditionalGeneration): one vision tower, one prompt format, one decoder with options.

    family.py           the two families' registry entries (torch-free)
    prompt_format.py    torch-free: the placeholders, their expansion and the image geometry
    video_geometry.py   torch-free: a video's plan from its header (frames, size, grid, group times)
    image_processor.py  decoded images -> the tower's input (the checkpoint's Glm4vImageProcessor)
    vision.py           the vision tower and projector, and the family's vision model (`load_vision`)
    text_model.py       the GLM decoder on the paged cache: GLM-4.1V's sandwich norms and pair-wise partial
                        rotary, GLM-4.5V's grouped-routing MoE, as options of one model
    positions.py        their 3-D positions (get_rope_index): M-RoPE over one span per image or video frame group
    text_loader.py      the release's tensor names -> our parameters: `load_text_model`
    presets.py          `epd make-model` presets and the writer of a checkpoint's files
"""
