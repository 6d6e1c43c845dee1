"""vLLM's /tokenize, /detokenize, /version and /v1/models/{id} on a real server: one
aggregated server of the tiny checkpoint, started as `epd serve ./tiny` (so the model
id it lists holds a dot and a slash) with `--mm-processor-kwargs` (so the count is
right only if the API and the encoder both resize with it), shared by the module."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from testkit.media import IMG_A, IMG_B, image_part
from testkit.server import ServerProcess, free_port

MODEL_ID = "./tiny"
PROCESSOR_KWARGS = {"max_pixels": 4096}  # below the test images' own: fewer placeholders than the file's


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    assert Path(tiny_model).name == "tiny"
    port = free_port()
    log = tmp_path_factory.mktemp("tokenize") / f"server-{port}.log"
    srv = ServerProcess(["serve", MODEL_ID, "--mode", "aggregated", "--port", str(port), "--num-kv-blocks", "64",
                         "--dtype", "float32", "--device", "cpu", "--threads-per-worker", "1",
                         "--mm-processor-kwargs", json.dumps(PROCESSOR_KWARGS)],
                        port, str(log), cwd=str(Path(tiny_model).parent)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_tokenize_counts_what_a_chat_with_images_costs(server, client, tiny_model):
    from epd.transport.media.image_geometry import ImageGeometry
    from epd.engine.model_info import ModelInfo

    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [image_part(IMG_A), {"type": "text", "text": "And this one?"},
                                             image_part(IMG_B)]}]
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL_ID, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1, temperature=0).usage
    assert body["count"] == len(body["tokens"]) == usage.prompt_tokens
    # the images' placeholders are in the count, as many as each image costs
    geometry = ImageGeometry.from_pretrained(tiny_model, PROCESSOR_KWARGS)
    image_token_id = ModelInfo.from_pretrained(tiny_model).image_token_id
    assert body["tokens"].count(image_token_id) == \
        geometry.num_image_tokens(100, 60) + geometry.num_image_tokens(37, 150) > 2
    plain = ImageGeometry.from_pretrained(tiny_model)
    assert geometry.num_image_tokens(100, 60) < plain.num_image_tokens(100, 60)
    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert body["max_model_len"] == models[0]["max_model_len"]


def test_tokenize_a_prompt_and_detokenize_it_back(server, client):
    prompt = "Hello world, how are you? Fine."
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["token_strs"]) == body["count"] > 3
    completion = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == body["count"]
    back = httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL_ID, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}
    refused = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10 ** 9]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"


def test_version_and_the_listed_model_by_its_id(server, client):
    from epd import __version__

    assert httpx.get(f"{server.base_url}/version").json() == {"version": __version__}
    [listed] = client.models.list().data
    assert listed.id == MODEL_ID
    assert client.models.retrieve(listed.id).id == MODEL_ID  # sent as /v1/models/.%2Ftiny
    plain = httpx.get(f"{server.base_url}/v1/models/{MODEL_ID}")  # sent as /v1/models/tiny
    assert plain.status_code == 200 and plain.json()["id"] == MODEL_ID
