"""`epd worker` (one worker registering with a remote `epd serve`) and `epd keys`
(the worker plane's CURVE keys)."""
from __future__ import annotations

import sys

from epd.cli.engine_flags import add_engine_args, add_input_processing_args, engine_config
from epd.cli.video_flags import add_video_limit_args, video_limits
from epd.config import CPU_SHARING, WorkerConfig, field_default
from epd.flag_values import json_object
from epd.transport.wire.roles import Role


def add_worker_parsers(sub) -> None:
    worker = {name: field_default(WorkerConfig, name) for name in (
        "host", "port", "mm_cache_dir", "mm_cache_gb", "max_image_pixels", "max_image_bytes", "num_threads",
        "cpu_sharing")}
    p = sub.add_parser("worker", help="one worker on this host, registering with a remote `epd serve`")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--role", required=True, choices=[str(r) for r in Role])
    p.add_argument("--api", required=True, help="tcp://HOST:PORT of the API's worker port (with --api-servers N: "
                   "the N ports from the worker port up, joined by ',')")
    p.add_argument("--host", default=worker["host"], help="address to bind this worker's inbox on")
    p.add_argument("--port", type=int, default=worker["port"], help="inbox port (0: any free port)")
    p.add_argument("--mm-cache-dir", default=worker["mm_cache_dir"])
    p.add_argument("--mm-cache-gb", type=float, default=worker["mm_cache_gb"])
    p.add_argument("--max-image-pixels", type=int, default=worker["max_image_pixels"])
    p.add_argument("--max-image-bytes", type=int, default=worker["max_image_bytes"],
                   help="the largest image this worker takes (as the API's --max-image-bytes; a larger frame "
                        "disconnects its sender)")
    add_video_limit_args(p)  # as the API's: the largest video this worker takes, an encoder's decode limits
    p.add_argument("--threads-per-worker", "--threads", dest="threads", type=int, default=worker["num_threads"],
                   help="torch threads (default: as `epd serve` gives a worker of this role alone on its host: "
                        "every core but one)")
    p.add_argument("--cpu-sharing", default=worker["cpu_sharing"], choices=list(CPU_SHARING),
                   help="shared (default): OMP_WAIT_POLICY=PASSIVE, so that waiting threads sleep instead of "
                        "spinning on cores other processes need (as `epd serve`); split: OpenMP's default")
    p.add_argument("--worker-keys", required=True, metavar="DIR",
                   help="worker-plane keys made by `epd keys DIR` (this host needs worker.key_secret)")
    p.add_argument("--report-kv-blocks", action="store_true",
                   help="an engine worker tells the API its prefix cache's changes, for an API served with "
                        "--router cache_aware (its workers started by `epd serve` do so by themselves)")
    add_input_processing_args(p)  # as the API's: the two must agree on a prompt's and an image's tokens
    add_engine_args(p)
    p.set_defaults(func=_worker)

    p = sub.add_parser("keys", help="make the worker-plane keys (CURVE) for a multi-host deployment")
    p.add_argument("dir", help="new directory for api.key[_secret] and worker.key[_secret]")
    p.set_defaults(func=_keys)



def worker_config(args) -> WorkerConfig:
    """The WorkerConfig of parsed `epd worker` arguments."""
    return WorkerConfig(model=args.model, role=args.role, api=args.api, host=args.host, port=args.port,
                        mm_cache_dir=args.mm_cache_dir, mm_cache_gb=args.mm_cache_gb,
                        max_image_pixels=args.max_image_pixels, max_image_bytes=args.max_image_bytes,
                        **video_limits(args), num_threads=args.threads,
                        cpu_sharing=args.cpu_sharing, worker_keys=args.worker_keys, engine=engine_config(args),
                        tokenizer=args.tokenizer, mm_processor_kwargs=tuple(
                            json_object("--mm-processor-kwargs", args.mm_processor_kwargs).items()),
                        report_kv_blocks=args.report_kv_blocks)


def _keys(args) -> int:
    from epd.transport.wire.auth import PlaneKeyError, make_keys

    try:
        directory = make_keys(args.dir)
    except PlaneKeyError as exc:
        print(f"epd keys: {exc}", file=sys.stderr)
        return 2
    print(f"worker-plane keys in {directory}:\n"
          f"  API host:     api.key_secret, api.key, worker.key   (epd serve ... --worker-keys DIR)\n"
          f"  worker hosts: worker.key_secret, worker.key, api.key (epd worker ... --worker-keys DIR)")
    return 0


def _worker(args) -> int:
    from epd.processes.threads import share_cores

    config = worker_config(args)
    share_cores(config.cpu_sharing, external=True)  # before the launcher's import loads torch (libgomp reads it)
    from epd.engine.spec.check import check_speculative_model
    from epd.inputs.model_files import ModelFiles
    from epd.processes.launcher import run_external_worker

    files = ModelFiles.open(config.model)  # a bad checkpoint: one line, exit 2, before any socket is bound
    config.engine.resolved_max_model_len(files.max_position_embeddings)
    check_speculative_model(config.engine.speculative_config, config.model, config.tokenizer, files.hf_config)
    return run_external_worker(config)
