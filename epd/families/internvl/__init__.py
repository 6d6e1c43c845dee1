"""InternVL (transformers' InternVLForConditionalGeneration, model_type
`internvl`): InternViT + pixel-unshuffle + projector over a Qwen3, Qwen3-MoE
or Qwen2 language model with 1-D RoPE; images as 448x448 tiles with a
thumbnail; videos as frames, each one tile. Torch-free unless said.

    family.py           its registry entry (ModelFamily)
    prompt_format.py    INTERNVL_FORMAT (placeholders, expansion) and TileGeometry (tiles from size)
    video_geometry.py   a video's plan from its header (InternVLVideoProcessor's frames, a tile each)
    image_processor.py  decoded images -> tiles, through the checkpoint's image processor (torch)
    vision.py           the tower and projector, tiles -> MMEntry per image; its loader (torch)
    text_model.py       the language model: the Qwen decoder configured for InternVL (torch)
    text_loader.py      the release's tensor names -> the language model (torch)
    presets.py          `make-model` presets and the writer of their files
"""
