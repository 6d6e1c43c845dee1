"""transformers' GLM-4.1V and InternVL on a chat with a video (and images): the
reference of their video tests, greedy, one full forward per token.

transformers' whole processor (AutoProcessor, in a child process with
torchvision: testkit/video_reference.py) gives the prompt's token ids and the
video's tensors from the decoded frames; the images' pixels come from the PIL
image processor here, as the engine's encoder makes them (the child's would be
torchvision's).

GLM-4.1V: transformers' forward cannot take an image and a video in one prompt
(a video's positions hold the image token, so its image and video masks are
the same tokens and each feature count is checked against both), so the
reference places the model's own get_image_features / get_video_features at
the processor's mm_token_type_ids (1 image, 2 video) and takes the model's own
get_rope_index; on a video alone its first step is checked against the
model's forward. InternVL: the frames are images to the model (`pixel_values`
holds the images' tiles and the video's frames in prompt order).
"""
from __future__ import annotations

import io
import re

import torch
from PIL import Image

from testkit.hf_reference import _template_messages
from testkit.video_reference import VideoClips, hf_processor_inputs_many

TOP = 5
Chat = tuple[list[dict], list[bytes], VideoClips]  # messages, the images' bytes, the video's frames
Greedy = tuple[list[int], list[int], list[list]]  # prompt ids, greedy tokens, each step's top-5 (token, logprob)


def assert_same_greedy(out, expected: Greedy, name: str) -> None:
    """The LLM's output `out` (top-5 logprobs asked for) has the reference's prompt ids, greedy
    tokens, each step's top token ids in order and their logprobs within 1e-4; `name` in the failure."""
    prompt, tokens, tops = expected
    assert out.prompt_token_ids == prompt, name
    assert out.outputs[0].token_ids == tokens, name
    got = [lp.top for lp in out.outputs[0].logprobs]
    assert [[t for t, _ in top] for top in got] == [[t for t, _ in top] for top in tops], name
    torch.testing.assert_close([[v for _, v in top] for top in got], [[v for _, v in top] for top in tops],
                               atol=1e-4, rtol=0)


def _chat_text(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)


def _step(ids: torch.Tensor, logits: torch.Tensor, tokens: list, tops: list) -> torch.Tensor:
    tokens.append(int(logits.argmax()))
    top = torch.log_softmax(logits.float(), -1).topk(TOP)
    tops.append(list(zip(top.indices.tolist(), top.values.tolist())))
    return torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)


@torch.no_grad()
def glm4v_greedy(model_dir: str, chats: list[Chat], num_tokens: int) -> list[Greedy]:
    """Each chat's (prompt ids, greedy tokens, top-5 logprobs) by GLM-4.1V / GLM-4.5V."""
    from testkit.hf_reference import _load

    model, tok, ip = _load(model_dir)
    outs = hf_processor_inputs_many(model_dir, [(_chat_text(tok, m), clips, images) for m, images, clips in chats])
    return [_glm4v_one(model, ip, out, images, num_tokens) for (_, images, _), out in zip(chats, outs)]


def _glm4v_one(model, ip, out: dict, images: list[bytes], num_tokens: int) -> Greedy:
    ids, types = out["input_ids"], out["mm_token_type_ids"]
    video_grid = out["video_grid_thw"]
    embeds = {2: torch.cat(model.model.get_video_features(out["pixel_values_videos"], video_grid).pooler_output)}
    image_grid = None
    if images:
        px = ip(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
        image_grid = px["image_grid_thw"]
        assert torch.equal(out["image_grid_thw"], image_grid)  # the child's pads: the same grids
        embeds[1] = torch.cat(model.model.get_image_features(px["pixel_values"], image_grid).pooler_output)
    prompt, tokens, tops = ids[0].tolist(), [], []
    for step in range(num_tokens):
        types = torch.cat([types, torch.zeros(1, ids.shape[1] - types.shape[1], dtype=types.dtype)], dim=1)
        x = model.get_input_embeddings()(ids)
        for kind, rows in embeds.items():
            x[types == kind] = rows
        positions, _ = model.model.get_rope_index(ids, types, image_grid, video_grid)
        logits = model(inputs_embeds=x, position_ids=positions).logits[0, -1]
        if step == 0 and not images:  # the model's own forward on a video alone
            own = model(input_ids=ids, pixel_values_videos=out["pixel_values_videos"], video_grid_thw=video_grid,
                        mm_token_type_ids=types).logits[0, -1]
            torch.testing.assert_close(logits, own, atol=1e-5, rtol=0)
        ids = _step(ids, logits, tokens, tops)
    return prompt, tokens, tops


@torch.no_grad()
def internvl_greedy(model_dir: str, chats: list[Chat], num_tokens: int) -> list[Greedy]:
    """Each chat's (prompt ids, greedy tokens, top-5 logprobs) by InternVL; one video a chat."""
    from testkit.internvl_reference import _load

    model, tok, ip, _ = _load(model_dir)
    texts = [_chat_text(tok, messages) for messages, _, _ in chats]
    outs = hf_processor_inputs_many(model_dir, [(text, clips, images)
                                                for text, (_, images, clips) in zip(texts, chats)])
    return [_internvl_one(model, tok, ip, text, out, images, num_tokens)
            for text, (_, images, _), out in zip(texts, chats, outs)]


def _internvl_one(model, tok, ip, text: str, out: dict, images: list[bytes], num_tokens: int) -> Greedy:
    assert text.count(tok.video_token) == 1, "one video: its frames are what the images' tiles leave"
    ids, merged = out["input_ids"], out["pixel_values"]
    tiles = [ip(images=[Image.open(io.BytesIO(b)).convert("RGB")], crop_to_patches=True, return_tensors="pt")
             ["pixel_values"] for b in images]
    num_frames = merged.shape[0] - sum(t.shape[0] for t in tiles)  # one video: what the tiles leave
    pieces, row, image_it = [], 0, iter(tiles)
    for kind in re.findall(rf"{re.escape(tok.context_image_token)}|{re.escape(tok.video_token)}", text):
        piece = next(image_it) if kind == tok.context_image_token else merged[row:row + num_frames]
        row += piece.shape[0]
        pieces.append(piece)
    pixel_values = torch.cat(pieces)
    prompt, tokens, tops = ids[0].tolist(), [], []
    for _ in range(num_tokens):
        ids = _step(ids, model(input_ids=ids, pixel_values=pixel_values).logits[0, -1], tokens, tops)
    return prompt, tokens, tops
