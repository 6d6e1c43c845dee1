"""What tower LoRA (--enable-tower-lora) costs one encoder forward: the median time of
ImageEncoder.encode for one image with the tower unwrapped, wrapped but run without an
adapter (a base request on a server with the flag), and with a rank-R adapter on every
linear projection of the tower (random weights, PEFT's names).

    python scripts/tower_lora_probe.py CHECKPOINT [--rank 16] [--size 448] [--repeats 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.tower_adapter import TowerShapes
from epd.encoders.tower_lora import TowerLoRASettings
from epd.transport.wire.lora_request import LoRARequest


def write_adapter(out: Path, hf_config, rank: int) -> LoRARequest:
    """A PEFT-format adapter on every tower projection, A and B drawn at random."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for path, (n_in, n_out) in TowerShapes.from_hf(hf_config).sizes.items():
        key = f"base_model.model.model.visual.{path}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return LoRARequest("probe", 1, str(out))


def interleaved_median_ms(runs: dict, image: bytes, repeats: int) -> dict[str, float]:
    """Each configuration's median over `repeats` rounds, the configurations taking turns
    within a round (a shared machine's load then weighs on each alike)."""
    for encoder, lora in runs.values():
        encoder.encode([image], lora=lora)  # warm: slot written, buffers touched
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (encoder, lora) in runs.items():
            start = time.perf_counter()
            encoder.encode([image], lora=lora)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hf_config = AutoConfig.from_pretrained(args.checkpoint)
    image = _png(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        lora = write_adapter(Path(tmp) / "adapter", hf_config, args.rank)
        plain = ImageEncoder(args.checkpoint, hf_config, torch.float32)
        wrapped = ImageEncoder(args.checkpoint, hf_config, torch.float32,
                               tower_lora=TowerLoRASettings(1, max(16, args.rank), 1))
        results = interleaved_median_ms({"unwrapped": (plain, None), "wrapped, base": (wrapped, None),
                                         f"adapter r={args.rank}": (wrapped, lora)}, image, args.repeats)
    for name, ms in results.items():
        print(f"{name:>16}: {ms:8.1f} ms  ({ms / results['unwrapped']:.2f}x)")


def _png(size: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


if __name__ == "__main__":
    main()
