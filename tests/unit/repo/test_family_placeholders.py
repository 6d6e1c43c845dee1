"""A family's placeholders belong to its prompt format: the generic prompt and
serving code (epd/inputs, epd/serve) names none of the Qwen-VL families' or
Gemma 3's or InternVL's placeholder strings; they are written once, in each family's prompt_format.py,
and reach the generic code through `ModelFamily.prompt_format`
(epd/families/registry.py). Comments and docstrings count: a reader who finds
`<|image_pad|>` in generic code takes it for the engine's assumption."""
from __future__ import annotations

from pathlib import Path

from epd.families.internvl.prompt_format import IMG_END, IMG_START, INTERNVL_FORMAT
from epd.families.gemma3.prompt_format import EOI_TOKEN, GEMMA3_FORMAT
from epd.families.registry import FAMILIES
from epd.families.glm4v.prompt_format import BEGIN_IMAGE, END_IMAGE, GLM4V_FORMAT
from epd.families.qwen_vl.prompt_format import QWEN_VL_FORMAT, VISION_END, VISION_START

ROOT = Path(__file__).resolve().parents[3]
GENERIC_DIRS = ("epd/inputs", "epd/serve")
QWEN_STRINGS = (QWEN_VL_FORMAT.image_placeholder, *QWEN_VL_FORMAT.video_placeholders, QWEN_VL_FORMAT.image_token,
                QWEN_VL_FORMAT.video_token, VISION_START, VISION_END)
GEMMA3_STRINGS = (GEMMA3_FORMAT.image_placeholder, GEMMA3_FORMAT.image_token, EOI_TOKEN)
INTERNVL_STRINGS = (INTERNVL_FORMAT.image_placeholder, *INTERNVL_FORMAT.video_placeholders, IMG_START, IMG_END)
GLM4V_STRINGS = (GLM4V_FORMAT.image_placeholder, *GLM4V_FORMAT.video_placeholders, BEGIN_IMAGE, END_IMAGE)


def _named(text: str) -> list[str]:
    return sorted({s for s in QWEN_STRINGS + GEMMA3_STRINGS + INTERNVL_STRINGS if s in text})


def test_the_strings_are_qwens_placeholders():
    assert {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"} <= set(QWEN_STRINGS)
    assert _named("a <|vision_start|><|image_pad|><|vision_end|> b") == \
        ["<|image_pad|>", "<|vision_end|>", "<|vision_start|>"]
    assert _named("<img><IMG_CONTEXT></img>") == ["</img>", "<IMG_CONTEXT>", "<img>"]


def test_generic_prompt_and_serving_code_names_no_qwen_placeholder():
    files = [p for d in GENERIC_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10  # the walk found the code
    named = {str(p.relative_to(ROOT)): found for p in files if (found := _named(p.read_text()))}
    assert named == {}


def test_the_gemma3_strings_are_its_placeholders():
    assert set(GEMMA3_STRINGS) == {"<start_of_image>", "<image_soft_token>", "<end_of_image>"}
    assert FAMILIES["gemma3"].prompt_format is GEMMA3_FORMAT


def test_the_qwen_families_register_the_qwen_format():
    assert {name for name, family in FAMILIES.items() if family.prompt_format is QWEN_VL_FORMAT} == \
        {"qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"}  # Qwen3.5 ships Qwen3VLProcessor


def test_internvl_registers_its_format():
    assert {name for name, family in FAMILIES.items() if family.prompt_format is INTERNVL_FORMAT} == {"internvl"}


def test_generic_prompt_and_serving_code_names_no_glm4v_placeholder():
    assert set(GLM4V_STRINGS) == {"<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>"}
    files = [p for d in GENERIC_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    named = {str(p.relative_to(ROOT)): found for p in files
             if (found := sorted({s for s in GLM4V_STRINGS if s in p.read_text()}))}
    assert named == {}


def test_generic_code_names_no_qwen_omni_placeholder():
    """Qwen2.5-Omni's image and audio strings: the prompt builder reaches them through its format's
    `audio_placeholder`, `audio_token` and `expand_audio`, the encoders through `ModelFamily.audio`."""
    from epd.families.qwen_omni.prompt_format import AUDIO_BOS, AUDIO_EOS, QWEN_OMNI_FORMAT, VISION_BOS, VISION_EOS

    strings = {QWEN_OMNI_FORMAT.image_placeholder, QWEN_OMNI_FORMAT.audio_placeholder, *QWEN_OMNI_FORMAT.placeholders,
               AUDIO_BOS, AUDIO_EOS, VISION_BOS, VISION_EOS}
    assert {"<|IMAGE|>", "<|AUDIO|>", "<|audio_bos|>", "<|vision_bos|>"} <= strings
    assert {name for name, family in FAMILIES.items() if family.prompt_format is QWEN_OMNI_FORMAT} == \
        {"qwen2_5_omni", "qwen2_5_omni_thinker"}
    files = [p for d in (*GENERIC_DIRS, "encoders") for p in sorted((ROOT / d).rglob("*.py"))]
    named = {str(p.relative_to(ROOT)): found for p in files
             if (found := sorted({s for s in strings if s in p.read_text()}))}
    assert named == {}
