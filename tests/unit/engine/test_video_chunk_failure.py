"""A video encoded in chunks (`--video-chunk-frames`) at a prefill worker: it is
prefilled past the chunks that arrived while the others encode (early prefill),
and a chunk that fails fails only its request and frees everything it held:
its KV blocks, the ledger's entries, and the chunks that arrive after it (kept
for no one). Real ZeroMQ, the real engine, a real video on the tiny checkpoint."""
from __future__ import annotations

import pytest

from epd.transport.media.video_chunks import split_plan
from epd.transport.media.video_geometry import VideoOptions
from epd.transport.media.video_keys import entry_hashes, video_mm_hash
from epd.engine.worker.loop import EngineWorker
from epd.inputs.prompt import VideoRef
from epd.inputs.video_header import plan_video
from epd.transport.wire.addresses import Addresses
from epd.transport.wire.channels import Receiver
from epd.transport.wire.messages import EncodeDone, PrefillRequest, TokenOutput, TokenOutputs
from epd.transport.wire.sampling import SamplingParams
from epd.transport.wire.worker_io import WorkerSpec
from testkit.videos import encode_video, synthetic_frames

pytest.importorskip("av")
NUM_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    return LLM(tiny_model, max_num_batched_tokens=32, dtype="float32", device="cpu")


def chunked_video(llm, seed: int):
    """(prompt, each chunk's (key, entry) pairs) of a 9-frame clip sampled at 4 fps, a chunk per group."""
    data = encode_video(synthetic_frames(9, 48, 64, seed=seed), "mp4", fps=4)
    _, plan = plan_video(data, llm.video.geometry, VideoOptions(fps=4))
    key = video_mm_hash(data, llm.engine.info.fingerprint, llm.files.video_processor_config, plan)
    chunks = split_plan(plan, llm.video.geometry.temporal_patch_size, chunk_frames=2)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
                                             {"type": "text", "text": "What happens?"}]}]
    prompt = llm.inputs.prompts.build(messages, [], videos=[VideoRef(plan, key, tuple(chunks))])
    return prompt, [llm.video.encode(data, chunk, key) for chunk in chunks], chunks, key


def done(request_id: str, key: str, entry) -> EncodeDone:
    return EncodeDone(request_id, key, ok=True, embeddings=entry.embeddings, extras=dict(entry.extras),
                      meta=entry.meta)


def run_until_idle(worker, core) -> None:
    for _ in range(200):
        if not core.has_unfinished():
            return
        worker._step()
    raise AssertionError("the engine never went idle")


def test_a_failed_chunk_fails_its_request_only_and_frees_everything(llm, tmp_path):
    addresses = Addresses.ipc(tmp_path)
    collector = Receiver(addresses.collector(0))
    spec = WorkerSpec("prefill-0", "pd", addresses.worker("pd", 0), (collector.address,), None, 0)
    worker = EngineWorker(spec, llm.engine)
    worker.heartbeat.interval_s = 3600.0
    core = llm.engine
    try:
        prompt, pieces, chunks, key = chunked_video(llm, seed=41)
        assert len(chunks) >= 3
        ok_prompt, ok_pieces, _, _ = chunked_video(llm, seed=42)
        worker._handle(PrefillRequest("cut", prompt.token_ids, prompt.mm_spans, GREEDY, [], None))
        worker._handle(PrefillRequest("fine", ok_prompt.token_ids, ok_prompt.mm_spans, GREEDY, [], None))
        for k, entry in pieces[0]:  # the first chunk is here, the others still encode
            worker._handle(done("cut", k, entry))
        run_until_idle(worker, core)
        [request] = [r for r in [*core.scheduler.waiting, *core.scheduler.running] if r.request_id == "cut"]
        first_pending = prompt.mm_spans[len(pieces[0])]
        assert request.num_computed_tokens == first_pending.offset > prompt.mm_spans[0].end  # past chunk 1
        assert core.num_waiting_for_images == 2 and core.num_free_blocks() < core.num_blocks

        failed_key = entry_hashes(key, chunks[1])[0]
        worker._handle(EncodeDone("cut", failed_key, ok=False, error="video: the video ends before frame 6"))
        out = collector.recv(timeout_s=5)
        assert isinstance(out, TokenOutput) and (out.request_id, out.finish_reason) == ("cut", "error")
        assert "the video ends before frame 6" in out.error
        for k, entry in pieces[2]:  # a later chunk of the failed request, encoded meanwhile: kept for no one
            worker._handle(done("cut", k, entry))
        assert worker.arrivals.num_early == 0 and list(worker.requests) == ["fine"]
        assert core.num_waiting_for_images == 1  # "fine" still waits; "cut" holds nothing

        for piece in reversed(ok_pieces):  # the other request's chunks, out of order
            for k, entry in piece:
                worker._handle(done("fine", k, entry))
        run_until_idle(worker, core)
        tokens = []
        while len(tokens) < NUM_TOKENS:
            message = collector.recv(timeout_s=5)
            assert isinstance(message, TokenOutputs)
            tokens += [t for o in message.outputs if o.request_id == "fine" for t in o.token_ids]
        assert worker.requests == {} and core.num_free_blocks() == core.num_blocks
        core.step()  # drops the entries no request uses
        assert all(core.get_embedding(k) is None for piece in pieces + ok_pieces for k, _ in piece)
        assert core.images.num_images == 0
    finally:
        worker.close()
        collector.close()
