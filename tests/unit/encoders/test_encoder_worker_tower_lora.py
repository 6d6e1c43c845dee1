"""An encoder worker with tower adapters (--enable-tower-lora; encoders/encoder_worker.py),
over real ZeroMQ, a real LMDB cache and the tiny checkpoint's tower: one batch mixing
the base tower, a tower adapter and a torn adapter runs one forward per adapter, the
adapter's embeddings are its own (cached under its key), the torn one fails only its
image; a video runs the adapter too, its entries keyed apart; an encoder without the flag refuses an adapter
by name and serves on; its WorkerStats name the tower adapters resident and queued (the encoder router's)."""
from __future__ import annotations

import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from testkit.lora_adapters import TOWER_MODULES, make_adapter
from testkit.media import image_bytes

from epd.encoders.encoder_worker import EncoderWorker
from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.tower_lora import TowerLoRASettings
from epd.encoders.video_encoder import VideoEncoder
from epd.encoders.video_io import DecodeLimits
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.weights.lora_files import adapter_digest
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.wire.messages import EncodeDone, EncodeRequest, WorkerStats
from epd.transport.wire.wire_values import LoRAState
from epd.transport.wire.worker_io import WorkerSpec

IMAGE = image_bytes(64, 48, seed=5)


@pytest.fixture(scope="module")
def loras(tiny_model, tmp_path_factory) -> dict[str, LoRARequest]:
    out = tmp_path_factory.mktemp("tower-adapters")
    good = make_adapter(tiny_model, out / "vit", TOWER_MODULES, r=4, seed=51)
    torn = out / "torn"
    shutil.copytree(good, torn)
    data = (torn / "adapter_model.safetensors").read_bytes()
    (torn / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])  # its header intact, its data cut
    return {"vit": LoRARequest("vit", 1, good), "torn": LoRARequest("torn", 2, str(torn))}


@pytest.fixture
def plane(tiny_model, tmp_path):
    from transformers import AutoConfig

    addresses = Addresses.ipc(tmp_path)
    collector, prefill = Receiver(addresses.collector(0)), Receiver(addresses.worker("prefill", 0))
    made = []

    def make(tower_lora: TowerLoRASettings | None) -> EncoderWorker:
        encoder = ImageEncoder(tiny_model, AutoConfig.from_pretrained(tiny_model), torch.float32,
                               model_fingerprint="fp", tower_lora=tower_lora)
        spec = WorkerSpec(f"encoder-{len(made)}", "encoder", addresses.worker("encoder", len(made)),
                          (collector.address,), str(tmp_path / f"cache-{len(made)}"), 64 << 20)
        made.append(EncoderWorker(spec, encoder, video=VideoEncoder(tiny_model, encoder.vision),
                                  decode_limits=DecodeLimits(1 << 20, 1 << 24, 60.0)))
        return made[-1]

    def run(worker: EncoderWorker, msgs: list[EncodeRequest]) -> dict[str, EncodeDone]:
        for msg in msgs:
            worker._enqueue(msg, time.perf_counter())
        while worker.queue:
            worker._encode_batch()
        out = {}
        while (done := prefill.recv(timeout_s=0.5)) is not None:
            out[done.request_id] = done
        return out

    def request(worker: EncoderWorker, request_id: str, lora: LoRARequest | None) -> EncodeRequest:
        digest = None if lora is None else adapter_digest(lora.lora_path)
        return EncodeRequest(request_id, worker.encoder.mm_hash(IMAGE, digest), IMAGE, reply_to=prefill.address,
                             lora=lora)

    def stats(worker: EncoderWorker) -> WorkerStats:
        """The stats it publishes now, as the API receives them over ZeroMQ."""
        worker._last_stats = float("-inf")
        worker._maybe_send_stats()
        while (msg := collector.recv(timeout_s=2.0)) is not None:
            if isinstance(msg, WorkerStats) and msg.worker_id == worker.spec.worker_id:
                return msg
        raise AssertionError("no WorkerStats within 2 s")

    yield SimpleNamespace(make=make, run=run, request=request, stats=stats, prefill_address=prefill.address)
    for worker in made:
        worker.close()
    collector.close()
    prefill.close()


def test_one_batch_mixes_the_base_a_tower_adapter_and_a_torn_one(plane, loras):
    worker = plane.make(TowerLoRASettings(max_loras=1, max_lora_rank=16, max_cpu_loras=2))
    msgs = [plane.request(worker, "base", None), plane.request(worker, "vit", loras["vit"]),
            plane.request(worker, "torn", loras["torn"])]
    done = plane.run(worker, msgs)
    assert done["base"].ok and done["vit"].ok and done["base"].mm_hash != done["vit"].mm_hash
    assert not done["torn"].ok and "'torn'" in done["torn"].error and "data_offsets" in done["torn"].error
    base, tuned = worker.cache.get(msgs[0].mm_hash), worker.cache.get(msgs[1].mm_hash)
    assert not torch.allclose(base.embeddings, tuned.embeddings)  # the adapter's tower ran
    expected = worker.encoder.encode([IMAGE], lora=loras["vit"])[0]
    torch.testing.assert_close(tuned.embeddings, expected.embeddings)
    assert worker.counters.num_images == 2 and worker.counters.num_errors == 1
    again = plane.run(worker, [plane.request(worker, "base-again", None)])  # the worker serves on
    assert again["base-again"].ok and worker.counters.num_cache_skips == 1


def test_the_stats_name_the_resident_and_the_queued_tower_adapters(plane, loras):
    worker = plane.make(TowerLoRASettings(max_loras=1, max_lora_rank=16, max_cpu_loras=2))
    assert plane.stats(worker).lora == LoRAState(max_lora=1)  # none yet
    plane.run(worker, [plane.request(worker, "vit", loras["vit"]), plane.request(worker, "base", None)])
    worker._enqueue(plane.request(worker, "queued", loras["torn"]), time.perf_counter())
    assert plane.stats(worker).lora == LoRAState(waiting=("torn",), resident=("vit",), max_lora=1)
    assert plane.stats(plane.make(None)).lora is None  # no --enable-tower-lora: nothing to report


def test_an_encoder_without_tower_lora_refuses_an_adapter_by_name(plane, loras):
    worker = plane.make(None)
    done = plane.run(worker, [plane.request(worker, "vit", loras["vit"]), plane.request(worker, "base", None)])
    assert not done["vit"].ok and "tower LoRA is not enabled on this encoder (--enable-tower-lora)" in done["vit"].error
    assert done["base"].ok


def test_a_video_runs_the_tower_adapter_and_is_keyed_apart(plane, loras, tiny_model):
    pytest.importorskip("av")
    from testkit.videos import encode_video, synthetic_frames

    from epd.transport.media.video_geometry import load_video_config
    from epd.transport.media.video_keys import entry_hashes, video_mm_hash
    from epd.inputs.video_header import plan_video
    from epd.transport.embedding_cache.mm_cache import adapted_mm_hash

    worker = plane.make(TowerLoRASettings(max_loras=1, max_lora_rank=16, max_cpu_loras=1))
    data = encode_video(synthetic_frames(5, 64, 96), "mp4", fps=5)
    _, plan = plan_video(data, worker.video.geometry)
    base_key = video_mm_hash(data, "fp", load_video_config(tiny_model), plan)
    tuned_key = adapted_mm_hash(base_key, adapter_digest(loras["vit"].lora_path))
    msgs = [EncodeRequest(rid, key, data, reply_to=plane.prefill_address, video=plan, lora=lora)
            for rid, key, lora in (("base", base_key, None), ("vit", tuned_key, loras["vit"]))]
    done = plane.run(worker, msgs)
    assert done["base"].ok and done["vit"].ok
    for base, tuned in zip(entry_hashes(base_key, plan), entry_hashes(tuned_key, plan)):
        assert base != tuned
        assert not torch.allclose(worker.cache.get(base).embeddings, worker.cache.get(tuned).embeddings)
