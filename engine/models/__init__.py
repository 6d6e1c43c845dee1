"""What the engine knows of a model: the interface a family's language model meets, and positions.

    causal_lm.py   `CausalLM`: the calls and sizes the engine uses of a family's language model
    positions.py   where a model's tokens sit: `position_dims` 1 (RoPE) or more (a family's rule), a
                   request's positions

The language models themselves are the families' (epd/families/).
"""
