"""Request datasets for `epd bench serve`: random text, random text + images
(and videos: a (width, height, frames) bucket, vLLM's random-mm `(H, W, T)` with
T > 1, is a real mp4 sent as a `video_url` data URL), jsonl.

Every dataset yields `BenchRequest`s, built before the run starts (images
are encoded up front so the load generator spends no CPU on them while it
measures). All randomness comes from `seed`: the same flags give the same
prompts and the same image bytes.

With a tokenizer (`--tokenizer`, as `vllm bench serve` has) a random
prompt is `input_len` tokens of it; without one it is `input_len` words,
which is about as many tokens only for a large-vocabulary BPE (a small
vocabulary splits words: the `small` preset's makes ~3.6 tokens a word). The
input length recorded in the results is always the server's
`usage.prompt_tokens` (text plus image placeholder tokens).
"""
from __future__ import annotations

import base64
import functools
import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# Short common English words; most are one token for a BPE vocabulary.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education red blue "
    "green small large old new good high long little great big open run walk read write see "
    "make take give find tell ask seem feel try leave call keep let begin show hear play move "
    "live believe hold bring happen stand lose pay meet include continue set learn lead "
    "understand watch follow stop create speak spend grow offer remember love consider appear "
    "buy wait serve die send expect build stay fall cut reach kill remain river tree stone cloud"
).split()

IMAGE_POOL_SIZE = 8  # distinct images that `repeat_image_ratio` draws from
_MIME = {"jpeg": "image/jpeg", "png": "image/png"}
_SUFFIX_MIME = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png",
                ".webp": "image/webp", ".gif": "image/gif", ".bmp": "image/bmp"}


@dataclass(frozen=True)
class BenchRequest:
    """One chat request: a user turn with `image_urls` (data URLs; a `data:video/...`
    one is sent as a video_url part) and `prompt`, the media first unless `text_first`
    (vLLM's bench sends the text first). A conversation's later turn (bench/multi_turn.py)
    sends `history`, the OpenAI messages before it, and its `session_id` as `user` and
    the `x-session-id` header."""

    prompt: str
    output_len: int
    image_urls: tuple[str, ...] = field(default_factory=tuple)
    text_first: bool = False
    history: tuple[dict, ...] = ()
    session_id: str | None = None

    @property
    def num_images(self) -> int:
        """Images and videos sent: this turn's and those the history resends."""
        resent = sum(p.get("type") in ("image_url", "video_url") for m in self.history
                     if isinstance(m.get("content"), list) for p in m["content"])
        return len(self.image_urls) + resent


def random_prompt(rng: random.Random, num_tokens: int, tokenizer=None) -> str:
    """Random words: `num_tokens` tokens of `tokenizer` (re-tokenizing the text
    may differ by a token or two at the cut), or `num_tokens` words without one."""
    return _cut_to_tokens(_random_words(rng, num_tokens), num_tokens, tokenizer)


def _random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_words)))


def _cut_to_tokens(text: str, num_tokens: int, tokenizer) -> str:
    if tokenizer is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)[:max(1, num_tokens)]  # every word is >= 1 token
    return tokenizer.decode(ids)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a local directory, or None (loaded once per
    path: `epd bench compare` builds a dataset for every mode and rate)."""
    if not path:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there ({exc})") from None


def make_image_bytes(width: int, height: int, seed: int | list[int], fmt: str = "jpeg") -> bytes:
    """A real encoded image (JPEG or PNG) of exactly `width` x `height`, seeded.

    A smooth random colour field, a few random shapes and mild noise: distinct
    bytes for distinct seeds, and a file size close to a photo's, not a
    pathological all-noise one.
    """
    if fmt not in _MIME:
        raise ValueError(f"image format must be one of {sorted(_MIME)}, got {fmt!r}")
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)  # [4, 4, rgb]
    img = Image.fromarray(grid).resize((width, height), Image.BILINEAR)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 8))):
        x0, x1 = sorted(rng.integers(0, width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, height, size=2).tolist())
        colour = tuple(rng.integers(0, 256, size=3).tolist())
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour)
    tile = rng.integers(-12, 13, size=(64, 64, 1), dtype=np.int16)  # cheap noise, tiled
    noise = np.tile(tile, (height // 64 + 1, width // 64 + 1, 3))[:height, :width]
    pixels = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt.upper(), **({"quality": 90} if fmt == "jpeg" else {}))
    return out.getvalue()


def make_video_bytes(width: int, height: int, num_frames: int, seed: int | list[int], fps: int = 30) -> bytes:
    """A real mp4 (MPEG-4 part 2, as vLLM's random-mm writes with OpenCV's mp4v) of
    `num_frames` frames of `width` x `height` at `fps`, seeded: a random colour
    field that drifts frame to frame plus a little noise, so frames differ."""
    try:
        import av
    except ImportError:
        raise ValueError("video buckets need PyAV: pip install 'epd[video]'") from None
    if width < 2 or height < 2 or num_frames < 1:
        raise ValueError(f"a video needs a size of at least 2x2 and a frame, got {width}x{height}x{num_frames}")
    rng = np.random.default_rng(seed)
    grid = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)  # [4, 4, rgb]
    field = np.asarray(Image.fromarray(grid).resize((width + num_frames, height), Image.BILINEAR), dtype=np.int16)
    tile = rng.integers(-12, 13, size=(num_frames, 32, 32, 1), dtype=np.int16)  # cheap noise, tiled
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width - width % 2, height - height % 2, "yuv420p"
        for i in range(num_frames):
            noise = np.tile(tile[i], (height // 32 + 1, width // 32 + 1, 3))[:height, :width]
            pixels = np.clip(field[:, i:i + width] + noise, 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels[:stream.height, :stream.width], format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def is_video(item: tuple[int, ...]) -> bool:
    """Whether a random-mm size is a video's (width, height, frames) rather than an image's (width, height)."""
    return len(item) == 3


def size_label(item: tuple[int, ...]) -> str:
    """'WxH' for an image, 'WxHxT' for a video of T frames."""
    return "x".join(str(v) for v in item)


def data_url(data: bytes, mime: str) -> str:
    """`data:<mime>;base64,<payload>` for an `image_url` content part."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'1024x768,640x480' -> [(1024, 768), (640, 480)] (width, height)."""
    sizes = []
    for item in text.split(","):
        try:
            w, h = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"image size must look like WxH (e.g. 1024x768), got {item!r}") from None
        if w <= 0 or h <= 0:
            raise ValueError(f"image size must be positive, got {item!r}")
        sizes.append((w, h))
    return sizes


def sample_random(num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                  tokenizer=None, input_lens: Sequence[int] | None = None) -> list[BenchRequest]:
    """Text-only requests of `input_len` random tokens (words without a tokenizer), `output_len` out;
    `input_lens`: each request's own length instead."""
    rng = random.Random(seed)
    lens = input_lens or [input_len] * num_prompts
    return [BenchRequest(random_prompt(rng, lens[i], tokenizer), output_len) for i in range(num_prompts)]


@dataclass(frozen=True)
class RandomMMDraw:
    """One request of `sample_random_mm` before its media are made: the prompt's
    words and, per item, a pool index (a repeated image) or a size (an image of
    its own, (width, height), or a video, (width, height, frames))."""

    words: str
    images: tuple[int | tuple[int, ...], ...]

    @property
    def is_text_only(self) -> bool:
        return not self.images


def draw_random_mm(num_prompts: int, input_len: int, *, images_per_request: int = 1,
                   images_range_ratio: float = 0.0, image_sizes: list[tuple[int, ...]] | None = None,
                   repeat_image_ratio: float = 0.0, text_only_ratio: float = 0.0,
                   seed: int = 0, input_lens: Sequence[int] | None = None, max_images: int | None = None,
                   image_weights: Sequence[float] | None = None, max_videos: int | None = None) -> list[RandomMMDraw]:
    """Every random choice of `sample_random_mm` (same arguments, same order), without
    making an image: cheap, so the planner's simulation (bench/plan_sim.py) draws the
    same text-only requests as the real run for a seed.

    * K items are drawn uniformly from [K(1-r), K(1+r)], rounded, at least 0
      (r = `images_range_ratio`), at most the sum of the per-modality caps
      `max_images` / `max_videos` of the modalities drawn from (vLLM's
      --random-mm-limit-mm-per-prompt; no cap when one of them has none).
    * Each item's size is drawn from `image_sizes`, with `image_weights` when
      given (vLLM's --random-mm-bucket-config): (width, height) an image,
      (width, height, frames) a video. A modality at its cap in a request is
      drawn no more there, the others' weights renormalised (vLLM's rule).
    * `input_lens`: each request's text length (default `input_len` for all).
    * With probability `repeat_image_ratio` an image comes from a fixed pool
      of `IMAGE_POOL_SIZE` images of the image sizes (embedding-cache hits);
      otherwise it is unique to the whole run.
    * With probability `text_only_ratio` a request has no items at all.
    """
    if not 0.0 <= images_range_ratio <= 1.0:
        raise ValueError(f"--images-range-ratio must be in [0, 1], got {images_range_ratio}")
    for name, ratio in (("--repeat-image-ratio", repeat_image_ratio), ("--text-only-ratio", text_only_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {ratio}")
    if images_per_request < 0:
        raise ValueError(f"--images-per-request must be >= 0, got {images_per_request}")
    sizes = image_sizes or [(1024, 1024)]
    if repeat_image_ratio and not any(not is_video(item) for item in sizes):
        raise ValueError("--repeat-image-ratio draws from a pool of images: give an image size too")
    rng = random.Random(seed)
    low = max(0, round(images_per_request * (1 - images_range_ratio)))
    high = max(low, round(images_per_request * (1 + images_range_ratio)))
    cap = _item_cap(sizes, max_images, max_videos)
    if cap is not None:
        low, high = min(low, cap), min(high, cap)
    lens = input_lens or [input_len] * num_prompts
    weights = list(image_weights) if image_weights is not None else None
    has_videos = any(is_video(item) for item in sizes)
    draws = []
    for i in range(num_prompts):
        words = _random_words(rng, lens[i])
        num_items = 0 if rng.random() < text_only_ratio else rng.randint(low, high)
        if has_videos:
            items = _draw_mixed(rng, num_items, sizes, weights, repeat_image_ratio, max_images, max_videos)
        else:  # images only: the draws every earlier run made for its seed
            items = [rng.randrange(IMAGE_POOL_SIZE) if rng.random() < repeat_image_ratio
                     else (rng.choice(sizes) if weights is None else rng.choices(sizes, weights)[0])
                     for _ in range(num_items)]
        draws.append(RandomMMDraw(words, tuple(items)))
    return draws


def _item_cap(sizes: list[tuple[int, ...]], max_images: int | None, max_videos: int | None) -> int | None:
    caps = [max_images if not video else max_videos for video in {is_video(item) for item in sizes}]
    return None if any(c is None for c in caps) else sum(caps)


def _draw_mixed(rng: random.Random, num_items: int, sizes, weights, repeat_image_ratio: float,
                max_images: int | None, max_videos: int | None) -> list:
    """Images and videos: a modality at its cap in this request is no longer drawn."""
    caps = {False: max_images, True: max_videos}
    counts = {False: 0, True: 0}
    items: list = []
    while len(items) < num_items:
        open_ = [k for k, item in enumerate(sizes) if caps[is_video(item)] is None
                 or counts[is_video(item)] < caps[is_video(item)]]
        if not open_:
            break
        image_open = caps[False] is None or counts[False] < caps[False]
        if image_open and rng.random() < repeat_image_ratio:
            items.append(rng.randrange(IMAGE_POOL_SIZE))
            counts[False] += 1
            continue
        k = rng.choices(open_, None if weights is None else [weights[j] for j in open_])[0]
        items.append(sizes[k])
        counts[is_video(sizes[k])] += 1
    return items


def sample_random_mm(num_prompts: int, input_len: int, output_len: int, *,
                     images_per_request: int = 1, images_range_ratio: float = 0.0,
                     image_sizes: list[tuple[int, ...]] | None = None,
                     repeat_image_ratio: float = 0.0, text_only_ratio: float = 0.0,
                     image_format: str = "jpeg", seed: int = 0, tokenizer=None,
                     input_lens: Sequence[int] | None = None, max_images: int | None = None,
                     image_weights: Sequence[float] | None = None, max_videos: int | None = None) -> list[BenchRequest]:
    """Random text (as `sample_random`) plus K items per request, as `draw_random_mm`
    draws them: images in `image_format`, videos as mp4 (`make_video_bytes`)."""
    mime = _MIME.get(image_format)
    draws = draw_random_mm(num_prompts, input_len, images_per_request=images_per_request,
                           images_range_ratio=images_range_ratio, image_sizes=image_sizes,
                           repeat_image_ratio=repeat_image_ratio, text_only_ratio=text_only_ratio, seed=seed,
                           input_lens=input_lens, max_images=max_images, image_weights=image_weights,
                           max_videos=max_videos)
    lens = input_lens or [input_len] * num_prompts
    if mime is None:
        raise ValueError(f"image format must be one of {sorted(_MIME)}, got {image_format!r}")
    pool_sizes = [item for item in image_sizes or [(1024, 1024)] if not is_video(item)]
    pool: dict[int, str] = {}  # pool index -> data URL, made on first use
    num_unique = 0
    requests = []
    for draw in draws:
        urls = []
        for image in draw.images:
            if isinstance(image, int):  # a pool index
                if image not in pool:
                    w, h = pool_sizes[image % len(pool_sizes)]
                    data = make_image_bytes(w, h, seed=_image_seed(seed, "pool", image), fmt=image_format)
                    pool[image] = data_url(data, mime)
                urls.append(pool[image])
            elif is_video(image):
                w, h, frames = image
                urls.append(data_url(make_video_bytes(w, h, frames, seed=_image_seed(seed, "unique", num_unique)),
                                     "video/mp4"))
                num_unique += 1
            else:
                w, h = image
                data = make_image_bytes(w, h, seed=_image_seed(seed, "unique", num_unique), fmt=image_format)
                urls.append(data_url(data, mime))
                num_unique += 1
        requests.append(BenchRequest(_cut_to_tokens(draw.words, lens[len(requests)], tokenizer), output_len,
                                     tuple(urls)))
    return requests


def load_jsonl(path: str | Path, num_prompts: int | None, default_output_len: int) -> list[BenchRequest]:
    """Requests from a jsonl file: one `{"prompt": str, "images": [path]?, "output_len": int?}` a line.

    Image paths are relative to the file's directory. Blank lines are
    skipped; the first `num_prompts` requests are used (all when None).
    A malformed line raises ValueError naming the file and line number.
    """
    path = Path(path)
    requests = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            try:
                requests.append(_parse_jsonl_line(line, path.parent, default_output_len))
            except (ValueError, OSError) as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no requests in file")
    return requests


def _parse_jsonl_line(line: str, base_dir: Path, default_output_len: int) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = set(obj) - {"prompt", "images", "output_len"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (allowed: prompt, images, output_len)")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError('"prompt" must be a string')
    images = obj.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise ValueError('"images" must be a list of file paths')
    output_len = obj.get("output_len", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f'"output_len" must be a positive integer, got {output_len!r}')
    urls = []
    for image in images:
        image_path = base_dir / image
        urls.append(data_url(image_path.read_bytes(), _mime_of(image_path)))
    return BenchRequest(prompt, output_len, tuple(urls))


def _mime_of(path: Path) -> str:
    mime = _SUFFIX_MIME.get(path.suffix.lower())
    if mime is None:
        raise ValueError(f"{path}: unknown image type (use one of {sorted(_SUFFIX_MIME)})")
    return mime


def _image_seed(seed: int, kind: str, index: int) -> list[int]:
    # independent, reproducible streams for pool and unique images (numpy SeedSequence entropy)
    return [seed, 0 if kind == "pool" else 1, index]
