"""`epd serve --speculative-config` (n-gram, and a draft model) in every mode: greedy
completions, streamed or not, with logprobs, and an image chat handed from the
prefill worker to the decode worker, give the tokens the offline engine gives
without speculation; /metrics shows drafts accepted under vLLM's names (and
`epd bench serve` reports the run's acceptance from them), and in
e-p-d only the decode worker speculates."""
from __future__ import annotations

import argparse
import json

import openai
import pytest
from testkit.media import MIXED_BATCH
from testkit.server import start_server

from epd.transport.wire.sampling import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[11, 12, 13, 14, 15] * 5, [300, 301, 302] * 7 + [300]]
MAX_TOKENS = 24
IMAGE_CHAT = MIXED_BATCH[1]


@pytest.fixture(scope="module")
def expected(tiny_model):
    """Without speculation, offline: each prompt's tokens and logprobs, the image chat's tokens."""
    from epd import LLM

    llm = LLM(tiny_model, num_kv_blocks=256, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    [chat] = llm.chat([IMAGE_CHAT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return outs, chat.outputs[0].token_ids


# Each method in e-p-d (speculation on the decode worker after the hand-over) and in one of the
# modes whose one worker prefills and decodes (aggregated and e-pd run the same engine there):
# four servers instead of the six of the full product.
@pytest.mark.parametrize(("mode", "method"), [("aggregated", "ngram"), ("e-p-d", "ngram"),
                                              ("e-pd", "draft_model"), ("e-p-d", "draft_model")])
def test_served_speculation_gives_the_tokens_without_it(mode, method, tiny_model, tiny_draft, expected, tmp_path):
    """draft_model: in e-p-d the decode worker runs the draft's prefill over the prompt it receives."""
    outs, chat_tokens = expected
    spec = SPEC if method == "ngram" else {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    srv = start_server(tiny_model, tmp_path, mode, "--speculative-config", json.dumps(spec),
                       "--served-model-name", "m")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        extra = {"ignore_eos": True, "return_token_ids": True}
        for prompt, out in zip(PROMPTS, outs):
            r = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=2, extra_body=extra)
            assert r.choices[0].token_ids == out.token_ids
            assert r.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in out.logprobs], abs=1e-4)
            stream = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body=extra)
            assert [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])] == out.token_ids
        r = client.chat.completions.create(model="m", messages=IMAGE_CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].token_ids == chat_tokens  # e-p-d: prefilled with its image, decoded elsewhere
        accepted = srv.settled_sum("epd:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= srv.metric_sum("epd:spec_decode_num_draft_tokens_total")
        assert srv.metric_sum("epd:spec_decode_num_drafts_total") > 0
        assert srv.metric_sum("epd:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        if mode == "aggregated" and method == "ngram":
            _bench_reports_the_runs_acceptance(srv, tmp_path)
        if mode == "e-p-d":  # the prefill worker samples one token a request: nothing to verify
            assert srv.metric_sum("epd:spec_decode_num_draft_tokens_total", role="prefill") == 0
            assert srv.metric_sum("epd:spec_decode_num_accepted_tokens_total", role="decode") == accepted
    finally:
        assert srv.stop() == 0, srv.log()
    assert not srv.group_alive(), "a server process survived Ctrl-C"


def _bench_reports_the_runs_acceptance(srv, tmp_path) -> None:
    """`epd bench serve` reads the server's counters before and after its run."""
    from epd.bench.serve import add_arguments, main

    data = tmp_path / "repeat.jsonl"
    data.write_text("".join(json.dumps({"prompt": "one two three four " * 6, "output_len": 24}) + "\n"
                            for _ in range(4)))
    before = {name: srv.settled_sum(f"epd:spec_decode_num_{name}_total")
              for name in ("drafts", "draft_tokens", "accepted_tokens")}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = main(parser.parse_args(["--base-url", srv.base_url, "--dataset", "jsonl", "--dataset-path", str(data),
                                     "--temperature", "0", "--ignore-eos", "--no-progress"]))
    assert result["completed"] == 4
    delta = {name: srv.settled_sum(f"epd:spec_decode_num_{name}_total") - before[name] for name in before}
    assert result["spec_decode_num_drafts"] == delta["drafts"] > 0
    assert result["spec_decode_num_draft_tokens"] == delta["draft_tokens"]
    assert result["spec_decode_num_accepted_tokens"] == delta["accepted_tokens"]
    assert result["spec_decode_acceptance_rate"] == pytest.approx(delta["accepted_tokens"] / delta["draft_tokens"])
    assert result["spec_decode_mean_acceptance_length"] == \
        pytest.approx(1 + delta["accepted_tokens"] / delta["drafts"])
