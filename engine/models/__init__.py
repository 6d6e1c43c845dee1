"""The language models the engine runs, on a paged KV cache, over the shared layers of engine/layers/.

    registry.py      the families served, told apart by a checkpoint's config.json
    qwen3_vl.py      Qwen3-VL's language model (and its relatives, by config)
    qwen2_5_vl.py    Qwen2.5-VL's text config on the same decoder
    qwen3_vl_moe.py  Qwen3-VL-MoE's text config: sparse MoE MLPs
    positions.py     where a model's tokens sit: `position_dims` 1 (RoPE) or 3 (M-RoPE), a request's positions
    mrope.py         M-RoPE positions for a prompt with images and videos
"""
