"""Gemma 3 (`gemma3`, transformers' Gemma3ForConditionalGeneration): everything family-specific.

    prompt_format.py    torch-free: GEMMA3_FORMAT (<start_of_image> -> the image's soft tokens), Gemma3Geometry
                        (a fixed token count per crop) and PanAndScan (an image's crops from its size)
    image_processor.py  decoded images -> the tower's pixels (originals and crops), through the checkpoint's
                        own image processor
    vision.py           the SigLIP tower + projector (encoder side; never imports the engine): load_vision
    text_model.py       the language model over engine/layers/: sandwich norms, sliding and global layers
    text_loader.py      the language model's checkpoint names -> our parameters: load_text_model
    family.py           its registry entry (torch-free): Gemma 3, plain 1-D RoPE positions
    presets.py          `make-model` presets: config, weights, processor files, chat template, tokenizer
"""
