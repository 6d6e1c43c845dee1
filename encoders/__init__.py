"""The encoders: images and videos -> vision embeddings, in an encoder worker or
in-process (imports transport/, and the family registry: each family's tower
and image processor are its own, in epd/families/).

encoder_worker.py        the encoder worker loop: EncodeRequests in, embeddings to LMDB, EncodeDone out
image_encoder.py         raw image bytes -> embeddings: decode, preprocess, run the tower
encode_items.py          a batch of images split by tower adapter, each group encoded under its own
image_io.py              reading images: the header only (API) or full pixels (encoder)
video_encoder.py         one video's bytes + the API's plan -> the embeddings its spans take
video_request.py         one video EncodeRequest -> the (key, entry) pairs its spans wait for
audio_encoder.py         audio clips (file bytes or samples) -> embeddings: decode, key, the family's audio side
video_io.py              reading videos with PyAV: the header only (API) or sampled frames
video_processor.py       decoded frames -> the tower's input
tower_adapter.py         a LoRA adapter's tower weights, read and checked (torch-free)
tower_lora.py            LoRA on the vision tower (--enable-tower-lora)
tower_lora_layer.py      the tower's adapter step (one slot on every row) and its wrapping
layers/                  pieces the towers share: segment attention, RMSNorm, the 2-D rotary
"""
