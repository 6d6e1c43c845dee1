"""M-RoPE positions for a prompt with images (Qwen3-VL's position rule).

Text tokens advance all three rows (t, h, w) together. An image of merged
grid (t, h', w') placed at running position p gets t-row p + frame, h-row
p + row, w-row p + col; the text after it resumes at p + max(h', w').
Tokens generated later sit at `index + delta`, with
`delta = max(prompt positions) + 1 - num_prompt_tokens`.
"""
from __future__ import annotations

import torch


def mrope_positions(num_tokens: int, spans, spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] for a prompt and the delta for later tokens.

    `spans` are the prompt's images in order, each with `.offset`, `.length`
    and `.grid_thw` (patches, before the spatial merge).
    """
    pieces = []
    cursor = 0  # prompt index of the next token to place
    pos = 0  # running position
    for span in spans:
        if span.offset > cursor:  # text before this image
            n = span.offset - cursor
            pieces.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
        t, h, w = span.grid_thw
        h, w = h // spatial_merge_size, w // spatial_merge_size
        assert t * h * w == span.length, f"image span of {span.length} tokens does not match grid {span.grid_thw}"
        tt = torch.arange(t).view(t, 1, 1).expand(t, h, w).reshape(-1)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
        pieces.append(torch.stack([tt, hh, ww]) + pos)
        pos += max(h, w)
        cursor = span.end
    if num_tokens > cursor:
        n = num_tokens - cursor
        pieces.append(torch.arange(pos, pos + n).expand(3, n))
        pos += n
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - num_tokens) if num_tokens else 0
    return positions, delta
