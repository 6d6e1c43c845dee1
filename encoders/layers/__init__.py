"""Pieces the vision towers share (torch; imports transport/ at most, never the engine).

segment_attention.py  non-causal attention within each segment (an image, a temporal group, a window)
vision_norm.py        the towers' RMSNorm (float32 inside, the weight applied in the input's dtype)
vision_rotary.py      the 2-D rotary of a patch grid: rows and columns in spatial-merge-block order,
                      their cos / sin, and applying them to queries and keys
"""
