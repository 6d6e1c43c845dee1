"""An encoder worker's video path (encoders/encoder_worker.py): an EncodeRequest
with the API's plan -> the planned frames decoded within the decode limits,
encoded, each entry its spans name in the cache with its own EncodeDone (over
real ZeroMQ, a real LMDB cache and the tiny checkpoint's tower); a repeat is a
cache skip; a bad video fails its request with one EncodeDone and the worker
goes on."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from epd.encoders.encoder_worker import EncoderWorker
from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.video_encoder import VideoEncoder
from epd.transport.media.video_geometry import load_video_config
from epd.encoders.video_io import DecodeLimits
from epd.transport.media.video_keys import entry_hashes, video_mm_hash
from epd.inputs.video_header import plan_video
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import EncodeDone, EncodeRequest
from epd.transport.wire.worker_io import WorkerSpec
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
LIMITS = DecodeLimits(max_frame_pixels=1 << 20, max_decoded_pixels=1 << 24, deadline_s=60.0)


@pytest.fixture
def plane(tiny_model, tmp_path):
    from transformers import AutoConfig

    addresses = Addresses.ipc(tmp_path)
    collector, prefill = Receiver(addresses.collector(0)), Receiver(addresses.worker("prefill", 0))
    images = ImageEncoder(tiny_model, AutoConfig.from_pretrained(tiny_model), torch.float32, model_fingerprint="fp")
    video = VideoEncoder(tiny_model, images.vision)
    made = []

    def make(limits: DecodeLimits = LIMITS) -> EncoderWorker:
        spec = WorkerSpec("encoder-0", "encoder", addresses.worker("encoder", 0), (collector.address,),
                          str(tmp_path / "cache"), 64 << 20)
        worker = EncoderWorker(spec, images, video=video, decode_limits=limits)
        made.append(worker)
        return worker

    def request(data: bytes, request_id: str = "r") -> EncodeRequest:
        _, plan = plan_video(data, video.geometry)
        key = video_mm_hash(data, "fp", load_video_config(tiny_model), plan)
        return EncodeRequest(request_id, key, data, reply_to=prefill.address, video=plan)

    def run(worker: EncoderWorker, msg: EncodeRequest) -> list[EncodeDone]:
        worker._enqueue(msg, time.perf_counter())
        while worker.queue:
            worker._encode_batch()
        out = []
        while (done := prefill.recv(timeout_s=0.5)) is not None:
            out.append(done)
        return out

    yield SimpleNamespace(make=make, request=request, run=run, video=video)
    for worker in made:
        worker.close()
    collector.close()
    prefill.close()


def test_a_video_is_cached_entry_by_entry_and_a_repeat_is_a_skip(plane):
    worker = plane.make()
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)
    msg = plane.request(data)
    done = plane.run(worker, msg)
    keys = entry_hashes(msg.mm_hash, msg.video)
    assert len(keys) > 1  # Qwen3-VL: one entry per temporal group
    assert [(d.request_id, d.mm_hash, d.ok, d.embeddings) for d in done] == [("r", k, True, None) for k in keys]
    reference = dict(plane.video.encode(data, msg.video, msg.mm_hash))
    for key in keys:
        torch.testing.assert_close(worker.cache.get(key).embeddings, reference[key].embeddings, atol=1e-6, rtol=0)
    assert (worker.counters.num_images, worker.counters.num_cache_skips) == (1, 0)

    again = plane.run(worker, plane.request(data, "r2"))
    assert [(d.request_id, d.mm_hash, d.ok) for d in again] == [("r2", k, True) for k in keys]
    assert (worker.counters.num_images, worker.counters.num_cache_skips) == (1, 1)


@pytest.mark.parametrize("limits, message", [
    (DecodeLimits(max_frame_pixels=64 * 95, max_decoded_pixels=1 << 24, deadline_s=60.0),
     "video frames of 96x64 exceed the limit of 6080 pixels"),
    (DecodeLimits(max_frame_pixels=1 << 20, max_decoded_pixels=64 * 96 * 10, deadline_s=60.0),
     "decoding 11 frames of 96x64 exceeds the limit of 61440 decoded pixels"),
    (DecodeLimits(max_frame_pixels=1 << 20, max_decoded_pixels=1 << 24, deadline_s=1e-9),
     "decoding the video took more than 1e-09 s"),
])
def test_decode_limits_fail_the_request_not_the_worker(plane, limits, message):
    worker = plane.make(limits)
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)
    msg = plane.request(data)
    [done] = plane.run(worker, msg)
    assert not done.ok and message in done.error
    assert done.mm_hash == entry_hashes(msg.mm_hash, msg.video)[0]  # the request waits for it
    worker.decode_limits = LIMITS  # the same worker serves the next video
    assert all(d.ok for d in plane.run(worker, plane.request(data, "r2")))


def test_a_forged_plan_upscaling_past_the_decode_limit_fails_before_decoding(plane):
    """The encoder holds the planned frames at their planned size: a peer's plan that
    resizes them past --max-request-video-pixels fails its request, the worker serves on."""
    worker = plane.make()
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)
    msg = plane.request(data)
    forged = EncodeRequest("r", msg.mm_hash, data, reply_to=msg.reply_to,
                           video=replace(msg.video, resized_height=4096, resized_width=4096))
    [done] = plane.run(worker, forged)
    assert not done.ok and "resized to 4096x4096 exceeds the limit of 16777216 decoded pixels" in done.error
    assert worker.counters.video.num_frames_decoded == 0
    assert all(d.ok for d in plane.run(worker, plane.request(data, "r2")))


def test_undecodable_bytes_fail_the_request(plane):
    worker = plane.make()
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)
    msg = plane.request(data)
    broken = EncodeRequest("r", msg.mm_hash, data[: len(data) // 3], reply_to=msg.reply_to, video=msg.video)
    [done] = plane.run(worker, broken)
    assert not done.ok and done.error.startswith("video: ")
    assert worker.counters.num_errors == 1



def test_chunks_of_a_video_each_answer_their_entries_and_a_broken_one_only_its_own(plane):
    """--video-chunk-frames: each chunk an EncodeRequest of its own (its plan through the
    wire), answering its groups' entries; a video whose later frames are cut fails the
    chunk that needs them (one EncodeDone, its first entry) and the first chunk still encodes."""
    from epd.transport.media.video_chunks import split_plan
    from epd.transport.media.video_plan_fields import video_from_fields, video_to_map
    from epd.transport.wire.codec import Fields
    from testkit.videos import cut_after_header

    worker = plane.make()
    frames = synthetic_frames(12, 64, 96, seed=9)
    data = encode_video(frames, "mp4", fps=4)
    whole = plane.request(data)
    chunks = split_plan(whole.video, plane.video.geometry.temporal_patch_size, chunk_frames=2)
    assert len(chunks) > 1
    keys = []
    for i, chunk in enumerate(chunks):
        wire = video_from_fields(Fields(video_to_map(chunk), "video"))
        assert wire == chunk and wire.first_group == chunk.first_group
        done = plane.run(worker, EncodeRequest(f"c{i}", whole.mm_hash, data, reply_to=whole.reply_to, video=wire))
        assert [(d.request_id, d.ok) for d in done] == [(f"c{i}", True)] * chunk.grid_thw[0]
        keys += [d.mm_hash for d in done]
    assert keys == entry_hashes(whole.mm_hash, whole.video)  # the whole video's group keys
    assert worker.counters.num_images == len(chunks)

    broken = cut_after_header(frames, fps=4, keep=0.8)  # frames 0 to 5 decode
    other = "e" * 64  # its own key: not the whole clip's, cached above
    outcomes = [plane.run(worker, EncodeRequest("b", other, broken, reply_to=whole.reply_to, video=chunk))
                for chunk in (chunks[0], chunks[-1])]
    assert all(d.ok for d in outcomes[0])
    [failed] = outcomes[1]
    assert not failed.ok and "the video ends before frame" in failed.error
    assert failed.mm_hash == entry_hashes(other, chunks[-1])[0]


def test_plans_from_headers_that_claim_too_much_fail_at_the_encoder(plane):
    """Plans made without the API's header limits (a peer that skipped them): under the
    server's default decode limits the 10000x10000 stream is refused before a frame is
    decoded, and the header claiming ten hours fails when its 9 real frames run out."""
    from epd.inputs.media import MediaConfig
    from testkit.videos import claims_hours, claims_size

    worker = plane.make(MediaConfig().decode_limits())
    [done] = plane.run(worker, plane.request(claims_size(10000, 10000)))
    assert not done.ok and "video frames of 10000x10000 exceed the limit of 64000000 pixels" in done.error
    msg = plane.request(claims_hours(10, fps=30), "r2")
    [done] = plane.run(worker, msg)
    assert not done.ok and f"the video ends before frame {max(msg.video.frame_indices)}" in done.error
    assert (worker.counters.num_errors, worker.counters.video.num_items, worker.counters.video.num_frames_decoded) \
        == (2, 0, 0)
    data = encode_video(synthetic_frames(11, 64, 96), "mp4", fps=5)  # and the worker serves on
    assert all(d.ok for d in plane.run(worker, plane.request(data, "r3")))
    assert (worker.counters.video.num_items, worker.counters.video.num_frames_decoded) == (1, 11)
    assert worker.counters.video.decode_seconds.count == 1
