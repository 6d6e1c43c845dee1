"""vLLM's prompt_logprobs through a real `epd serve` (the shared aggregated and e-p-d servers,
float32) and the `openai` client: every prompt token's logprob, rank and top k
equal transformers' log-softmax on the same checkpoint; echo with logprobs puts
them before the answer's."""
from __future__ import annotations

import openai
import pytest
from testkit.hf_reference import hf_prompt_logits
from testkit.media import image_bytes, image_part
from testkit.mode_servers import SERVED_MODEL

pytestmark = pytest.mark.parametrize("mode_server", ["aggregated", "e-p-d"], indirect=True)

IMG = image_bytes(64, 48, seed=5)
MESSAGES = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "Describe the picture."}]}]
K = 3


@pytest.fixture(scope="module")
def client(mode_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=mode_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_against(steps: list, ids: list[int], ref_logits) -> None:
    """`steps` (vLLM's prompt_logprobs) against transformers' logits of the same prompt."""
    ref = ref_logits.log_softmax(dim=-1)  # [num_prompt_tokens, vocab] float32
    assert steps[0] is None and len(steps) == len(ids)
    for i in range(1, len(ids)):
        row, step = ref[i - 1], steps[i]
        mine = step[str(ids[i])]
        assert abs(mine["logprob"] - row[ids[i]].item()) < 1e-4, i
        assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1, i
        top = row.topk(K)
        ranked = sorted(((v["rank"], float(v["logprob"])) for t, v in step.items() if v["rank"] <= K))
        assert [r for r, _ in ranked][:K] == [1, 2, 3], i
        for (_, logprob), ref_value in zip(ranked, top.values.tolist()):
            assert abs(logprob - ref_value) < 1e-4, i


def test_chat_prompt_logprobs_with_an_image_equal_transformers(client, tiny_model):
    r = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"prompt_logprobs": K, "return_token_ids": True})
    ids, ref_logits = hf_prompt_logits(tiny_model, MESSAGES, [IMG])
    assert r.model_extra["prompt_token_ids"] == ids
    check_against(r.model_extra["prompt_logprobs"], ids, ref_logits)
    plain = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None


def test_completion_prompt_logprobs_and_echo_with_logprobs(client, tiny_model):
    text = [{"role": "user", "content": "Tell me about lighthouses."}]
    ids, ref_logits = hf_prompt_logits(tiny_model, text, [])
    r = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": K, "ignore_eos": True})
    check_against(r.choices[0].model_extra["prompt_logprobs"], ids, ref_logits)
    again = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=2, temperature=0,  # cached prefix
                                      extra_body={"prompt_logprobs": K, "ignore_eos": True})
    assert again.choices[0].model_extra["prompt_logprobs"] == r.choices[0].model_extra["prompt_logprobs"]
    echoed = client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    steps = r.choices[0].model_extra["prompt_logprobs"]
    assert lp.token_logprobs[1:len(ids)] == [steps[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    streamed = list(client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=2, temperature=0,
                                              echo=True, logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_MODEL, prompt=ids, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"
