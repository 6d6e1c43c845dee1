"""`epd serve` and the `epd` command on checkpoints in the releases' layout
(tests/testkit/release_layout.py): the template from chat_template.json is the one
rendered (Qwen3-VL's release template: a video's prompt and greedy tokens are
transformers' processor's and model's), omitted sampling fields take generation_config.json's values, a
checkpoint without preprocessor_config.json serves text, and a bad checkpoint
or a --max-model-len beyond the model is one line and exit code 2.

One server per layout for the module: aggregated for the release, e-p-d for
the text-only checkpoint (its encoder worker has no image processor)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from testkit.hf_reference import hf_greedy, hf_inputs
from testkit.media import data_url, image_bytes, image_part
from testkit.release_layout import NEUTRAL_SAMPLING, QWEN3_VL_SAMPLING, processor_template, release_checkpoint
from testkit.release_templates import QWEN3_VL
from testkit.server import start_server
from testkit.video_reference import VideoClips, reference_available
from testkit.videos import encode_video, synthetic_frames

from epd.cli import main

TEXT = [{"role": "user", "content": "Tell me a story about a cat"}]
RELEASE = {k: v for k, v in QWEN3_VL_SAMPLING.items() if k != "do_sample"}
SEEDS = range(6)
MAX_MODEL_LEN = 64  # the release server's: a long prompt leaves less room than MAX_NEW_TOKENS
MAX_NEW_TOKENS = 24  # --override-generation-config: the default max_tokens, and a cap on every request's


def run_epd(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "epd.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def release_model(tiny_model, tmp_path_factory) -> str:
    return release_checkpoint(tiny_model, tmp_path_factory.mktemp("release") / "ckpt", QWEN3_VL_SAMPLING,
                              template=QWEN3_VL)


@pytest.fixture(scope="module")
def text_only_model(tiny_model, tmp_path_factory) -> str:
    """No preprocessor_config.json and no chat template: its server is given one with --chat-template."""
    model = release_checkpoint(tiny_model, tmp_path_factory.mktemp("text-only") / "ckpt", image_processor=False)
    template = Path(model).parent / "template.jinja"
    template.write_text(processor_template(model))
    (Path(model) / "chat_template.json").unlink()
    return model


@pytest.fixture(scope="module")
def release_server(release_model, tmp_path_factory):
    srv = start_server(release_model, tmp_path_factory.mktemp("release-log"), "aggregated",
                       "--max-model-len", str(MAX_MODEL_LEN),
                       "--override-generation-config", json.dumps({"max_new_tokens": MAX_NEW_TOKENS}))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def text_only_server(text_only_model, tmp_path_factory):
    # e-p-d, the default mode: the encoder worker starts without an image processor and is sent nothing
    srv = start_server(text_only_model, tmp_path_factory.mktemp("text-only-log"), "e-p-d",
                       "--chat-template", str(Path(text_only_model).parent / "template.jinja"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_the_template_from_chat_template_json_is_rendered(release_server, release_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(release_model)
    assert not tokenizer.chat_template  # only chat_template.json has one
    text = tokenizer.apply_chat_template(TEXT, chat_template=processor_template(release_model), tokenize=False,
                                         add_generation_prompt=True)
    out = client(release_server).chat.completions.create(model=release_model, messages=TEXT, max_tokens=1,
                                                         temperature=0)
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert f"chat template from {release_model}/chat_template.json" in release_server.log()


def test_a_video_prompt_and_greedy_tokens_are_transformers_through_the_release_template(
        release_server, release_model, tmp_path):
    """Qwen3-VL's release template wraps a video in <|vision_start|>...<|vision_end|>; its processor
    replaces the whole wrapper with one per temporal group (issue 44 item 7: EPD kept the outer pair)."""
    pytest.importorskip("av")
    from epd.encoders.video_io import decode_frames, read_video_meta

    if not reference_available():
        pytest.skip("scripts/env.sh dev installs the reference")
    clip = encode_video(synthetic_frames(5, 32, 48, seed=7), "mp4", fps=5)  # 2 groups: fits MAX_MODEL_LEN
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
                                             {"type": "text", "text": "What happens?"}]}]
    meta = read_video_meta(clip)
    clips = VideoClips([(decode_frames(clip, range(meta.num_frames)), meta)], {}, tmp_path / "ref")
    num_tokens = 6
    expected = hf_greedy(release_model, messages, [], num_tokens, videos=clips, chat_template=QWEN3_VL)
    ref_prompt = hf_inputs(release_model, messages, [], clips, QWEN3_VL)["input_ids"][0].tolist()
    out = client(release_server).chat.completions.create(
        model=release_model, messages=messages, max_tokens=num_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    body = out.model_dump()
    assert out.usage.prompt_tokens == len(ref_prompt)
    assert body["prompt_token_ids"] == ref_prompt
    assert body["choices"][0]["token_ids"] == expected


def test_omitted_sampling_fields_take_the_release_values(release_server, release_model):
    api = client(release_server)
    models = api.models.list().data
    assert models[0].model_extra["default_sampling_params"] == {**RELEASE, "max_tokens": MAX_NEW_TOKENS}
    assert "Default sampling parameters have been overridden" in release_server.log()

    def chat(seed: int, **fields) -> str:
        out = api.chat.completions.create(model=release_model, messages=TEXT, max_tokens=24, seed=seed,
                                          temperature=fields.pop("temperature", openai.NOT_GIVEN),
                                          top_p=fields.pop("top_p", openai.NOT_GIVEN), extra_body=fields)
        return out.choices[0].message.content

    def completion(seed: int, **fields) -> str:
        out = api.completions.create(model=release_model, prompt="Once upon a time", max_tokens=24, seed=seed,
                                     temperature=fields.pop("temperature", openai.NOT_GIVEN),
                                     top_p=fields.pop("top_p", openai.NOT_GIVEN), extra_body=fields)
        return out.choices[0].text

    for call in (chat, completion):
        omitted = [call(seed) for seed in SEEDS]
        assert omitted == [call(seed, **RELEASE) for seed in SEEDS], call.__name__
        assert omitted != [call(seed, **NEUTRAL_SAMPLING) for seed in SEEDS], call.__name__


def test_max_new_tokens_is_the_default_and_the_cap(release_server, release_model):
    api = client(release_server)

    def usage(messages, **fields):
        out = api.chat.completions.create(model=release_model, messages=messages, temperature=0, extra_body=fields)
        return out.usage.prompt_tokens, out.usage.completion_tokens

    assert usage(TEXT)[1] == MAX_NEW_TOKENS  # no max_tokens: the override's max_new_tokens
    assert usage(TEXT, max_tokens=MAX_NEW_TOKENS + 10)[1] == MAX_NEW_TOKENS  # an override caps (vLLM)
    assert usage(TEXT, max_tokens=3)[1] == 3
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(release_model)

    def prompt_tokens_of(messages) -> int:
        return len(tokenizer.apply_chat_template(messages, chat_template=processor_template(release_model),
                                                 add_generation_prompt=True, tokenize=True)["input_ids"])

    # a prompt that leaves room for a few tokens, fewer than MAX_NEW_TOKENS
    long = next(m for n in range(1, 40) if MAX_MODEL_LEN - MAX_NEW_TOKENS < prompt_tokens_of(
        m := [{"role": "user", "content": "a story " * n}]) < MAX_MODEL_LEN - 2)
    prompt_tokens, completion_tokens = usage(long)
    assert MAX_MODEL_LEN - prompt_tokens < MAX_NEW_TOKENS and completion_tokens == MAX_MODEL_LEN - prompt_tokens
    # asked explicitly: cut to the room too (vLLM 0.32's get_max_tokens); past the whole context: refused
    assert usage(long, max_tokens=MAX_NEW_TOKENS) == (prompt_tokens, MAX_MODEL_LEN - prompt_tokens)
    with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
        usage(long, max_tokens=MAX_MODEL_LEN + 1)


def test_text_only_checkpoint_with_chat_template_flag_serves_text_and_refuses_images(text_only_server, text_only_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_only_model)
    template = (Path(text_only_model).parent / "template.jinja").read_text()
    text = tokenizer.apply_chat_template(TEXT, chat_template=template, tokenize=False, add_generation_prompt=True)
    api = client(text_only_server)
    out = api.chat.completions.create(model=text_only_model, messages=TEXT, max_tokens=4, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))  # --chat-template's
    assert "chat template from --chat-template" in text_only_server.log()
    image = [{"role": "user", "content": [image_part(image_bytes(64, 48, seed=1)), {"type": "text", "text": "hi"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=text_only_model, messages=image, max_tokens=4)
    assert "preprocessor_config.json" in info.value.message
    assert "warning: this checkpoint has no preprocessor_config.json" in text_only_server.log()


def test_bad_checkpoints_and_limits_are_one_line_and_exit_2(release_model, text_only_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    picture = tmp_path / "picture.png"
    picture.write_bytes(image_bytes(64, 48, seed=2))
    keys = tmp_path / "keys"
    assert main(["keys", str(keys)]) == 0
    capsys.readouterr()
    limit = json.loads((Path(release_model) / "config.json").read_text())["text_config"]["max_position_embeddings"]
    cases = [
        (("serve", release_model, "--max-model-len", str(limit + 1)), [f"--max-model-len {limit + 1} ",
                                                                       f"limit of {limit} tokens"]),
        (("serve", str(broken)), ["config.json is not valid JSON"]),
        (("serve", str(tmp_path)), ["not a checkpoint directory (no config.json)"]),
        (("serve", release_model, "--generation-config", str(tmp_path)), ["no generation_config.json"]),
        (("serve", release_model, "--override-generation-config", "[1]"), ["takes a JSON object"]),
        (("serve", release_model, "--chat-template", "/no/such/template.jinja"), ["looks like a file path"]),
        (("chat", str(broken), "--prompt", "hi"), ["config.json is not valid JSON"]),
        (("worker", str(broken), "--role", "decode", "--api", "tcp://127.0.0.1:1", "--worker-keys", str(keys)),
         ["config.json is not valid JSON"]),
        (("chat", text_only_model, "--prompt", "hi", "--image", str(picture)), ["no preprocessor_config.json"]),
    ]
    for args, wanted in cases:  # in this process: an exception out of main() fails the test
        assert main(list(args)) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"epd {args[0]}: "), (args, err)
        assert all(w in err for w in wanted), (args, err)
    proc = run_epd("serve", text_only_model, "--max-model-len", str(limit + 1))  # as a user runs it
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("epd serve: --max-model-len") and proc.stderr.count("\n") == 1, proc.stderr

