"""The encoder worker loop: EncodeRequests in, embeddings to LMDB, EncodeDone out.

    loop:  drain inbox (batch up to a patch budget; a thread reads the socket
           meanwhile and stamps arrivals: transport/wire/stamped_inbox.py) -> skip images already in
           the cache (read back and sent inline when the prefill worker shares
           no cache dir) -> decode + preprocess + ViT -> cache.put -> EncodeDone
           to the prefill worker named in each request (with the tensors when
           it shares no cache dir) -> WorkerStats every `stats_interval_s`

A video (an EncodeRequest with `video`, the plan the API counted) is a batch
of its own: its planned frames decoded under the decode limits (frame size,
decoded pixels, a deadline: encoders/video_io.DecodeLimits), then the video
encoder (encoders/video_encoder.py); each entry its spans name (a Qwen3-VL
temporal group, or the whole Qwen2.5-VL video) goes to the cache and gets its
own EncodeDone, as an image's does. A video that fails sends one EncodeDone
with the error, for its first entry: the request waits for all of them.
An audio clip (`audio_tokens`, the count the API gave) is a batch of its own
too: its file decoded and resampled, the family's audio side's features and
tower (encoders/audio_encoder.py), one entry checked against that count.

With a tower adapter (EncodeRequest.lora, --enable-tower-lora) the tower runs
its weights (ImageEncoder.adapted, encoders/tower_lora.py): a batch's images
are encoded in one forward per adapter (encoders/encode_items.py); the request's mm_hash is already the
adapter's key, so the cache never hands base embeddings to it, nor its to the base.

Each batch starts and ends with an `Alive` naming the requests it holds
(`WorkerIO.say_working_on`): if the process dies in it (killed for memory, a
crash in native code), the API fails those requests instead of sending them
into the next encoder (docs/architecture.md, "Faults"). An Abort drops the
queued items of the requests it names, unencoded.

The stats carry, besides counters and histograms, the patches queued and the
requests received, from which the API's router knows the work each encoder
holds (epd/serve/encoder_router.py), the tower adapters resident in its slots
(with --enable-tower-lora; the router prefers an encoder that holds a request's), and the age of the oldest queued image
(the autoscaler's signal, epd/processes/autoscale.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from epd.encoders.encode_items import encode_items
from epd.encoders.image_encoder import ImageEncoder
from epd.encoders.image_io import ImageError, read_image_size
from epd.transport.media.image_geometry import NO_IMAGE_PROCESSOR
from epd.encoders.video_io import DecodeLimits
from epd.encoders.video_request import NO_VIDEO_ENCODER, encode_video_request, video_keys
from epd.transport.wire.frame_limits import encoder_inbox_frame_bytes
from epd.transport.wire.messages import Abort, EncodeDone, EncodeRequest, Shutdown, WorkerStats
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.wire.roles import Role
from epd.transport.wire.stamped_inbox import StampedInbox
from epd.transport.wire.wire_values import EncoderCounters
from epd.transport.wire.worker_io import WorkerIO, WorkerSpec

log = logging.getLogger("epd.encoder")
NO_AUDIO_ENCODER = "this encoder has no audio side (the model takes no audio)"

@dataclass
class _Job:
    msg: EncodeRequest
    received_s: float
    num_patches: int  # the tower's work: what a batch's budget counts
    num_tokens: int  # the embeddings' rows: what a cache hit saves


def _is_alone(job: _Job) -> bool:
    """A video, an audio clip, or an item whose request was a suspect of an encoder's death: a
    batch of its own."""
    return job.msg.video is not None or job.msg.audio_tokens > 0 or job.msg.alone


class EncoderWorker(WorkerIO):
    def __init__(self, spec: WorkerSpec, encoder: ImageEncoder, video=None,
                 decode_limits: DecodeLimits | None = None, audio=None):
        """`video`: the checkpoint's VideoEncoder (None: videos refused); `decode_limits`:
        what decoding one may cost; `audio`: the family's AudioEncoder (None: clips refused)."""
        if spec.role != Role.ENCODER:
            raise ValueError(f"an encoder worker cannot take the role '{spec.role}'")
        super().__init__(spec, encoder.model_fingerprint,
                         max_frame_bytes=encoder_inbox_frame_bytes(spec.max_image_bytes))
        self.encoder = encoder
        self.video = video
        self.audio = audio
        self.decode_limits = decode_limits
        self.queue: list[_Job] = []
        self.running = True
        self.counters = EncoderCounters()
        # a thread reads the socket while the ViT runs, so an image's queue time starts when it came in
        self.arrivals = StampedInbox(self.inbox, spec.worker_id)
        self._last_stats = 0.0

    def run(self) -> None:
        self.arrivals.start()
        self.announce()
        try:
            while self.running:
                self._drain(timeout_s=0.0 if self.queue else 0.05)
                if self.queue:
                    self._encode_batch()
                self._maybe_send_stats()
        finally:
            self.arrivals.stop()
            self.close()

    def _drain(self, timeout_s: float) -> None:
        for msg, arrived_s in self.arrivals.drain(timeout_s):
            if isinstance(msg, EncodeRequest):
                self.counters.num_requests_received += 1
                self._enqueue(msg, arrived_s)
            elif isinstance(msg, Abort):  # pending encoder work of aborted requests is dropped
                dropped = set(msg.request_ids)
                kept = [j for j in self.queue if j.msg.request_id not in dropped]
                self.counters.num_aborted += len(self.queue) - len(kept)
                self.queue = kept
            elif isinstance(msg, Shutdown):
                self.running = False
            else:
                log.warning("%s: unexpected %s", self.spec.worker_id, type(msg).__name__)

    def _enqueue(self, msg: EncodeRequest, arrived_s: float) -> None:
        if msg.audio_tokens > 0:
            if self.audio is None:
                self._done(msg, error=NO_AUDIO_ENCODER)
            else:  # the tower's work and its rows: the clip's tokens, as counted by the API
                self.queue.append(_Job(msg, arrived_s, msg.audio_tokens, msg.audio_tokens))
            return
        if msg.video is not None:
            if self.video is None:
                self._done(msg, self._keys(msg)[0], error=NO_VIDEO_ENCODER)
            else:
                plan = msg.video
                self.queue.append(_Job(msg, arrived_s, plan.num_patches,
                                       plan.num_patches // self.video.geometry.merge_size ** 2))
            return
        if self.encoder.vision is None:  # a text-only checkpoint (the API sends it no images)
            self._done(msg, error=NO_IMAGE_PROCESSOR)
            return
        try:
            width, height = read_image_size(msg.image, self.encoder.max_image_pixels)
            patches = self.encoder.vision.patches(width, height)
            tokens = self.encoder.vision.geometry.num_image_tokens(width, height)
        except (ImageError, ValueError) as exc:
            self._done(msg, error=str(exc))
            return
        self.queue.append(_Job(msg, arrived_s, patches, tokens))

    def _encode_batch(self) -> None:
        """Encodes queued images, oldest first, up to the patch budget; a video, or an
        item sent `alone`, in a batch of its own. The API is told which requests the
        batch holds while it runs (`say_working_on`): the suspects, should it kill us."""
        batch, patches = [], 0
        start = time.perf_counter()
        while self.queue and (not batch or (patches + self.queue[0].num_patches <= self.encoder.max_batch_patches
                                            and not _is_alone(self.queue[0]) and not _is_alone(batch[0]))):
            job = self.queue.pop(0)
            self.counters.queue_wait.observe(start - job.received_s)
            if self._from_cache(job):
                continue
            batch.append(job)
            patches += job.num_patches
        if not batch:
            return
        self.say_working_on(sorted({job.msg.request_id for job in batch}))
        try:
            self._encode_jobs(batch)
        finally:
            self.say_working_on([])

    def _encode_jobs(self, batch: list[_Job]) -> None:
        """A batch taken from the queue: a video alone, or images (one tower forward per adapter)."""
        if batch[0].msg.video is not None:
            self._encode_video(batch[0])
            return
        if batch[0].msg.audio_tokens > 0:
            self._encode_audio(batch[0])
            return
        self._encode_images(batch)

    def _encode_images(self, batch: list[_Job]) -> None:
        """A batch of images, one tower forward per tower adapter (encoders/encode_items.py),
        encoded and stored; an image that fails (bad bytes, a bad adapter) fails its request."""
        start = time.perf_counter()
        results = self._image_results(batch)
        self.counters.encode_seconds_sum += time.perf_counter() - start
        for job, result in zip(batch, results):
            if isinstance(result, ValueError):
                self._done(job.msg, error=str(result))
                continue
            self.counters.num_images += 1
            self.counters.image.num_items += 1
            self._store(job.msg, job.msg.mm_hash, result)

    def _image_results(self, batch: list[_Job]) -> list:
        """An MMEntry per image, or its error (a ValueError): encoders/encode_items.py."""
        return encode_items(self.encoder, [job.msg.image for job in batch], [job.msg.lora for job in batch],
                            on_batch=self._on_batch, on_decode=self.counters.image.observe_decode)

    def _store(self, msg: EncodeRequest, key: str, entry: MMEntry) -> None:
        """An entry encoded: into the cache, then its EncodeDone. A cache that cannot take
        it (too large, map full, disk error) is our fault, not the request's: the tensors
        then travel inline, as to a prefill worker on another host."""
        cached = False
        if self.cache is not None:
            put_start = time.perf_counter()
            cached = self.cache.put(key, entry)
            self.counters.cache_write_seconds.observe(time.perf_counter() - put_start)
        self._done(msg, key, entry=entry if (msg.with_tensors or not cached) else None)

    def _encode_video(self, job: _Job) -> None:
        """One video: its planned frames decoded within the limits, encoded, each entry
        stored (encoders/video_request.py); a failure answers its first entry."""
        start = time.perf_counter()
        results = self._video_results(job)
        self.counters.encode_seconds_sum += time.perf_counter() - start
        for key, result in results:
            if isinstance(result, str):
                self._done(job.msg, key, error=result)
                return
        self.counters.num_images += 1
        self.counters.video.num_items += 1
        for key, entry in results:
            self._store(job.msg, key, entry)

    def _encode_audio(self, job: _Job) -> None:
        """One audio clip: decoded, encoded and stored (encoders/audio_encoder.py); a bad file, or
        embeddings that do not fill the API's count, fail its request."""
        start = time.perf_counter()
        try:
            entry = self.audio.encode_served(job.msg.image, job.msg.mm_hash, job.msg.audio_tokens)
        except ValueError as exc:
            self._done(job.msg, error=str(exc))
            return
        finally:
            self.counters.encode_seconds_sum += time.perf_counter() - start
        self.counters.num_images += 1
        self.counters.audio.num_items += 1
        self._store(job.msg, job.msg.mm_hash, entry)

    def _video_results(self, job: _Job) -> list:
        """(key, MMEntry or error) per entry of a video (a failure: its first entry's error)."""
        try:
            with self.encoder.adapted(job.msg.lora):
                return encode_video_request(self.video, job.msg, self.decode_limits, on_done=self._on_video,
                                            on_decode=self.counters.video.observe_decode)
        except ValueError as exc:  # the tower adapter
            return [(self._keys(job.msg)[0], str(exc))]

    def _keys(self, msg: EncodeRequest) -> list[str]:
        """The cache keys an EncodeRequest's item is stored under (a video: its entries')."""
        return [msg.mm_hash] if msg.video is None else video_keys(msg)

    def _from_cache(self, job: _Job) -> bool:
        """Answers a queued image (or every entry of a video) from the cache when it is
        there (encoded meanwhile for another request, or earlier on this host): by name
        when the prefill worker reads the same cache, else with the tensors read back."""
        keys = self._keys(job.msg)
        if self.cache is None or not all(self.cache.contains(key) for key in keys):
            return False
        entries = [self.cache.get(key) for key in keys] if job.msg.with_tensors else [None] * len(keys)
        if any(entry is None for entry in entries) and job.msg.with_tensors:  # evicted since `contains`
            return False
        self.counters.num_cache_skips += 1
        self.counters.cache_hit_tokens += job.num_tokens
        for key, entry in zip(keys, entries):
            self._done(job.msg, key, entry=entry)
        return True

    def _on_video(self, preprocess_s: float, forward_s: float) -> None:
        self._on_batch(1, preprocess_s, forward_s)

    def _on_batch(self, num_images: int, preprocess_s: float, forward_s: float) -> None:
        self.counters.batch_images.observe(num_images)
        self.counters.preprocess_seconds.observe(preprocess_s)
        self.counters.forward_seconds.observe(forward_s)

    def _done(self, msg: EncodeRequest, key: str | None = None, entry: MMEntry | None = None,
              error: str | None = None) -> None:
        """The EncodeDone of entry `key` (None: the request's mm_hash, an image's)."""
        key = msg.mm_hash if key is None else key
        if error is not None:
            self.counters.num_errors += 1
            done = EncodeDone(msg.request_id, key, ok=False, error=error)
        elif entry is not None:
            self.counters.num_inline += 1
            self.counters.inline_bytes += entry.embeddings.nbytes + sum(t.nbytes for t in entry.extras.values())
            done = EncodeDone(msg.request_id, key, ok=True, embeddings=entry.embeddings,
                              extras=dict(entry.extras), meta=dict(entry.meta))
        else:
            done = EncodeDone(msg.request_id, key, ok=True)
        self._send_done(msg, done)

    def _send_done(self, msg: EncodeRequest, done: EncodeDone) -> None:
        """`done` to the prefill worker `msg` names."""
        start = time.perf_counter()
        self.outbox.send(msg.reply_to, done)
        if done.embeddings is not None:  # inline: the time to frame the tensors and hand them to the socket
            self.counters.inline_send_seconds.observe(time.perf_counter() - start)

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.spec.stats_interval_s:
            return
        self._last_stats = now
        self._drain(timeout_s=0.0)  # what arrived during the last batch is queued work too
        # arrival order: the reading thread stamps in order and the queue is kept in it
        oldest_s = self.queue[0].received_s if self.queue else None
        self.counters.oldest_queued_s = 0.0 if oldest_s is None else time.perf_counter() - oldest_s
        self.counters.num_queued_patches = sum(job.num_patches for job in self.queue)
        if self.cache is not None:
            self.counters.cache_evictions = self.cache.stats.evictions
            self.counters.cache_entries = len(self.cache)
            self.counters.cache_bytes = self.cache.total_bytes
        self.publish(WorkerStats(
            self.spec.worker_id, self.spec.role, num_running=0, num_waiting=len(self.queue), num_free_blocks=0,
            num_total_blocks=0, queue_depth=len(self.queue), encoder=self.counters, session=self.session,
            cache=None if self.cache is None else self.cache.faults(),
            lora=None if self.encoder.lora is None else self.encoder.lora.state([job.msg.lora for job in self.queue])))
