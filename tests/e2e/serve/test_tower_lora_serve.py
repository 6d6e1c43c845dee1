"""Tower adapters served by a real `epd serve --enable-lora --enable-tower-lora`
(issue 28), aggregated and e-p-d, through the official openai client: an adapter
with vision tower weights runs them on the encoder (the aggregated worker's own
encoder, or the encoder worker) and each image answer is transformers + peft's,
tokens and logprobs; the embedding cache keeps it apart: the base after a tower
adapter on the same prompt and image gets the base's answer and is encoded again
(no hit), a language-only adapter after the base hits the cache (no encoding)."""
from __future__ import annotations

import openai
import pytest
from testkit.lora_adapters import TOWER_MODULES, make_adapter, peft_image_greedy
from testkit.media import image_bytes, image_part
from testkit.server import start_server

pytestmark = pytest.mark.slow

SERVED = "tiny-base"
NUM_TOKENS = 5
IMAGE = image_bytes(90, 90, seed=31)
MESSAGES = [{"role": "user", "content": [image_part(IMAGE), {"type": "text", "text": "What is it?"}]}]
NAMES = [SERVED, "tower", "lang"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("tower-lora")
    return {"tower": make_adapter(tiny_model, out / "tower", TOWER_MODULES + ("q_proj", "o_proj"), r=8, seed=41),
            "lang": make_adapter(tiny_model, out / "lang", ("v_proj", "down_proj"), r=4, seed=42)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[str, tuple[list[int], list[float]]]:
    """model name -> transformers + peft's greedy tokens and their logprobs."""
    answers = peft_image_greedy(tiny_model, adapters, MESSAGES, [IMAGE],
                                [None if n == SERVED else n for n in NAMES], NUM_TOKENS)
    return dict(zip(NAMES, answers))


@pytest.fixture(scope="module", params=["aggregated", "e-p-d"])
def server(request, tiny_model, adapters, tmp_path_factory):
    mode = request.param
    srv = start_server(tiny_model, tmp_path_factory.mktemp(mode), mode, "--served-model-name", SERVED,
                       "--enable-lora", "--enable-tower-lora", "--max-loras", "2",
                       "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))
    yield srv
    assert srv.stop() == 0, srv.log()


def _chat(client: openai.OpenAI, model: str) -> tuple[list[int], list[float]]:
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.model == model
    return r.choices[0].model_extra["token_ids"], [lp.logprob for lp in r.choices[0].logprobs.content]


def test_tower_adapters_served_and_their_embeddings_kept_apart(server, expected):
    assert expected["tower"][0] != expected[SERVED][0], "the adapter was meant to change the image answer"
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(model: str) -> tuple[float, float]:
        """The answer checked; what it cost the encoders (images encoded) and the cache (hits)."""
        encoded, hits = server.settled_sum("epd:encoder_images_total"), server.metric_sum("epd:mm_cache_hits_total")
        tokens, logprobs = _chat(client, model)
        assert tokens == expected[model][0], model
        assert logprobs == pytest.approx(expected[model][1], abs=1e-3), model
        return (server.settled_sum("epd:encoder_images_total") - encoded,
                server.metric_sum("epd:mm_cache_hits_total") - hits)

    assert ask("tower") == (1, 0)  # encoded with the adapter's tower weights
    assert ask(SERVED) == (1, 0)  # the same image again, but the base tower's: encoded, no hit on the adapter's
    assert ask("lang") == (0, 1)  # language-only: the base's embeddings, from the cache
    assert ask("tower") == (0, 1)  # its own embeddings, from the cache
