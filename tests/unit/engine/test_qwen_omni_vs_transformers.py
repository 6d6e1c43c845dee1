"""Qwen2.5-Omni's thinker (the `qwen2.5-omni-tiny` preset, float32) gives transformers'
greedy tokens and top-5 logprobs offline for text, for two audio clips (`generate`, vLLM's
multi_modal_data) and for a clip beside an image (`chat`, OpenAI's input_audio part); its audio
tower gives transformers' embeddings on the same features; a clip's token count from its
samples alone is the processor's."""
from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch
from testkit.media import image_bytes, image_part

from epd import LLM, SamplingParams
from epd.families.qwen_omni.prompt_format import num_audio_tokens
from epd.tools.make_model import make_model

NUM_TOKENS = 4
AUDIO_PROMPT = "<|im_start|>user\n{audio}What is this sound?<|im_end|>\n<|im_start|>assistant\n"
CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(checkpoint, our LLM, transformers' thinker)."""
    from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

    model_dir = str(make_model(tmp_path_factory.mktemp("omni"), "qwen2.5-omni-tiny", seed=5))
    llm = LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    ref = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        model_dir, config=AutoConfig.from_pretrained(model_dir).thinker_config, dtype=torch.float32).eval()
    return model_dir, llm, ref


def _clip(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16000
    return (0.3 * np.sin(2 * np.pi * (220 + 200 * seed) * t) + 0.05 * rng.standard_normal(num_samples)) \
        .astype(np.float32)


def _features(model_dir: str, clips: list[np.ndarray]) -> dict:
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(model_dir)
    out = fe(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    return {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}


@torch.inference_mode()
def _hf_greedy(ref, ids: list[int], **inputs) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """transformers' thinker, one whole forward a step: greedy tokens and each step's top 5."""
    ids_t = torch.tensor([ids])
    tokens, tops = [], []
    for _ in range(NUM_TOKENS):
        logits = ref(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), **inputs).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), -1)
        top = logprobs.topk(5)
        tops.append(list(zip(top.indices.tolist(), top.values.tolist())))
        tokens.append(int(logits.argmax()))
        ids_t = torch.cat([ids_t, torch.tensor([[tokens[-1]]])], 1)
    return tokens, tops


def _assert_same(out, expected) -> None:
    tokens, tops = expected
    seq = out.outputs[0]
    assert seq.token_ids == tokens
    for ours, theirs in zip(seq.logprobs, tops):
        assert [t for t, _ in ours.top] == [t for t, _ in theirs]
        np.testing.assert_allclose([v for _, v in ours.top], [v for _, v in theirs], atol=1e-4)


PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


def test_text_matches_transformers(omni):
    _, llm, ref = omni
    out = llm.chat([{"role": "user", "content": "Describe the quick brown fox."}], PARAMS)[0]
    _assert_same(out, _hf_greedy(ref, out.prompt_token_ids))


def _wav(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def test_audio_matches_transformers(omni):
    """Two clips in one prompt, one as samples and one as a wav file's bytes; each spans several windows."""
    from transformers import AutoTokenizer

    model_dir, llm, ref = omni
    first, second = _clip(7130, seed=0), _clip(5000, seed=1)
    second = np.round(second * 32767) / 32767  # what its 16-bit wav holds
    prompt = AUDIO_PROMPT.format(audio=CLIP + " then " + CLIP)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [(first, 16000), _wav(second)]}},
                       PARAMS)[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    pads = iter("<|AUDIO|>" * num_audio_tokens(len(c)) for c in (first, second))
    ids = tok.encode("".join(p if p != "<|AUDIO|>" else next(pads) for p in prompt.replace(
        "<|AUDIO|>", "\0<|AUDIO|>\0").split("\0")), add_special_tokens=False)
    assert out.prompt_token_ids == ids
    _assert_same(out, _hf_greedy(ref, ids, **_features(model_dir, [first, second])))


def test_audio_tower_matches_transformers(omni):
    model_dir, llm, ref = omni
    clips = [_clip(7130, seed=2), _clip(3210, seed=3)]
    ours = llm.audio.audio.forward([llm.audio.audio.features(c, 16000) for c in clips])
    inputs = _features(model_dir, clips)
    with torch.inference_mode():
        theirs = ref.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"]).last_hidden_state
    assert [e.shape[0] for e in ours] == [num_audio_tokens(len(c)) for c in clips]
    torch.testing.assert_close(torch.cat(ours), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_samples", [1, 159, 160, 161, 16000, 7130, 480000, 480161, 700000])
def test_clip_token_count_is_the_processors(omni, num_samples):
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    model_dir, _, _ = omni
    mask = _features(model_dir, [np.zeros(num_samples, np.float32)])["feature_attention_mask"]
    assert num_audio_tokens(num_samples) == int(_get_feat_extract_output_lengths(mask.sum(-1))[0])


def test_bad_audio_is_refused_by_name(omni, tmp_path):
    _, llm, _ = omni
    video = tmp_path / "x.mp4"
    video.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="1 audio clips, 0 were given"):
        llm.generate({"prompt": AUDIO_PROMPT.format(audio=CLIP), "multi_modal_data": {"audio": []}}, PARAMS)
    with pytest.raises(ValueError, match="cannot be decoded|no audio stream"):
        llm.generate({"prompt": AUDIO_PROMPT.format(audio=CLIP), "multi_modal_data": {"audio": [b"not audio"]}},
                     PARAMS)
    from epd.requests import RequestError

    audio_part = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}
    with pytest.raises(RequestError, match="hold 1 audio parts; 0 clips"):  # no clip given: refused, never dropped
        llm.inputs.process_chat([{"role": "user", "content": [audio_part]}], [], [])
    with pytest.raises(ValueError, match="takes no video"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{video}"}}]}],
                 PARAMS)


def test_chat_with_audio_and_image_matches_transformers(omni):
    """OpenAI's input_audio part beside an image in one chat message: the image on its M-RoPE grid
    after the clip's text-like positions."""
    import base64

    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    model_dir, llm, ref = omni
    clip = np.round(_clip(6100, seed=4) * 32767) / 32767  # what its 16-bit wav holds
    image = image_bytes(120, 90, seed=4)
    audio_part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav(clip)).decode(), "format": "wav"}}
    messages = [{"role": "user", "content": [audio_part, image_part(image), {"type": "text", "text": "Both?"}]}]
    out = llm.chat(messages, PARAMS)[0]
    pixels = AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(io.BytesIO(image)).convert("RGB")],
                                                           return_tensors="pt")
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                                                 {"type": "text", "text": "Both?"}]}],
                                   tokenize=False, add_generation_prompt=True)
    text = text.replace("<|AUDIO|>", "<|AUDIO|>" * num_audio_tokens(len(clip)))
    ids = tok.encode(text.replace("<|IMAGE|>", "<|IMAGE|>" * (int(pixels["image_grid_thw"][0].prod()) // 4)),
                     add_special_tokens=False)
    assert out.prompt_token_ids == ids
    _assert_same(out, _hf_greedy(ref, ids, pixel_values=pixels["pixel_values"],
                                 image_grid_thw=pixels["image_grid_thw"], **_features(model_dir, [clip])))


def test_other_rates_are_resampled_to_16k(omni):
    """An 8 kHz tone becomes the same tone at 16 kHz (twice the samples), counted as 16 kHz audio."""
    from epd.transport.media.audio_samples import resample

    _, llm, _ = omni
    t = np.arange(8000) / 8000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    up = resample(tone, 8000, 16000)
    assert abs(len(up) - 16000) <= 32
    spectrum = np.abs(np.fft.rfft(up[:16000]))
    assert abs(int(spectrum.argmax()) - 440) <= 1  # 1 Hz bins over one second
    features = llm.audio.audio.features(tone, 8000)
    assert features.shape[1] == -(-len(up) // 160)


def test_a_missing_thinker_tensor_is_named_as_the_release_names_it(omni, tmp_path):
    """The talker is never read; a thinker tensor that is missing is named with its `thinker.` prefix."""
    import shutil

    from safetensors.torch import load_file, save_file

    from epd.engine.loader import load_language_model
    from epd.families.registry import load_hf_config
    from epd.transport.weights.checkpoint import CheckpointError

    model_dir, _, _ = omni
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(f"{model_dir}/{name}", tmp_path / name)
    tensors = load_file(f"{model_dir}/model.safetensors")
    tensors["talker.model.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)  # never read
    del tensors["thinker.model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"thinker\.model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_language_model(str(tmp_path), load_hf_config(tmp_path), torch.float32)


def test_a_repeated_clip_is_a_prefix_hit_and_another_is_not(omni):
    """An audio span is keyed by its clip's content: the same clip again reuses the KV past it,
    a different clip of the same length reuses only the text before it."""
    _, llm, _ = omni
    prompt = AUDIO_PROMPT.format(audio=CLIP)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def hits(clip) -> tuple[int, list[int]]:
        before = llm.stats()["prefix_cache_hits"]
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [(clip, 16000)]}}, params)[0]
        return llm.stats()["prefix_cache_hits"] - before, out

    first = _clip(9000, seed=5)
    _, out = hits(first)
    ids = out.prompt_token_ids
    before_clip = ids.index(llm.tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    again, repeat = hits(first)
    other, _ = hits(_clip(9000, seed=6))
    assert repeat.outputs[0].token_ids == out.outputs[0].token_ids
    assert again > before_clip + num_audio_tokens(9000) - 1  # the blocks past the clip too
    assert other <= before_clip  # the text before the clip, at most


def test_a_clip_in_several_prompts_of_a_call_is_encoded_once(omni):
    _, llm, _ = omni
    side = llm.audio.audio
    passes = []
    original = side.forward
    side.forward = lambda features: passes.append(len(features)) or original(features)
    try:
        prompt = {"prompt": AUDIO_PROMPT.format(audio=CLIP), "multi_modal_data": {"audio": [(_clip(4000, seed=7), 16000)]}}
        outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    finally:
        del side.forward  # the class's again
    assert passes == [1]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
