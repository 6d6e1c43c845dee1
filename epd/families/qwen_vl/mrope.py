"""M-RoPE positions for a prompt with images and videos (Qwen3-VL's and
Qwen2.5-VL's position rule, as transformers 5.x computes them).

Text tokens advance all three rows (t, h, w) together. A span of merged grid
(t, h', w') placed at running position p gets t-row p + temporal index, h-row
p + row, w-row p + col; the text after it resumes at p + max(h', w').
The temporal index is the group index (images have one group; a Qwen3-VL
video is one span per group, each (1, h, w), with its timestamp as text in
between), or for a Qwen2.5-VL video `int(group x tokens_per_second x
second_per_grid_t)`, computed in float32 as transformers does. A Qwen2.5-VL
video cut into chunks (`--video-chunk-frames`) is one span per chunk; a span
with `first_group` > 0 continues the span before it (no text between): its
groups g are the video's first_group + g, placed at that span's running
position, so the positions are those of the whole video in one span.
Tokens generated later sit at `index + delta`, with
`delta = max(prompt positions) + 1 - num_prompt_tokens`.
"""
from __future__ import annotations

import torch


def mrope_positions(num_tokens: int, spans, spatial_merge_size: int,
                    tokens_per_second: float = 1.0) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] for a prompt and the delta for later tokens.

    `spans` are the prompt's images and videos in order (MMSpan), each with
    `.offset`, `.length` and in `.meta` "grid_thw" (patches, before the spatial
    merge), "second_per_grid_t" (absent or 0: temporal index = group index) and
    "first_group" (absent or 0: no chunk continued). `tokens_per_second`: the
    vision config's (Qwen2.5-VL).
    """
    pieces = []
    cursor = 0  # prompt index of the next token to place
    pos = 0  # running position
    start = 0  # running position the last span was placed at
    for span in spans:
        first_group = span.meta.get("first_group", 0)
        if first_group:  # the next chunk of the video just placed: the same start, its later groups
            assert span.offset == cursor, "a video chunk's span must follow the span before it"
            pos = start
        elif span.offset > cursor:  # text before this span
            n = span.offset - cursor
            pieces.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
        t, h, w = span.meta["grid_thw"]
        h, w = h // spatial_merge_size, w // spatial_merge_size
        assert t * h * w == span.length, f"span of {span.length} tokens does not match grid {span.meta['grid_thw']}"
        groups = torch.arange(first_group, first_group + t)
        if span.meta.get("second_per_grid_t", 0.0):
            step = torch.tensor(tokens_per_second, dtype=torch.float32) \
                * torch.tensor(span.meta["second_per_grid_t"], dtype=torch.float32)
            groups = (groups * step).long()
        tt = groups.view(t, 1, 1).expand(t, h, w).reshape(-1)
        hh = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
        ww = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
        pieces.append(torch.stack([tt, hh, ww]) + pos)
        start = pos
        pos += max(h, w)
        cursor = span.end
    if num_tokens > cursor:
        n = num_tokens - cursor
        pieces.append(torch.arange(pos, pos + n).expand(3, n))
        pos += n
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - num_tokens) if num_tokens else 0
    return positions, delta


def positions_between(prompt_positions: torch.Tensor, delta: int, num_prompt_tokens: int, start: int, end: int,
                      device) -> torch.Tensor:
    """[3, end - start] positions of a request's tokens start..end: the prompt's from
    `mrope_positions` (`prompt_positions`), then text positions shifted by its `delta`."""
    parts = []
    if start < num_prompt_tokens:
        parts.append(prompt_positions[:, start:min(end, num_prompt_tokens)])
    if end > num_prompt_tokens:
        first = max(start, num_prompt_tokens)
        parts.append(torch.arange(first + delta, end + delta, device=device).expand(3, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
