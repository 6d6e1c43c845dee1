"""`epd make-model` (a random-weight checkpoint) and `epd chat` (one user turn, offline)."""
from __future__ import annotations

import sys
from pathlib import Path

from epd.config import field_default
from epd.engine.config import EngineConfig


def add_model_parsers(sub) -> None:
    from epd.tools.make_eagle3 import EAGLE3_PRESETS
    from epd.tools.make_model import QUANTIZE_SCHEMES, all_presets

    p = sub.add_parser("make-model", help="write a random-weight checkpoint of a family EPD serves (its "
                                          "presets) or an EAGLE-3 draft head (the *-eagle3 presets)")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=list(all_presets()) + list(EAGLE3_PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", default=None, choices=QUANTIZE_SCHEMES,
                   help="write the language model's linears in a release format: fp8-block (Qwen's FP8), "
                        "fp8-dynamic, w8a8, w4a16 (RedHat's compressed-tensors), awq (GEMM), gptq")
    p.add_argument("--draft-of", default=None, metavar="TARGET",
                   help="instead of a preset: a draft model for --speculative-config's draft_model, the TARGET "
                        "checkpoint cut to its first --num-layers decoder layers (same tokenizer)")
    p.add_argument("--num-layers", type=int, default=1, help="--draft-of: decoder layers kept")
    p.add_argument("--disagree", action="store_true",
                   help="--draft-of: roll the draft's output head by one id, so the target rejects its drafts")
    p.add_argument("--mtp-agree", action="store_true",
                   help="a dense qwen3.5 preset made a bigram target (every layer's output projection zeroed, "
                        "each layer still computed) whose MTP layers predict its tokens: MTP acceptance benchmarks")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("chat", help="one user turn (images, videos, then the text); prints the completion")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    p.add_argument("--video", action="append", default=[],
                   help="video file (repeatable; PyAV: pip install 'epd[video]')")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default=field_default(EngineConfig, "dtype"))
    p.add_argument("--device", default=field_default(EngineConfig, "device"))
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="the chat template: a file, or the template itself (default: the checkpoint's)")
    p.set_defaults(func=_chat)



def _make_model(args) -> int:
    from epd.tools.make_eagle3 import EAGLE3_PRESETS, make_eagle3
    from epd.tools.make_model import make_model

    if args.draft_of is not None:
        from epd.tools.make_draft import make_draft

        try:
            out = make_draft(args.draft_of, args.dir, args.num_layers, disagree=args.disagree)
        except (ValueError, FileNotFoundError) as exc:
            print(f"epd make-model: {exc}", file=sys.stderr)
            return 2
        print(f"wrote a {args.num_layers}-layer draft of {args.draft_of} to {out}")
        return 0
    if args.preset in EAGLE3_PRESETS:
        out = make_eagle3(args.dir, preset=args.preset, seed=args.seed)
    else:
        if args.mtp_agree and (not args.preset.startswith("qwen3.5-") or "-moe-" in args.preset):
            print(f"epd make-model: --mtp-agree takes a dense qwen3.5 preset, not {args.preset!r}", file=sys.stderr)
            return 2
        if args.mtp_agree and args.quantize:
            print("epd make-model: --mtp-agree writes a float checkpoint; leave --quantize out", file=sys.stderr)
            return 2
        out = make_model(args.dir, preset=args.preset, seed=args.seed, quantize=args.quantize)
        if args.mtp_agree:
            from epd.families.qwen3_5.presets import write_mtp_layers

            write_mtp_layers(Path(out), args.seed, agree=True)
    print(f"wrote {args.preset}{' ' + args.quantize if args.quantize else ''} checkpoint to {out}")
    return 0


def _chat(args) -> int:
    from epd.encoders.image_io import ImageError, read_image_size
    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    from epd.inputs.model_files import NO_IMAGE_PROCESSOR, PROCESSOR_CONFIG

    if not (Path(args.model) / "config.json").exists():
        print(f"epd chat: {args.model} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    if (args.image or args.video) and not (Path(args.model) / PROCESSOR_CONFIG).is_file():
        print(f"epd chat: {NO_IMAGE_PROCESSOR}", file=sys.stderr)
        return 2
    parts = []
    for path in args.image:
        try:
            data = Path(path).read_bytes()
            read_image_size(data)
        except OSError as exc:
            print(f"epd chat: cannot read image {path}: {exc.strerror}", file=sys.stderr)
            return 2
        except ImageError as exc:
            print(f"epd chat: {path} is not a usable image ({exc})", file=sys.stderr)
            return 2
        parts.append({"type": "image_url", "image_url": {"url": Path(path).resolve().as_uri()}})
    for path in args.video:
        if (problem := _video_problem(path)) is not None:
            print(f"epd chat: {problem}", file=sys.stderr)
            return 2
        parts.append({"type": "video_url", "video_url": {"url": Path(path).resolve().as_uri()}})
    parts.append({"type": "text", "text": args.prompt})
    llm = LLM(args.model, EngineConfig(dtype=args.dtype, device=args.device), chat_template=args.chat_template)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.chat([[{"role": "user", "content": parts}]], params)[0]
    print(out.outputs[0].text)
    return 0


def _video_problem(path: str) -> str | None:
    """Why the file cannot be a video input (read from its header only), or None."""
    from epd.encoders.video_io import VideoError, read_video_meta

    try:
        read_video_meta(Path(path).read_bytes())
    except OSError as exc:
        return f"cannot read video {path}: {exc.strerror}"
    except VideoError as exc:
        return f"{path} is not a usable video ({exc})"
    return None
