"""How large one frame may be at each receiving end of the worker plane.

Every bound is the largest frame a legitimate peer can send there, so a
peer sending more is one we want disconnected (ZeroMQ's MAXMSGSIZE, set by
`channels.Receiver(max_frame_bytes=...)`) before the frame is kept in
memory. A message's header (msgpack: a prompt of token ids, a sampling map,
one step's outputs) is below `HEADER_MAX_BYTES`; tensor frames are bounded
by the deployment's --max-model-len, blobs by --max-image-bytes.
"""
from __future__ import annotations

DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # --max-image-bytes (epd serve's media limit, epd worker's inbox)
HEADER_MAX_BYTES = 64 << 20  # a prompt of 256k token ids is ~2.5 MB of msgpack; a step's outputs far less
MARGIN_BYTES = 1 << 20  # msgpack and tensor-meta overhead on top of a payload
FLOAT32_BYTES = 4  # the widest element a KV or embedding frame is sent in


def engine_inbox_frame_bytes(num_layers: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                             max_model_len: int, block_size: int) -> int:
    """A prefill, decode, pd or aggregated worker's inbox: the k (or v) frame of a
    KVTransfer of a whole --max-model-len prompt, or an EncodeDone carrying the
    embeddings of an image as long as that prompt ([tokens, hidden], each of its
    extras no larger), whichever is larger; a header at least."""
    num_slots = -(-max_model_len // block_size) * block_size
    kv = num_layers * num_slots * num_kv_heads * head_dim * FLOAT32_BYTES
    embeddings = max_model_len * hidden_size * FLOAT32_BYTES
    return max(HEADER_MAX_BYTES, kv, embeddings) + MARGIN_BYTES


def encoder_inbox_frame_bytes(max_image_bytes: int) -> int:
    """An encoder's inbox: an EncodeRequest's image, at most --max-image-bytes."""
    return max(HEADER_MAX_BYTES, max_image_bytes) + MARGIN_BYTES


COLLECTOR_FRAME_BYTES = HEADER_MAX_BYTES + MARGIN_BYTES  # the API's collector: headers only (Ready, stats, outputs)
