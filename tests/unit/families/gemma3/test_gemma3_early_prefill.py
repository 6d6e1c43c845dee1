"""Early prefill on Gemma 3, whose image tokens attend to each other both ways: a request
enters the engine with its first image still missing (what the prefill worker of e-p-d
does when an encoder is late), is prefilled up to that image and no further while its
second image is already here, then, once the image arrives, takes it whole and answers
the tokens and top-5 logprobs of the same chat with every image there from the start
(test_gemma3_llm.py: transformers'). The late request runs first: an engine that already
holds an image does not wait for it."""
from __future__ import annotations

import torch
from testkit.engine_factories import cpu_llm
from testkit.media import image_bytes, image_part

from epd.engine.request import Request
from epd.transport.wire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
LATE, HERE = image_bytes(90, 50, seed=41), image_bytes(40, 70, seed=42)
CHAT = [{"role": "system", "content": "You compare pictures for a careful reader, in a few words. " * 3},
        {"role": "user", "content": [image_part(LATE), {"type": "text", "text": "versus"}, image_part(HERE),
                                     {"type": "text", "text": "Which is brighter?"}]}]


def test_a_late_image_is_prefilled_around_and_answers_alike(gemma3_model):
    llm = cpu_llm(gemma3_model, enable_prefix_caching=False, max_num_batched_tokens=64)
    prompt = llm.inputs.process_chat(CHAT, [LATE, HERE], [])
    entries = llm._encode_images({item.key: (item, None) for item in prompt.items})
    late, here = prompt.mm_spans
    assert late.offset > 64 and late.mm_hash != here.mm_hash  # the text before it takes more than one step

    request = Request(request_id="late", prompt_token_ids=list(prompt.token_ids), sampling_params=GREEDY,
                      mm_spans=list(prompt.mm_spans))
    llm.engine.add_request(request, {here.mm_hash: entries[here.mm_hash]}, pending_mm_hashes={late.mm_hash})
    for _ in range(4):
        assert not llm.engine.step().updates  # no token while an image is missing
    assert request.num_computed_tokens == late.offset  # the text before it, up to the image, not into it
    assert llm.engine.add_embedding(late.mm_hash, entries[late.mm_hash])
    tokens, tops = [], []
    while llm.engine.has_unfinished():
        result = llm.engine.step()
        for update in result.updates:
            tokens += update.new_token_ids
            tops += [lp.top for lp in result.logprobs[update.request_id]]

    [whole] = llm.chat([CHAT], GREEDY)  # every image here at once
    assert prompt.token_ids == whole.prompt_token_ids
    assert tokens == whole.outputs[0].token_ids
    expected = [lp.top for lp in whole.outputs[0].logprobs]
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in expected]
    torch.testing.assert_close([[v for _, v in top] for top in tops], [[v for _, v in top] for top in expected],
                               atol=1e-5, rtol=0)
