"""GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): one vision tower, one prompt format.

prompt_format.py    torch-free: the placeholders, their expansion and the image geometry
image_processor.py  decoded images -> the tower's input (the checkpoint's Glm4vImageProcessor)
vision.py           the vision tower and projector, and the family's vision model (`load_vision`)
video_geometry.py   torch-free: a video's plan from its header (frames, size, grid, group times)
"""
