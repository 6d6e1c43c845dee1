"""One entry function per worker process: `run_worker(WorkerLaunch)`.

Builds what the role needs (engine, vision encoder or both), then runs its
loop until Shutdown. The process dies with the launcher that started it
(a thread waits on multiprocessing's parent sentinel, which the launcher's end
of a pipe keeps unready while it lives: its parent process is the forkserver,
so PR_SET_PDEATHSIG alone would not see the launcher go), so a killed launcher
leaves no orphans.

SIGTERM to a spawned worker is not its stop: the launcher stops its workers
itself (Shutdown) once the API has ended every request, so a SIGTERM that
reached the worker too (to the whole process group: systemd's
KillMode=control-group, a terminal's job control; or the forkserver's death,
through PR_SET_PDEATHSIG) lets it serve on until then, for at most
`WorkerLaunch.sigterm_grace_s`. The launcher's own stop of one worker is
`STOP_NOW` (SIGUSR1), obeyed at once.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from dataclasses import dataclass

from epd.encoders.video_io import DecodeLimits
from epd.engine.config import EngineConfig
from epd.processes.heap import freeze_startup_heap
from epd.transport.host.core_lease import CoreShare, StealMeter
from epd.transport.wire.worker_io import WorkerSpec


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything a worker process needs, picklable for multiprocessing spawn:
    the `spec` its worker loop takes, and what building the model needs."""

    spec: WorkerSpec  # id, role, inbox to bind, every API collector's address, embedding cache
    model: str
    engine: EngineConfig
    max_image_pixels: int
    num_threads: int
    nice: int = 0  # added to the process's niceness before any work
    mm_processor_kwargs: tuple = ()  # --mm-processor-kwargs as (key, value) pairs: the encoder's processor
    tokenizer: str | None = None  # --tokenizer: the grammar compiler's (None: the checkpoint's)
    decode_limits: DecodeLimits | None = None  # an encoder's: what decoding one video may cost (None: no bound)
    core_share: CoreShare | None = None  # an engine worker's place in its host's core lease (None: fixed threads)
    sigterm_grace_s: float = 60.0  # spawned: how long a SIGTERM lets it serve on for the launcher's Shutdown


# A spawned worker's stop at once: what the launcher sends one worker (SIGTERM is the group's).
STOP_NOW = signal.SIGUSR1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    launcher = multiprocessing.parent_process()  # who called Process.start(), wherever we forked from
    if launcher is not None:
        threading.Thread(target=_exit_when_gone, args=(launcher.sentinel,), name="epd-launcher-watch",
                         daemon=True).start()


def _exit_when_gone(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready once the launcher's end is closed: it exited
    os.kill(os.getpid(), STOP_NOW)  # the handler below: sys.exit(0) in the main thread


def _serve_on_after_sigterm(grace_s: float) -> None:
    """SIGTERM: serve on until the launcher's Shutdown (or STOP_NOW), `grace_s` at most."""
    timer: list[threading.Timer] = []

    def on_sigterm(*_) -> None:
        if not timer:  # the group's SIGTERM and the forkserver's death: one deadline, from the first
            timer.append(threading.Timer(grace_s, os.kill, (os.getpid(), STOP_NOW)))
            timer[0].daemon = True
            timer[0].start()

    signal.signal(signal.SIGTERM, on_sigterm)


def run_worker(launch: WorkerLaunch, spawned: bool = True) -> None:
    """Process entry: never returns before Shutdown (or a signal). A worker
    `spawned` by the launcher ignores Ctrl-C and serves on after SIGTERM (the
    launcher sends Shutdown), stops on STOP_NOW and dies with the launcher; a
    standalone `epd worker` stops on Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if spawned:
        signal.signal(STOP_NOW, lambda *_: sys.exit(0))
        _serve_on_after_sigterm(launch.sigterm_grace_s)
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("EPD_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s {launch.spec.worker_id} %(levelname)s %(message)s")
    if launch.nice:
        os.nice(launch.nice)
    import torch

    torch.set_num_threads(launch.num_threads)
    if not spawned:  # `epd worker`: what it runs with (the CPU discipline of epd/processes/threads.py)
        print(f"EPD worker {launch.spec.worker_id}: {torch.get_num_threads()} torch threads, "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}", flush=True)
    from epd.engine.model_info import ModelInfo
    from epd.families.registry import load_hf_config

    hf_config = load_hf_config(launch.model)
    info = ModelInfo.from_pretrained(launch.model, hf_config)
    worker = _engine_worker(launch, hf_config, info) if launch.spec.role.holds_kv else \
        _encoder_worker(launch, hf_config, info)
    freeze_startup_heap()  # the model, torch, transformers: out of every later full collection
    worker.run()


def _image_encoder(launch: WorkerLaunch, hf_config, info, dtype, device):
    from epd.encoders.image_encoder import ImageEncoder
    from epd.encoders.tower_lora import TowerLoRASettings

    return ImageEncoder(launch.model, hf_config, dtype, device, model_fingerprint=info.fingerprint,
                        max_image_pixels=launch.max_image_pixels, processor_kwargs=dict(launch.mm_processor_kwargs),
                        tower_lora=TowerLoRASettings.of(launch.engine.lora))


def _encoder_worker(launch: WorkerLaunch, hf_config, info):
    from epd.encoders.encoder_worker import EncoderWorker
    from epd.engine.loader import resolve_dtype

    device = launch.engine.resolved_device()
    dtype = resolve_dtype(launch.engine.dtype, info.checkpoint_dtype)
    encoder = _image_encoder(launch, hf_config, info, dtype, device)
    return EncoderWorker(launch.spec, encoder, video=_video_encoder(launch, encoder, dtype, device),
                         decode_limits=launch.decode_limits, audio=_audio_encoder(launch, hf_config, info, dtype, device))


def _audio_encoder(launch: WorkerLaunch, hf_config, info, dtype, device):
    """The family's audio side (encoders/audio_encoder.py); None for a family that takes no audio."""
    from epd.encoders.audio_encoder import AudioEncoder
    from epd.families.registry import family_of

    if family_of(hf_config).audio is None:
        return None
    return AudioEncoder(launch.model, hf_config, dtype, device, model_fingerprint=info.fingerprint)


def _video_encoder(launch: WorkerLaunch, encoder, dtype, device):
    """The checkpoint's video encoder, sharing the image encoder's tower; None without a
    tower or a video processor config (videos are then refused, as the API refuses them)."""
    from epd.encoders.video_encoder import VideoEncoder

    if encoder.tower is None:
        return None
    try:
        return VideoEncoder(launch.model, encoder.vision, device)
    except FileNotFoundError:
        return None


def _engine_worker(launch: WorkerLaunch, hf_config, info):
    from epd.engine.engine_core import EngineCore
    from epd.engine.worker.loop import EngineWorker

    role = launch.spec.role
    core = EngineCore(launch.model, launch.engine, role=role.scheduler_role, hf_config=hf_config, info=info,
                      tokenizer_dir=launch.tokenizer, kv_events=launch.spec.reports_kv_blocks)
    encode_fn = None
    if role.encodes:  # aggregated: the vision encoder in-process
        encode_fn = _in_process_encode_fn(launch, hf_config, info, core.dtype, core.device)
    cores = None
    if launch.core_share is not None:
        import torch

        cores = launch.core_share.open(torch.set_num_threads, StealMeter())
    return EngineWorker(launch.spec, core, encode_fn, cores=cores)


def _in_process_encode_fn(launch: WorkerLaunch, hf_config, info, dtype, device):
    """The aggregated worker's encoder (engine/worker/loop.py's EncodeFn): images batched, each
    video decoded and encoded as an encoder worker does it (encoders/video_request.py),
    under the launch's decode limits, each audio clip likewise (encoders/audio_encoder.py)."""
    encoder = _image_encoder(launch, hf_config, info, dtype, device)
    video = _video_encoder(launch, encoder, dtype, device)
    audio = _audio_encoder(launch, hf_config, info, dtype, device)

    def encode_fn(msgs, counters):
        from epd.encoders.encode_items import encode_items

        images = [m for m in msgs if m.video is None and m.audio_tokens == 0]  # one tower forward per adapter (--enable-tower-lora)
        entries = encode_items(encoder, [m.image for m in images], [m.lora for m in images],
                               on_decode=counters.image.observe_decode)
        image_results = {id(m): entry if not isinstance(entry, ValueError) else str(entry)
                         for m, entry in zip(images, entries)}
        return [_encode_video(encoder, video, m, launch.decode_limits, counters.video.observe_decode)
                if m.video is not None else _encode_audio(audio, m) if m.audio_tokens
                else [(m.mm_hash, image_results[id(m)])] for m in msgs]

    return encode_fn


def _encode_audio(audio, msg) -> list:
    """[(key, MMEntry or error)] of one clip (encoders/audio_encoder.py)."""
    if audio is None:
        return [(msg.mm_hash, "this model takes no audio")]
    try:
        return [(msg.mm_hash, audio.encode_served(msg.image, msg.mm_hash, msg.audio_tokens))]
    except ValueError as exc:
        return [(msg.mm_hash, str(exc))]


def _encode_video(encoder, video, msg, limits, on_decode) -> list:
    from epd.encoders.video_request import encode_video_request, video_keys

    try:
        with encoder.adapted(msg.lora):
            return encode_video_request(video, msg, limits, on_decode=on_decode)
    except ValueError as exc:  # the tower adapter
        return [(video_keys(msg)[0], str(exc))]
