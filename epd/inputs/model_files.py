"""What the API process and the offline `LLM` read from a checkpoint besides the
weights, opened once at start-up: `ModelFiles.open(model_dir, ModelFilesConfig)`.

    config.json              must exist and parse; its family must be one we serve
    *.safetensors            at least one (the workers load them)
    tokenizer                transformers' AutoTokenizer
    chat template            --chat-template, else the processor's, else the tokenizer's:
                               processor_config.json's "chat_template", chat_template.json, then
                               chat_template.jinja (transformers' ProcessorMixin reads the legacy
                               .json first when both exist), then the tokenizer's own
    generation_config.json   the sampling defaults (epd/inputs/sampling_defaults.py)
    preprocessor_config.json optional: without it the checkpoint serves text only
    video_preprocessor_config.json  optional: a video's sampling and size rules (else
                             preprocessor_config.json's, as transformers reads them; neither: no video),
                             read by the family's `PromptFormat.video_geometry` (None: the family
                             takes no video)

A checkpoint that cannot be served raises `CheckpointError` (a ValueError: the
CLI prints its one line and exits 2); one that serves less (no chat template,
no image processor) opens, and `notes()` says what is missing.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epd.transport.media.image_geometry import NO_IMAGE_PROCESSOR, PROCESSOR_CONFIG
from epd.transport.media.prompt_format import ItemGeometry, PromptFormat, VideoRules
from epd.transport.media.video_geometry import IMAGE_CONFIG, REQUEST_KEYS, VIDEO_CONFIG, VideoOptions
from epd.families.registry import FAMILIES, check_family, family_of, served_config
from epd.inputs.prompt import NO_CHAT_TEMPLATE
from epd.inputs.sampling_defaults import GENERATION_CONFIG_MODES, SamplingDefaults, read_json_object
from epd.transport.weights.checkpoint_error import CheckpointError
from epd.transport.weights.quant.quant_config import read_quant_config

# transformers' processor order: a "chat_template" key in processor_config.json, then the files
PROCESSOR_TEMPLATE_FILES = ("processor_config.json", "chat_template.json", "chat_template.jinja")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # a fast tokenizer's, or a BPE vocabulary's
JINJA_CHARS = "{}\n"  # vLLM: a --chat-template holding none of these is a path
NO_VIDEO_PROCESSOR = f"this checkpoint has no {VIDEO_CONFIG} (nor {IMAGE_CONFIG}): it serves no video"
# every video's defaults (a server-wide pixel bound is the image processor's, where it takes one)
VIDEO_KWARGS = tuple(k for k in REQUEST_KEYS if k not in ("min_pixels", "max_pixels"))


def split_processor_kwargs(kwargs: dict, image_keys: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """--mm-processor-kwargs -> (the image processor's settings, the keys of `image_keys`: the
    family's `PromptFormat.image_kwargs`, whose geometry checks their values; every video's
    defaults: fps, num_frames, do_sample_frames, min_frames, max_frames, which a request's own
    mm_processor_kwargs override). ValueError for a key neither takes or a bad value.
    `image_keys` None (the flags read before the checkpoint): the image settings must be some
    family's, keys and values (`_check_image_kwargs`); the checkpoint's family checks them again."""
    rest = sorted(set(kwargs) - set(VIDEO_KWARGS))
    image = {k: kwargs[k] for k in rest}
    if image_keys is None:
        _check_image_kwargs(image)
    unknown = [] if image_keys is None else [k for k in rest if k not in image_keys]
    if unknown:
        raise ValueError(f"--mm-processor-kwargs: {', '.join(unknown)} cannot be applied here; the image "
                         f"processor takes {', '.join(image_keys) or 'none'}, the video processor "
                         f"{', '.join(VIDEO_KWARGS)}")
    video = {k: v for k, v in kwargs.items() if k in VIDEO_KWARGS}
    try:
        VideoOptions.from_kwargs(video)
    except ValueError as exc:
        raise ValueError(f"--mm-processor-kwargs: {exc}") from None
    return image, video


def _check_image_kwargs(image: dict) -> None:
    """ValueError unless some family's image processor takes these settings (keys and values)."""
    if not image:
        return
    formats = list(dict.fromkeys(f.prompt_format for f in FAMILIES.values()))
    takers = [fmt for fmt in formats if set(image) <= set(fmt.image_kwargs)]
    if not takers:
        keys = list(dict.fromkeys(k for fmt in formats for k in fmt.image_kwargs))
        unknown = [k for k in image if k not in keys] or sorted(image)
        raise ValueError(f"--mm-processor-kwargs: {', '.join(unknown)} cannot be applied here; the image "
                         f"processor takes {', '.join(keys)} (by family), the video processor "
                         f"{', '.join(VIDEO_KWARGS)}")
    errors = []
    for fmt in takers:
        try:
            fmt.check_image_kwargs(image)
            return
        except ValueError as exc:
            errors.append(exc)
    raise errors[0]


@dataclass(frozen=True)
class ModelFilesConfig:
    """The flags that choose what is read from the checkpoint (vLLM's names)."""

    chat_template: str | None = None  # --chat-template: a file, or the template itself
    generation_config: str = "auto"  # --generation-config auto | vllm | DIR
    # --override-generation-config, as sorted (key, value) pairs: no dict inside the frozen config
    override_generation_config: tuple[tuple[str, Any], ...] = ()
    tokenizer: str | None = None  # --tokenizer: a directory to take the tokenizer from (None: the checkpoint)
    # --mm-processor-kwargs, as sorted pairs: the image processor's settings over preprocessor_config.json's
    mm_processor_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.generation_config not in GENERATION_CONFIG_MODES and not Path(self.generation_config).is_dir():
            raise ValueError(f"--generation-config takes auto, vllm or a directory, got {self.generation_config!r}")
        object.__setattr__(self, "override_generation_config",
                           tuple(sorted(dict(self.override_generation_config).items())))
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"--tokenizer takes a directory holding a tokenizer, got {self.tokenizer!r}")
        kwargs = dict(self.mm_processor_kwargs)
        split_processor_kwargs(kwargs)
        object.__setattr__(self, "mm_processor_kwargs", tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # the file it came from, or "--chat-template"


@dataclass(frozen=True)
class ModelFiles:
    model_dir: str
    hf_config: Any  # transformers' config
    tokenizer: Any  # transformers' tokenizer
    chat_template: ChatTemplate | None  # None: chat requests are refused, completions served
    sampling_defaults: SamplingDefaults
    processor_config: dict | None  # preprocessor_config.json; None: text only
    geometry: ItemGeometry | None = field(default=None)  # the family's image geometry; None: text only
    video_geometry: VideoRules | None = field(default=None)  # the family's video plan rules; None: no video
    video_processor_config: dict | None = field(default=None)  # the file the video rules came from: in mm_hash
    no_video: str = NO_VIDEO_PROCESSOR  # why videos are refused, when `video_geometry` is None

    @classmethod
    def open(cls, model_dir: str | Path, config: ModelFilesConfig | None = None) -> ModelFiles:
        """Reads and checks everything but the weights' tensors; CheckpointError otherwise."""
        config = config or ModelFilesConfig()
        directory = Path(model_dir)
        hf_config = _hf_config(directory)
        if not any(directory.glob("*.safetensors")):
            raise CheckpointError(f"{directory} holds no *.safetensors weights")
        # --tokenizer: the tokenizer and the chat template's files from there (vLLM's processor is loaded from it)
        tokenizer_dir = Path(config.tokenizer) if config.tokenizer else directory
        tokenizer = _tokenizer(tokenizer_dir)
        try:
            defaults = SamplingDefaults.load(directory, config.generation_config,
                                             dict(config.override_generation_config))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        processor_config = geometry = None
        if (directory / PROCESSOR_CONFIG).is_file():
            try:
                processor_config = read_json_object(directory / PROCESSOR_CONFIG)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            prompt_format = family_of(hf_config).prompt_format
            try:
                kwargs, _ = split_processor_kwargs(dict(config.mm_processor_kwargs), prompt_format.image_kwargs)
                geometry = prompt_format.image_geometry(directory, kwargs)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            processor_config = {**processor_config, **kwargs}  # what the encoder runs with: part of mm_hash
        family = family_of(hf_config)
        video_geometry, video_config = _video_rules(directory, family.prompt_format)
        no_video = NO_VIDEO_PROCESSOR if family.prompt_format.video_geometry else f"{family.name} takes no video input"
        return cls(model_dir=str(directory), hf_config=hf_config, tokenizer=tokenizer,
                   chat_template=resolve_chat_template(tokenizer_dir, tokenizer, config.chat_template),
                   sampling_defaults=defaults, processor_config=processor_config, geometry=geometry,
                   video_geometry=video_geometry, video_processor_config=video_config, no_video=no_video)

    @property
    def max_position_embeddings(self) -> int:
        """The longest sequence the model takes (config.json's text_config)."""
        return int(self.hf_config.text_config.max_position_embeddings)

    @property
    def no_images_reason(self) -> str | None:
        """Why image inputs are refused (None: they are served)."""
        return None if self.geometry is not None else NO_IMAGE_PROCESSOR

    @property
    def no_video_reason(self) -> str | None:
        """Why video inputs are refused (None: they are served)."""
        return None if self.video_geometry is not None else self.no_video

    @property
    def no_chat_reason(self) -> str | None:
        """Why chat requests are refused (None: they are served)."""
        return None if self.chat_template is not None else NO_CHAT_TEMPLATE

    def notes(self) -> list[str]:
        """What the start-up log says about these files: warnings first, then the sampling defaults."""
        out = [f"warning: {reason}" for reason in (self.no_chat_reason, self.no_images_reason) if reason]
        if self.chat_template is not None:
            out.append(f"chat template from {self.chat_template.source}")
        out.append(self.sampling_defaults.describe())
        return out


def _video_rules(directory: Path, prompt_format: PromptFormat) -> tuple[VideoRules | None, dict | None]:
    """The checkpoint's video processor rules, as its family reads them, and the config they
    came from (None, None: no video: the family takes none, or neither file is there)."""
    if prompt_format.video_geometry is None:
        return None, None
    for name in (VIDEO_CONFIG, IMAGE_CONFIG):
        if (directory / name).is_file():
            try:
                config = read_json_object(directory / name)
                return prompt_format.video_geometry(directory), config
            except (ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(f"{directory / name}: not a video processor config we can read ({exc})") \
                    from None
    return None, None


def resolve_chat_template(model_dir: Path, tokenizer, chat_template: str | None) -> ChatTemplate | None:
    """`chat_template` (--chat-template) if given, else the processor's, else the tokenizer's;
    CheckpointError for a template Jinja cannot parse (found at start-up, not at each request)."""
    import jinja2

    found = _find_chat_template(model_dir, tokenizer, chat_template)
    if found is not None:
        try:
            jinja2.Environment().parse(found.text)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(f"the chat template from {found.source} is not valid Jinja "
                                  f"(line {exc.lineno}: {exc.message})") from None
    return found


def _find_chat_template(model_dir: Path, tokenizer, chat_template: str | None) -> ChatTemplate | None:
    if chat_template is not None:
        return ChatTemplate(load_chat_template(chat_template), "--chat-template")
    for name in PROCESSOR_TEMPLATE_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        if name.endswith(".json"):
            try:
                text = read_json_object(path).get("chat_template")
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            if text is None and name == "processor_config.json":  # the processor's settings, no template
                continue
            if not isinstance(text, str):
                raise CheckpointError(f"{path} holds no \"chat_template\" string")
        else:
            text = path.read_text(encoding="utf-8")
        return ChatTemplate(text, str(path))
    text = getattr(tokenizer, "chat_template", None)
    if isinstance(text, dict):  # named templates: the default one
        text = text.get("default")
    return ChatTemplate(text, f"{model_dir / 'tokenizer_config.json'}") if isinstance(text, str) else None


def load_chat_template(value: str) -> str:
    """vLLM's reading of --chat-template: the file's text if `value` names one; else,
    if it looks like a template (has any of `{`, `}`, a newline), the text itself with
    backslash escapes decoded; else a ValueError (a path that cannot be opened)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in value for c in JINJA_CHARS):
            raise CheckpointError(f"--chat-template {value!r} looks like a file path, but it cannot be "
                                  f"read: {getattr(exc, 'strerror', None) or exc}") from None
    return codecs.decode(value, "unicode_escape")


def _hf_config(directory: Path):
    """transformers' config of `directory`, after our own checks of config.json."""
    from transformers import AutoConfig

    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint directory (no config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if isinstance(raw, dict):
        read_quant_config(raw)  # a quantization EPD does not serve is refused here, by name
    check_family(directory)  # UnsupportedModelError (a ValueError) names the families we serve
    try:
        return served_config(AutoConfig.from_pretrained(str(directory)))
    except Exception as exc:  # transformers raises what it likes for a config it cannot build
        raise CheckpointError(f"{path}: transformers cannot read it ({type(exc).__name__}: {exc})") from None


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone
        raise CheckpointError(f"{directory}: the tokenizer cannot be loaded (no {' or '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # missing or broken tokenizer files: OSError, ValueError, ...
        raise CheckpointError(f"{directory}: the tokenizer cannot be loaded "
                              f"({type(exc).__name__}: {exc})") from None
