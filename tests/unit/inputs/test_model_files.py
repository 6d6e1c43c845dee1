"""What is read from a checkpoint besides its weights (epd/inputs/model_files.py,
sampling_defaults.py), on checkpoints in the releases' layout, and the offline
`LLM` serving them: the processor's chat template, the generation config's
sampling defaults, text-only checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from testkit.media import image_bytes
from testkit.release_layout import (NEUTRAL_SAMPLING, PROCESSOR_TEMPLATE_MARK, QWEN2_5_VL_SAMPLING, QWEN3_VL_SAMPLING,
                            processor_template, release_checkpoint)

from epd.api.protocol import ChatCompletionRequest, CompletionRequest
from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.image_io import ImageError
from epd.engine.config import EngineConfig
from epd.inputs.model_files import CheckpointError, ModelFiles, ModelFilesConfig, load_chat_template
from epd.inputs.prompt import NO_CHAT_TEMPLATE
from epd.inputs.sampling_defaults import SamplingDefaults
from epd.transport.wire.sampling import SamplingParams

TEXT = [{"role": "user", "content": "Tell me a story about a cat"}]
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def qwen3_release(tiny_model, tmp_path_factory) -> str:
    return release_checkpoint(tiny_model, tmp_path_factory.mktemp("q3") / "ckpt", QWEN3_VL_SAMPLING)


@pytest.fixture(scope="module")
def both_templates(tiny_model, tmp_path_factory) -> str:
    return release_checkpoint(tiny_model, tmp_path_factory.mktemp("both") / "ckpt", tokenizer_template=True)


@pytest.fixture(scope="module")
def qwen2_5_llm(tiny_model, tmp_path_factory):
    from epd import LLM

    return LLM(release_checkpoint(tiny_model, tmp_path_factory.mktemp("q25") / "ckpt", QWEN2_5_VL_SAMPLING),
               **ENGINE)


def rendered_ids(files: ModelFiles, template: str) -> list[int]:
    text = files.tokenizer.apply_chat_template(TEXT, chat_template=template, tokenize=False,
                                               add_generation_prompt=True)
    return files.tokenizer.encode(text, add_special_tokens=False)


# -- chat templates ------------------------------------------------------------------------------

def test_one_checkpoint_error_for_the_file_checks_and_the_weight_loading(tmp_path):
    # the API's checks of a checkpoint's files and the workers' loading of its weights raise one
    # class: an `except CheckpointError` from either module catches what the other raises
    from epd.transport.weights.checkpoint import CheckpointError as WeightsError, checkpoint_files

    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        checkpoint_files(tmp_path)
    with pytest.raises(WeightsError, match="not a checkpoint directory"):
        ModelFiles.open(tmp_path)


def test_the_processor_template_is_found_when_the_tokenizer_has_none(qwen3_release):
    files = ModelFiles.open(qwen3_release)
    assert not files.tokenizer.chat_template  # the release layout: nothing in tokenizer_config.json
    assert files.chat_template.text == processor_template(qwen3_release)
    assert files.chat_template.source.endswith("chat_template.json") and files.no_chat_reason is None


def test_the_processor_template_wins_over_the_tokenizer_one(both_templates):
    from epd import LLM

    files = ModelFiles.open(both_templates)
    assert files.tokenizer.chat_template and files.tokenizer.chat_template != files.chat_template.text
    llm = LLM(both_templates, **ENGINE)
    prompt = llm.chat(TEXT, SamplingParams(max_tokens=1, temperature=0))[0].prompt_token_ids
    assert prompt == rendered_ids(files, processor_template(both_templates))
    assert prompt != rendered_ids(files, files.tokenizer.chat_template)
    assert PROCESSOR_TEMPLATE_MARK in llm.tokenizer.decode(prompt)


def test_the_processor_template_sources_in_transformers_order(both_templates, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for path in Path(both_templates).iterdir():
        (model / path.name).symlink_to(path.resolve())
    (model / "chat_template.jinja").write_text("{{ 'from the jinja file' }}")
    assert ModelFiles.open(model).chat_template.text == processor_template(both_templates)
    (model / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert ModelFiles.open(model).chat_template.text == processor_template(both_templates)  # no key: the files
    (model / "processor_config.json").write_text(json.dumps({"chat_template": "{{ 'from the key' }}"}))
    assert ModelFiles.open(model).chat_template.text == "{{ 'from the key' }}"  # transformers: the key first
    (model / "processor_config.json").unlink()
    (model / "chat_template.json").unlink()
    assert ModelFiles.open(model).chat_template.text == "{{ 'from the jinja file' }}"


def test_chat_template_flag_takes_a_file_or_the_text(qwen3_release, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ 'a' }}\\n") == "{{ 'a' }}\n"  # escapes decoded, as vLLM does
    with pytest.raises(CheckpointError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    files = ModelFiles.open(qwen3_release, ModelFilesConfig(chat_template=str(path)))
    assert files.chat_template.source == "--chat-template"
    assert rendered_ids(files, files.chat_template.text) == files.tokenizer.encode("Tell me a story about a cat")


def test_no_chat_template_refuses_chat_and_serves_completions(qwen3_release, tmp_path):
    from epd import LLM

    model = tmp_path / "m"
    model.mkdir()
    for path in Path(qwen3_release).iterdir():
        if path.name != "chat_template.json":
            (model / path.name).symlink_to(path.resolve())
    files = ModelFiles.open(model)
    assert files.chat_template is None and f"warning: {NO_CHAT_TEMPLATE}" in files.notes()
    llm = LLM(str(model), **ENGINE)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(TEXT)
    assert llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids


# -- sampling defaults ---------------------------------------------------------------------------

def test_generation_config_modes_as_vllm(qwen3_release, tmp_path):
    auto = SamplingDefaults.load(qwen3_release)
    assert auto.overridden() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert "--generation-config vllm" in auto.describe()
    assert SamplingDefaults.load(qwen3_release, "vllm") == SamplingDefaults()
    assert SamplingDefaults.load(qwen3_release, "vllm", {"temperature": 0.5}).overridden() == {"temperature": 0.5}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 7}))
    from_dir = SamplingDefaults.load(qwen3_release, str(other))
    assert from_dir.overridden() == {"top_p": 0.5, "max_tokens": 7} and from_dir.max_tokens_cap == 7
    assert from_dir.max_tokens_for(None) == 7 and from_dir.max_tokens_for(100) == 7  # a DIR's caps (vLLM)
    with_new = SamplingDefaults.load(qwen3_release, "auto", {"max_new_tokens": 5, "top_k": 3})
    assert with_new.overridden() == {"temperature": 0.7, "top_p": 0.8, "top_k": 3, "max_tokens": 5}
    assert with_new.max_tokens_for(2) == 2 and with_new.max_tokens_for(9) == 5
    with pytest.raises(ValueError, match="no generation_config.json"):
        SamplingDefaults.load(qwen3_release, str(tmp_path))
    with pytest.raises(ValueError, match="temperature"):
        SamplingDefaults.load(qwen3_release, "auto", {"temperature": -1})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingDefaults.load(qwen3_release, "auto", {"top_k": "x"})
    with pytest.raises(ValueError, match="auto, vllm or a directory"):
        ModelFilesConfig(generation_config=str(tmp_path / "nowhere"))


def test_api_requests_take_the_defaults_for_fields_they_leave_out():
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=9)
    body = {"model": "m", "messages": TEXT}
    omitted = ChatCompletionRequest(**body).to_generate_request("r", defaults=defaults).sampling
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty, omitted.max_tokens) \
        == (0.7, 0.8, 20, 1.05, None)  # max_tokens: the preparer's, once the prompt's length is known
    spelled = ChatCompletionRequest(**body, **NEUTRAL_SAMPLING, max_tokens=3).to_generate_request(
        "r", defaults=defaults).sampling
    assert (spelled.temperature, spelled.top_p, spelled.top_k, spelled.repetition_penalty, spelled.max_tokens) \
        == (1.0, 1.0, -1, 1.0, 3)
    completion = CompletionRequest(model="m", prompt="hi").to_generate_request("r", defaults=defaults).sampling
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0.7, 20, 16)  # 16: the field's
    neutral = ChatCompletionRequest(**body).to_generate_request("r").sampling
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.max_tokens) == (1.0, 1.0, -1, None)


def test_offline_llm_samples_with_the_release_defaults(qwen2_5_llm):
    defaults = qwen2_5_llm.get_default_sampling_params()
    release = {k: v for k, v in QWEN2_5_VL_SAMPLING.items() if k != "do_sample"}
    assert defaults == SamplingParams(**release)
    # near-greedy (top_k 1): a call with no params is reproducible, and is the spelled-out request's text
    omitted = qwen2_5_llm.generate("Once upon a time", None)[0].outputs[0].text
    assert omitted == qwen2_5_llm.generate("Once upon a time", SamplingParams(**release, seed=3))[0].outputs[0].text
    neutral = [qwen2_5_llm.generate("Once upon a time", SamplingParams(**NEUTRAL_SAMPLING, seed=seed))[0]
               .outputs[0].text for seed in range(8)]
    assert any(text != omitted for text in neutral)


def test_offline_llm_with_generation_config_vllm(qwen3_release):
    from epd import LLM

    llm = LLM(qwen3_release, generation_config="vllm", **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert LLM(qwen3_release, override_generation_config={"top_k": 5}, **ENGINE) \
        .get_default_sampling_params() == SamplingParams(temperature=0.7, top_p=0.8, top_k=5)


# -- checkpoints that cannot be served, or serve less ----------------------------------------------

def test_max_model_len_beyond_the_model_is_refused():
    assert EngineConfig.from_flat(max_model_len=100).resolved_max_model_len(128) == 100
    assert EngineConfig().resolved_max_model_len(128) == 128
    with pytest.raises(ValueError, match=r"--max-model-len 4096 .* limit of 128 tokens"):
        EngineConfig.from_flat(max_model_len=4096).resolved_max_model_len(128)


def test_text_only_checkpoint_offline(tiny_model, tmp_path):
    from epd import LLM

    model = release_checkpoint(tiny_model, tmp_path / "ckpt", image_processor=False)
    files = ModelFiles.open(model)
    assert files.geometry is None and "preprocessor_config.json" in files.no_images_reason
    llm = LLM(model, **ENGINE)
    assert llm.encoder is None
    text = llm.chat(TEXT, SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text
    assert text
    # what an encoder worker (or the aggregated worker's encoder) of this checkpoint holds: nothing, refusing
    encoder = ImageEncoder(model, files.hf_config, torch.float32)
    assert encoder.vision is None and encoder.tower is None
    with pytest.raises(ImageError, match="preprocessor_config.json"):
        encoder.encode([image_bytes(32, 32, seed=1)])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        llm.chat([{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}])


@pytest.mark.parametrize("breakage, message", [
    ("no config", "not a checkpoint directory (no config.json)"),
    ("broken config", "config.json is not valid JSON"),
    ("no weights", "no *.safetensors"),
    ("broken generation config", "generation_config.json cannot be read as JSON"),
    ("no tokenizer", "the tokenizer cannot be loaded"),
])
def test_a_bad_checkpoint_is_one_checkpoint_error(tiny_model, tmp_path, breakage, message):
    model = Path(release_checkpoint(tiny_model, tmp_path / "ckpt"))
    if breakage == "no config":
        (model / "config.json").unlink()
    elif breakage == "broken config":
        (model / "config.json").write_text("{not json")
    elif breakage == "no weights":
        (model / "model.safetensors").unlink()
    elif breakage == "broken generation config":
        (model / "generation_config.json").write_text("[1,")
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).unlink()
    with pytest.raises(CheckpointError) as info:
        ModelFiles.open(model)
    assert message in str(info.value) and "\n" not in str(info.value)



def test_mm_processor_kwargs_reach_the_api_geometry_and_the_encoder(tiny_model):
    """--mm-processor-kwargs: the API counts the placeholders the encoder then produces, and both
    hash the image with the settings it was encoded with (another max_pixels, another mm_hash)."""
    from epd.transport.embedding_cache.mm_cache import mm_hash

    kwargs = {"max_pixels": 128 * 128}
    plain = ModelFiles.open(tiny_model)
    files = ModelFiles.open(tiny_model, ModelFilesConfig(mm_processor_kwargs=tuple(kwargs.items())))
    assert files.geometry.max_pixels == 128 * 128
    assert files.geometry.num_image_tokens(500, 400) < plain.geometry.num_image_tokens(500, 400)
    encoder = ImageEncoder(tiny_model, files.hf_config, torch.float32, processor_kwargs=kwargs)
    img = image_bytes(500, 400, seed=1)
    assert encoder.encode([img])[0].meta["grid_thw"] == files.geometry.grid_thw(500, 400)
    assert encoder.mm_hash(img) == mm_hash(img, "", files.processor_config) != mm_hash(img, "", plain.processor_config)


def test_tokenizer_flag_takes_another_directory(tiny_model, tmp_path):
    import shutil

    other = tmp_path / "tok"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model) / name, other / name)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}OTHER {{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    files = ModelFiles.open(tiny_model, ModelFilesConfig(tokenizer=str(other)))
    assert files.chat_template.text.startswith("{% for m in messages %}OTHER")
    assert files.chat_template.source == str(other / "tokenizer_config.json")
    assert ModelFiles.open(tiny_model).chat_template.text != files.chat_template.text


def test_tokenizer_flag_serves_a_checkpoint_without_one(tiny_model, tmp_path):
    """--tokenizer reaches the engine's grammar compiler too: structured outputs work on a
    checkpoint whose own directory holds no tokenizer."""
    from epd import LLM
    from epd.transport.wire.sampling import StructuredOutputsParams

    ckpt, tok = tmp_path / "ckpt", tmp_path / "tok"
    ckpt.mkdir()
    tok.mkdir()
    for path in Path(tiny_model).iterdir():
        ((tok if path.name.startswith("tokenizer") else ckpt) / path.name).symlink_to(path)
    with pytest.raises(CheckpointError, match="the tokenizer cannot be loaded"):
        ModelFiles.open(ckpt)
    llm = LLM(str(ckpt), tokenizer=str(tok), **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate(["Is it?"], params)[0].outputs[0].text in ("yes", "no")
