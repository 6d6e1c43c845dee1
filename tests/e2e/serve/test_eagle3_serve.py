"""`epd serve --speculative-config '{"method": "eagle3", ...}'` aggregated and in e-p-d:
the same greedy tokens as the offline engine without speculation, and the same acceptance
in both on the same requests (e-pd's prefill+decode worker runs the aggregated worker's
engine; its image comes from an encoder as in e-p-d). In e-p-d every request is prefilled on the prefill
worker (--max-local-prefill-tokens 0), which runs the head over the prompt and hands the
head's blocks and last features over with the KV: the decode worker drafts at its first
step exactly as the aggregated worker does (docs/architecture.md, "EAGLE-3 across the
prefill -> decode hand-over")."""
from __future__ import annotations

import json

import openai
import pytest
from testkit.eagle3_fit import fit_eagle3
from testkit.media import MIXED_BATCH
from testkit.server import start_server

from epd.transport.wire.sampling import SamplingParams

PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300], list(range(500, 540))]
MAX_TOKENS = 24
IMAGE_CHAT = MIXED_BATCH[1]
COUNTERS = ("epd:spec_decode_num_drafts_total", "epd:spec_decode_num_draft_tokens_total",
            "epd:spec_decode_num_accepted_tokens_total")


@pytest.fixture(scope="module")
def expected_and_head(tiny_model, tmp_path_factory):
    """Without speculation, offline: each prompt's tokens and the image chat's; a head fitted to them."""
    from epd import LLM
    from epd.tools.make_eagle3 import make_eagle3

    llm = LLM(tiny_model, num_kv_blocks=256, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    [chat] = llm.chat([IMAGE_CHAT], params)
    head = make_eagle3(tmp_path_factory.mktemp("eagle3") / "head", "tiny-eagle3")
    fit_eagle3(head, tiny_model, [list(p) + o for p, o in zip(PROMPTS, outs)])
    return outs, list(chat.outputs[0].token_ids), str(head)


def _serve(tiny_model, tmp_path, mode: str, head: str) -> tuple[list[list[int]], list[int], dict[str, float]]:
    """A server's tokens for PROMPTS and the image chat, and its speculation counters after them."""
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    (tmp_path / mode).mkdir()
    srv = start_server(tiny_model, tmp_path / mode, mode, "--speculative-config", json.dumps(spec),
                       "--served-model-name", "m", "--max-local-prefill-tokens", "0")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        extra = {"ignore_eos": True, "return_token_ids": True}
        tokens = []
        for prompt in PROMPTS:  # one at a time: each mode runs the same batches
            r = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra)
            tokens.append(list(r.choices[0].token_ids))
        r = client.chat.completions.create(model="m", messages=IMAGE_CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
        counters = {name: srv.settled_sum(name) for name in COUNTERS}
        counters["position 0"] = srv.metric_sum("epd:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        if mode == "e-p-d":  # the prefill worker ran the head but drafted nothing
            assert srv.metric_sum("epd:spec_decode_num_draft_tokens_total", role="prefill") == 0
        return tokens, list(r.choices[0].token_ids), counters
    finally:
        assert srv.stop() == 0, srv.log()


def test_e_p_d_accepts_as_aggregated(tiny_model, expected_and_head, tmp_path):
    outs, chat_tokens, head = expected_and_head
    aggregated = _serve(tiny_model, tmp_path, "aggregated", head)
    e_p_d = _serve(tiny_model, tmp_path, "e-p-d", head)
    assert aggregated[0] == e_p_d[0] == outs
    assert aggregated[1] == e_p_d[1] == chat_tokens
    assert aggregated[2] == e_p_d[2]
    assert aggregated[2]["epd:spec_decode_num_accepted_tokens_total"] > 0
