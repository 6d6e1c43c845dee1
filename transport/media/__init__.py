"""Media geometry, torch-free: what the API counts an item's tokens and content
keys by, and the encoders resize and key by, from headers alone; and how a
family writes its items into a prompt.

prompt_format.py      a family's placeholders, their expansion and its image geometry (`PromptFormat`)
image_geometry.py     an image's resize and its placeholder count (Qwen2-VL's smart_resize)
video_geometry.py     which frames of a video are sampled, their size, groups and tokens (`VideoPlan`)
video_plan_fields.py  a VideoPlan as an EncodeRequest carries it to the encoder
video_chunks.py       one long video's plan cut into chunks of whole temporal groups
video_keys.py         a video's content keys: the video's mm_hash and its entries'
audio_samples.py      an audio file decoded to mono samples, and resampled (PyAV): the API's count, the encoder's clip
"""
