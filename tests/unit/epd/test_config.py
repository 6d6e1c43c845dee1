"""The composed configs and how `epd serve` sizes its workers: threads,
priorities, GPUs and their memory."""
from __future__ import annotations

import os
import re

import pytest

from epd.cli import build_parser, serve_config, worker_config
from epd.config import SHARED_CPU_NICE, ServeConfig, WorkerConfig
from epd.engine.config import EngineConfig
from epd.engine.scheduler_config import SchedulerConfig
from epd.inputs.media import MediaConfig
from epd.inputs.model_files import ModelFilesConfig
from epd.processes.threads import API_CORES, available_cores, serve_api_cores, worker_threads
from epd.transport.wire.auth import make_keys
from epd.transport.wire.roles import Mode, Role


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> str:
    return str(make_keys(tmp_path_factory.mktemp("plane") / "keys"))


def test_flag_defaults_are_the_config_defaults(tiny_model, keys, monkeypatch):
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", tiny_model])) == ServeConfig(model=tiny_model)
    assert worker_config(parse(["worker", tiny_model, "--role", "pd", "--api", "tcp://10.0.0.1:8001",
                                "--worker-keys", keys])) == WorkerConfig(tiny_model, Role.PD, "tcp://10.0.0.1:8001",
                                                                         worker_keys=keys)
    # epd worker's --tokenizer and --mm-processor-kwargs, as epd serve's
    given = worker_config(parse(["worker", tiny_model, "--role", "encoder", "--api", "tcp://10.0.0.1:8001",
                                 "--worker-keys", keys, "--tokenizer", tiny_model,
                                 "--mm-processor-kwargs", '{"max_pixels": 4096}']))
    assert (given.tokenizer, given.mm_processor_kwargs) == (tiny_model, (("max_pixels", 4096),))
    with pytest.raises(ValueError, match="--tokenizer /nonexistent: not a directory"):
        WorkerConfig(tiny_model, Role.ENCODER, "tcp://10.0.0.1:8001", worker_keys=keys, tokenizer="/nonexistent")
    with pytest.raises(ValueError, match="--mm-processor-kwargs takes a JSON object"):
        parse_worker = parse(["worker", tiny_model, "--role", "pd", "--api", "tcp://10.0.0.1:8001",
                              "--worker-keys", keys, "--mm-processor-kwargs", "[1]"])
        worker_config(parse_worker)
    # the defaults themselves, written once on the fields
    config = ServeConfig(model=tiny_model)
    assert (config.mode, config.num_encoders, config.num_prefill, config.num_decode) == (Mode.E_P_D, 1, 1, 1)
    assert (config.host, config.port, config.mm_cache_gb, config.router, config.cpu_sharing) == \
        ("127.0.0.1", 8000, 4.0, "least_loaded", "shared")
    assert config.encoder_router == "cost"
    assert serve_config(parse(["serve", tiny_model, "--encoder-router", "round_robin"])).encoder_router == "round_robin"
    with pytest.raises(ValueError, match="--encoder-router must be one of cost, round_robin, got 'random'"):
        ServeConfig(model=tiny_model, encoder_router="random")
    assert config.media == MediaConfig(max_image_bytes=20 * 1024 * 1024, max_image_pixels=64_000_000,
                                       fetch_timeout_s=5.0)
    assert config.engine == EngineConfig(SchedulerConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=2048,
                                                         enable_prefix_caching=True, max_model_len=None),
                                         gpu_memory_utilization=0.9, dtype="auto", device="auto")
    worker = WorkerConfig(tiny_model, "encoder", "tcp://h:1", worker_keys=keys)
    assert (worker.port, worker.mm_cache_gb, worker.max_image_pixels) == (0, 4.0, 64_000_000)
    assert worker.media().decode_limits() == config.media.decode_limits()  # serve's default video limits


def test_epd_worker_takes_the_video_limits_epd_serve_takes(tiny_model, keys):
    video = ["--max-video-mb", "2", "--max-video-frames", "300", "--max-request-video-pixels", "5000000",
             "--video-decode-timeout", "7.5", "--max-image-pixels", "40000"]
    parse = build_parser().parse_args
    served = serve_config(parse(["serve", tiny_model, *video])).media
    worker = worker_config(parse(["worker", tiny_model, "--role", "encoder", "--api", "tcp://10.0.0.1:8001",
                                  "--worker-keys", keys, *video]))
    assert (worker.max_video_bytes, worker.max_video_frames, worker.max_request_video_pixels,
            worker.video_decode_timeout_s) == (2 << 20, 300, 5_000_000, 7.5)
    assert worker.media().decode_limits() == served.decode_limits()
    assert worker.media().max_blob_bytes == served.max_blob_bytes == max(2 << 20, served.max_image_bytes)
    with pytest.raises(ValueError, match="--video-decode-timeout must be positive"):
        worker_config(parse(["worker", tiny_model, "--role", "encoder", "--api", "tcp://10.0.0.1:8001",
                             "--worker-keys", keys, "--video-decode-timeout", "0"]))
    # --video-chunk-frames: the API's alone (it cuts the plan); 0, the default, keeps a video whole
    assert served.video_chunk_frames == 0
    assert serve_config(parse(["serve", tiny_model, "--video-chunk-frames", "16"])).media.video_chunk_frames == 16
    with pytest.raises(ValueError, match="--video-chunk-frames must be 0"):
        serve_config(parse(["serve", tiny_model, "--video-chunk-frames", "-2"]))


def test_checkpoint_file_flags_fill_the_model_files_config(tiny_model, tmp_path):
    parse = build_parser().parse_args
    assert ServeConfig(model=tiny_model).files == ModelFilesConfig(None, "auto", ())
    args = parse(["serve", tiny_model, "--chat-template", "t.jinja", "--generation-config", "vllm",
                  "--override-generation-config", '{"top_k": 3, "temperature": 0.5}'])
    assert serve_config(args).files == ModelFilesConfig("t.jinja", "vllm", (("temperature", 0.5), ("top_k", 3)))
    assert serve_config(parse(["serve", tiny_model, "--generation-config", str(tmp_path)])).files.generation_config \
        == str(tmp_path)
    with pytest.raises(ValueError, match="--override-generation-config is not valid JSON"):
        serve_config(parse(["serve", tiny_model, "--override-generation-config", "{temperature: 1}"]))
    with pytest.raises(ValueError, match="--generation-config takes auto, vllm or a directory, got 'hf'"):
        serve_config(parse(["serve", tiny_model, "--generation-config", "hf"]))


def test_engine_flags_fill_the_scheduler_inside_the_engine_config(tiny_model):
    args = build_parser().parse_args(["serve", tiny_model, "--max-num-seqs", "8", "--max-model-len", "512",
                                      "--no-enable-prefix-caching", "--device", "cpu", "--kv-cache-gb", "2"])
    assert serve_config(args).engine == EngineConfig(
        SchedulerConfig(max_num_seqs=8, max_model_len=512, enable_prefix_caching=False), kv_cache_gb=2.0, device="cpu")
    assert EngineConfig.from_flat(max_num_batched_tokens=64, dtype="float32") == \
        EngineConfig(SchedulerConfig(max_num_batched_tokens=64), dtype="float32")
    assert EngineConfig.from_flat() == EngineConfig()
    assert set(EngineConfig.flat_defaults()) == {
        "block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "max_model_len",
        "prefill_priority", "prefill_aging", "max_num_image_waits", "max_local_prefill_tokens",
        "num_kv_blocks", "kv_cache_gb", "gpu_memory_utilization", "dtype", "kv_cache_dtype", "device",
        "attention_backend",
        "early_prefill", "seed", "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
        "max_cpu_loras", "enable_tower_lora", "enforce_eager", "max_cudagraph_capture_size", "kv_events_config",
        "tensor_parallel_size"}
    args = build_parser().parse_args(["serve", tiny_model, "--no-early-prefill", "--prefill-priority", "fcfs"])
    engine = serve_config(args).engine
    assert (engine.early_prefill, engine.scheduler.prefill_priority) == (False, "fcfs")
    assert engine.scheduler.max_local_prefill_tokens == 512  # the default: conditional disaggregation on
    args = build_parser().parse_args(["serve", tiny_model, "--max-local-prefill-tokens", "0"])
    assert serve_config(args).engine.scheduler.max_local_prefill_tokens == 0
    with pytest.raises(ValueError, match="max_local_prefill_tokens must be non-negative"):
        EngineConfig.from_flat(max_local_prefill_tokens=-1)
    with pytest.raises(ValueError, match="prefill_priority must be one of fcfs, cost"):
        EngineConfig.from_flat(prefill_priority="sjf")
    with pytest.raises(TypeError, match="unknown engine setting.* max_num_sequences"):
        EngineConfig.from_flat(max_num_sequences=8)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig.from_flat(max_num_seqs=0)


def test_llm_takes_flat_settings_or_a_config_not_both(tiny_model):
    from epd.llm import LLM

    with pytest.raises(TypeError, match="not both"):
        LLM(tiny_model, EngineConfig(), max_num_seqs=8)
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(tiny_model, max_num_sequences=8)


def test_modes_and_roles_by_name(tiny_model, keys):
    config = ServeConfig(model=tiny_model, mode="e-pd", num_prefill=2)
    assert config.mode is Mode.E_PD and config.worker_roles() == [(Role.ENCODER, 0), (Role.PD, 0), (Role.PD, 1)]
    external = ServeConfig(model=tiny_model, mode="e-pd", num_encoders=0, num_prefill=2, external_workers=True,
                           worker_keys=keys)
    assert external.worker_roles() == [] and external.mode_roles() == [(Role.PD, 0), (Role.PD, 1)]
    with pytest.raises(ValueError, match="--mode must be one of aggregated, e-pd, e-p-d, got 'e-d'"):
        ServeConfig(model=tiny_model, mode="e-d")
    assert set(SHARED_CPU_NICE) == set(Role)


@pytest.mark.parametrize("change, message", [
    (dict(api="127.0.0.1:8001"), "--api must be a tcp:// address"),
    (dict(api="tcp://127.0.0.1"), "--api must be a tcp:// address"),
    (dict(role="vision"), "unknown role 'vision'"),
    (dict(port=70000), "--port must be in 0..65535"),
    (dict(model="/no/such/checkpoint"), "not a checkpoint directory"),
    (dict(worker_keys=None), "pass --worker-keys DIR"),
    (dict(worker_keys="/no/such/keys"), "cannot read worker-plane key /no/such/keys/api.key"),
])
def test_bad_worker_flags_are_clear_errors(tiny_model, keys, change, message):
    settings = dict(model=tiny_model, role="prefill", api="tcp://127.0.0.1:8001", worker_keys=keys) | change
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**settings)


def test_threads_leave_a_core_to_the_api_and_split_the_rest(tiny_model):
    cores = len(os.sched_getaffinity(0))
    free = max(1, cores - serve_api_cores(cores))
    split = ServeConfig(model=tiny_model, mode="e-p-d", num_encoders=2, cpu_sharing="split")
    assert split.threads_for_each_worker("encoder") == split.threads_for_each_worker("decode") == max(1, free // 4)
    assert {split.worker_nice(role) for role, _ in split.worker_roles()} == {0}
    shared = ServeConfig(model=tiny_model, mode="e-p-d", num_encoders=2)  # the default
    assert shared.threads_for_each_worker("prefill") == shared.threads_for_each_worker() == max(1, free // 2)
    assert shared.threads_for_each_worker("encoder") == free
    nice = {role: shared.worker_nice(role) for role, _ in shared.worker_roles()}
    assert nice["decode"] < nice["prefill"] < nice["encoder"]
    assert ServeConfig(model=tiny_model, mode="aggregated", cpu_sharing="shared").worker_nice("aggregated") == 0
    assert ServeConfig(model=tiny_model, threads_per_worker=3, cpu_sharing="shared").threads_for_each_worker() == 3


E_P_D = [Role.ENCODER, Role.PREFILL, Role.DECODE]


@pytest.mark.parametrize("roles, cores, sharing, expected", [
    # the machine: 2 cores, both for the workers (the API shares them: issue 32)
    ([Role.AGGREGATED], 2, "shared", {Role.AGGREGATED: 2}),
    (E_P_D, 2, "shared", {Role.ENCODER: 2, Role.PREFILL: 1, Role.DECODE: 1}),
    (E_P_D, 2, "split", {Role.ENCODER: 1, Role.PREFILL: 1, Role.DECODE: 1}),
    ([Role.AGGREGATED], 1, "shared", {Role.AGGREGATED: 1}),  # never fewer than one thread
    # 3 cores and up: one kept for the API
    ([Role.AGGREGATED], 3, "shared", {Role.AGGREGATED: 2}),
    # 16 cores: 15 for workers; shared splits them over the engine workers, encoders may use all
    ([Role.AGGREGATED, Role.AGGREGATED], 16, "shared", {Role.AGGREGATED: 7}),
    (E_P_D, 16, "shared", {Role.ENCODER: 15, Role.PREFILL: 7, Role.DECODE: 7}),
    (E_P_D, 16, "split", {Role.ENCODER: 5, Role.PREFILL: 5, Role.DECODE: 5}),
    ([Role.ENCODER, Role.PD, Role.PD], 9, "shared", {Role.ENCODER: 8, Role.PD: 4}),
])
def test_thread_rule(roles, cores, sharing, expected):
    api = serve_api_cores(cores)
    assert {role: worker_threads(role, roles, cores, sharing, api) for role in roles} == expected
    assert worker_threads(None, roles, cores, sharing, api) == min(expected[r] for r in roles if r.holds_kv)


def test_an_epd_worker_keeps_a_core_for_an_api_even_on_a_small_host():
    # it cannot know its neighbours: counted as the one worker of a host that also runs an API
    assert worker_threads(Role.DECODE, [Role.DECODE], 2, "shared") == 1
    assert (serve_api_cores(2), serve_api_cores(3), API_CORES) == (0, 1, 1)


def test_bad_sharing_is_refused(tiny_model):
    with pytest.raises(ValueError, match="--cpu-sharing must be one of split, shared"):
        ServeConfig(model=tiny_model, cpu_sharing="spread")


def _placement(config: ServeConfig, num_gpus: int) -> list[tuple[str, str, float]]:
    return [(f"{role}-{i}", e.device, round(e.gpu_memory_utilization, 3))
            for (role, i), e in zip(config.worker_roles(), config.worker_engines(num_gpus))]


def test_workers_on_one_gpu_split_its_memory(tiny_model):
    config = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(gpu_memory_utilization=0.9))
    assert _placement(config, 1) == [("encoder-0", "cuda:0", 0.9), ("prefill-0", "cuda:0", 0.45),
                                     ("decode-0", "cuda:0", 0.45)]
    aggregated = ServeConfig(model=tiny_model, mode="aggregated", num_prefill=2)
    assert _placement(aggregated, 1) == [("aggregated-0", "cuda:0", 0.45), ("aggregated-1", "cuda:0", 0.45)]


def test_workers_spread_over_gpus_kv_workers_first(tiny_model):
    config = ServeConfig(model=tiny_model, mode="e-p-d")
    assert _placement(config, 2) == [("encoder-0", "cuda:0", 0.9), ("prefill-0", "cuda:0", 0.9),
                                     ("decode-0", "cuda:1", 0.9)]
    assert [d for _, d, _ in _placement(config, 3)] == ["cuda:2", "cuda:0", "cuda:1"]
    e_pd = ServeConfig(model=tiny_model, mode="e-pd", num_prefill=3)
    assert _placement(e_pd, 2) == [("encoder-0", "cuda:1", 0.9), ("pd-0", "cuda:0", 0.45),
                                   ("pd-1", "cuda:1", 0.9), ("pd-2", "cuda:0", 0.45)]


def test_cpu_or_a_pinned_gpu_keeps_the_placement(tiny_model):
    on_cpu = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(device="cpu", early_prefill=True))
    assert on_cpu.worker_engines(4) == [on_cpu.engine] * 3
    auto_without_gpu = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(early_prefill=True))
    assert auto_without_gpu.worker_engines(0) == [auto_without_gpu.engine] * 3
    pinned = ServeConfig(model=tiny_model, mode="e-p-d", engine=EngineConfig(device="cuda:3"))
    assert _placement(pinned, 8) == [("encoder-0", "cuda:3", 0.9), ("prefill-0", "cuda:3", 0.45),
                                     ("decode-0", "cuda:3", 0.45)]


def test_external_workers_need_the_api_key_pair(tiny_model, keys, tmp_path):
    with pytest.raises(ValueError, match="--external-workers listens on tcp: pass --worker-keys DIR"):
        ServeConfig(model=tiny_model, external_workers=True)
    worker_host = tmp_path / "worker-host"  # what a worker host holds: no api.key_secret
    worker_host.mkdir()
    for name in ("api.key", "worker.key", "worker.key_secret"):
        (worker_host / name).write_bytes(open(f"{keys}/{name}", "rb").read())
    with pytest.raises(ValueError, match="api.key_secret"):
        ServeConfig(model=tiny_model, external_workers=True, worker_keys=str(worker_host))


def test_vllm_flags_fill_the_config_they_name(tiny_model):
    parse = build_parser().parse_args
    config = serve_config(parse([
        "serve", tiny_model, "--seed", "7", "--enable-prefix-caching", "--block-size", "32", "--dtype", "half",
        "--limit-mm-per-prompt", '{"image": 4, "video": 0}', "--api-server-count", "2", "--tokenizer", tiny_model,
        "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-logprobs", "5",
        "--mm-processor-kwargs", '{"max_pixels": 200704, "min_pixels": 3136}', "--enable-log-requests",
        "--disable-log-stats", "--uvicorn-log-level", "info", "--allowed-origins", '["https://a.example"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", "x-a, x-b", "--allow-credentials",
        "--enable-chunked-prefill"]))
    assert (config.engine.seed, config.engine.scheduler.enable_prefix_caching, config.engine.scheduler.block_size,
            config.engine.dtype) == (7, True, 32, "float16")
    assert (config.media.limit_images_per_prompt, config.media.limit_videos_per_prompt) == (4, 0)
    assert config.api_servers == 2
    assert config.files.tokenizer == tiny_model
    assert config.files.mm_processor_kwargs == (("max_pixels", 200704), ("min_pixels", 3136))
    assert (config.trust_remote_code, config.enable_auto_tool_choice, config.tool_call_parser) == (True, True, "hermes")
    assert (config.max_logprobs, config.enable_log_requests, config.disable_log_stats, config.uvicorn_log_level) == \
        (5, True, True, "info")
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers, config.allow_credentials) == \
        (("https://a.example",), ("GET", "POST"), ("x-a", "x-b"), True)
    assert config.enable_chunked_prefill is True
    # EPD's own names and forms keep working
    config = serve_config(parse(["serve", tiny_model, "--no-enable-prefix-caching", "--api-servers", "3",
                                 "--limit-mm-per-prompt", "image=2", "--dtype", "float"]))
    assert (config.engine.scheduler.enable_prefix_caching, config.api_servers, config.engine.dtype) == \
        (False, 3, "float32")
    assert (config.media.limit_images_per_prompt, config.media.limit_videos_per_prompt) == (2, 1)  # video: default
    assert EngineConfig(dtype="bf16").dtype == "bfloat16"  # LLM(dtype="bf16") as before
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, float16, bfloat16"):
        EngineConfig(dtype="int8")
    # the defaults: vLLM's where EPD can, else EPD's (docs/decisions/vllm-serve-flags.md)
    config = serve_config(parse(["serve", tiny_model]))
    assert (config.engine.seed, config.max_logprobs, config.uvicorn_log_level, config.allowed_origins) == \
        (0, 20, "warning", ())
    assert config.engine.scheduler.block_size == 16 and config.files.mm_processor_kwargs == ()


@pytest.mark.parametrize("flags, message", [
    (["--limit-mm-per-prompt", '{"image": 2, "video": -1}'], "video must be a count"),
    (["--limit-mm-per-prompt", '{"speech": 1}'], "EPD serves image, video, audio, not speech"),
    (["--limit-mm-per-prompt", '{"image": -1}'], "image must be a count"),
    (["--limit-mm-per-prompt", "images=2"], None),
    (["--tool-call-parser", "mistral"], "with the parsers hermes, pythonic, glm45"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser (as in vLLM): "
                                    "--tool-call-parser hermes for Qwen3-VL"),  # the family's parser
    (["--no-enable-chunked-prefill"], "EPD always prefills in chunks"),
    (["--max-logprobs", "21"], "--max-logprobs must be in 0..20"),
    (["--mm-processor-kwargs", '{"size_divisor": 2}'],
     "size_divisor cannot be applied here; the image processor takes min_pixels"),
    (["--mm-processor-kwargs", '{"fps": 0}'], "--mm-processor-kwargs: fps must be a positive number"),
    (["--mm-processor-kwargs", '{"min_pixels": 9000, "max_pixels": 100}'], "min_pixels 9000 is more than"),
    (["--mm-processor-kwargs", "[1]"], "--mm-processor-kwargs takes a JSON object"),
    (["--tokenizer", "/no/such/dir"], "--tokenizer takes a directory"),
    (["--allowed-origins", '["a", 1]'], "--allowed-origins must be a list of strings"),
])
def test_vllm_flags_refuse_what_epd_cannot_do(tiny_model, flags, message):
    with pytest.raises(ValueError, match=re.escape(message) if message else "--limit-mm-per-prompt"):
        serve_config(build_parser().parse_args(["serve", tiny_model, *flags]))


def test_serve_help_describes_every_flag_with_its_default(capsys):
    from epd.cli import HelpFormatter

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    formatter = HelpFormatter("epd serve")
    flags = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 70
    assert [a.option_strings for a in flags if not a.help] == []
    assert [a.option_strings for a in flags if "default" not in formatter._get_help_string(a)] == []
    serve.print_help()
    text = capsys.readouterr().out
    assert "--api-server-count" in text and "(default: 0)" in text  # --seed's
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    import tomllib
    from pathlib import Path

    from epd import __version__

    assert capsys.readouterr().out.strip() == f"epd {__version__}"
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == __version__


def test_accepted_flags_say_what_they_do_here(tiny_model):
    from epd.cli import accepted_flag_notes

    config = serve_config(build_parser().parse_args([
        "serve", tiny_model, "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-stats",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    notes = accepted_flag_notes(config)
    assert len(notes) == 4
    assert any("never runs code from a checkpoint" in n for n in notes)
    assert any("always prefills in chunks of at most --max-num-batched-tokens (2048)" in n for n in notes)
    assert accepted_flag_notes(serve_config(build_parser().parse_args(["serve", tiny_model]))) == []


def test_seed_is_what_unseeded_requests_sample_from(tiny_model):
    """--seed (EngineConfig.seed, vLLM's): the same seed, the same unseeded samples, whatever
    drew from torch's generator before the engine was built; another seed, other samples."""
    import torch

    from epd.llm import LLM
    from epd.transport.wire.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=12)  # no seed of its own

    def sample(seed: int, before: int) -> list[int]:
        torch.manual_seed(before)
        llm = LLM(tiny_model, device="cpu", dtype="float32", num_kv_blocks=32, seed=seed)
        return llm.generate(["a b c d"], params)[0].outputs[0].token_ids

    assert sample(3, before=1) == sample(3, before=2)
    assert sample(3, before=1) != sample(4, before=1)


@pytest.mark.parametrize("mode, settings, expected", [
    ("e-p-d", {}, [None, 0, 1]),  # encoder, prefill, decode: the engine workers lend cores (the default)
    ("e-p-d", {"core_lease": False}, [None, None, None]),  # --no-core-lease
    ("e-pd", {"num_prefill": 2, "core_lease": True}, [None, 0, 1]),  # encoder, pd, pd
    ("e-p-d", {"threads_per_worker": 1, "core_lease": True}, [None, None, None]),  # a fixed count wins
    ("e-p-d", {"cpu_sharing": "split", "core_lease": True}, [None, None, None]),
    ("aggregated", {"core_lease": True}, [None]),  # one engine worker: nobody to lend to
])
def test_the_engine_workers_of_a_cpu_deployment_share_a_core_lease(tiny_model, tmp_path, mode, settings,
                                                                   expected):
    from epd.processes.worker_launches import worker_launches
    from epd.transport.wire.addresses import Addresses

    config = ServeConfig(model=tiny_model, mode=mode, **settings)
    launches = worker_launches(config, Addresses.ipc(tmp_path), ("ipc://collector",), str(tmp_path / "mm"))
    shares = [launch.core_share for launch in launches]
    assert [None if s is None else s.slot for s in shares] == expected
    leased = [s for s in shares if s is not None]
    assert len({s.path for s in leased}) <= 1
    cores = available_cores()
    assert all(s.num_cores == max(1, cores - serve_api_cores(cores)) for s in leased)  # the API's core kept


def test_early_prefill_is_off_by_default_where_an_encoder_shares_the_cpus(tiny_model):
    """On CPU with shared cores an encoder runs on every core a prefill started early would use
    (issue 32: it only slowed the encoder's forward); the flag, split cores, a GPU or aggregated
    mode (no encoder) leave it on."""
    def early(argv, num_gpus=0):
        config = serve_config(build_parser().parse_args(["serve", tiny_model, *argv]))
        return {e.early_prefill is not False for e in config.worker_engines(num_gpus)}

    assert early(["--mode", "e-p-d", "--device", "cpu"]) == {False}
    assert early(["--mode", "e-pd", "--device", "cpu"]) == {False}
    assert early(["--mode", "e-p-d", "--device", "cpu", "--early-prefill"]) == {True}
    assert early(["--mode", "e-p-d", "--device", "cpu", "--cpu-sharing", "split"]) == {True}
    assert early(["--mode", "e-p-d", "--device", "auto"], num_gpus=1) == {True}
    assert early(["--mode", "aggregated", "--device", "cpu"]) == {True}


def test_max_request_worker_deaths_bounds_a_poison_request(tiny_model):
    """--max-request-worker-deaths (docs/decisions/poison-requests.md): 2 by default, at least 1."""
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", tiny_model])).limits.max_request_worker_deaths == 2
    assert serve_config(parse(["serve", tiny_model, "--max-request-worker-deaths", "3"])) \
        .limits.max_request_worker_deaths == 3
    with pytest.raises(ValueError, match="--max-request-worker-deaths must be at least 1, got 0"):
        serve_config(parse(["serve", tiny_model, "--max-request-worker-deaths", "0"]))


def test_auto_tool_choice_without_a_parser_lists_them_when_the_family_names_none(tmp_path):
    """The family's parser is suggested (above); a directory of no known family gets the list."""
    with pytest.raises(ValueError, match=re.escape("--tool-call-parser one of hermes, pythonic, glm45")):
        ServeConfig(model=str(tmp_path), enable_auto_tool_choice=True)


def test_auto_tool_choice_without_a_parser_names_hermes_for_internvl(tmp_path):
    """InternVL's language model (Qwen3, Qwen2) writes Qwen's <tool_call> blocks: vLLM's hermes."""
    from testkit.family_checkpoints import config_only_checkpoint

    model = config_only_checkpoint(tmp_path, {"model_type": "internvl",
                                              "architectures": ["InternVLForConditionalGeneration"]})
    with pytest.raises(ValueError, match=re.escape("--tool-call-parser hermes for InternVL")):
        ServeConfig(model=model, enable_auto_tool_choice=True)


def test_auto_tool_choice_without_a_parser_names_qwen3_coder_for_qwen3_5(tmp_path):
    """Qwen3.5's chat template writes <function=...>/<parameter=...> calls: vLLM's qwen3_coder."""
    from testkit.family_checkpoints import config_only_checkpoint

    model = config_only_checkpoint(tmp_path, {"model_type": "qwen3_5",
                                              "architectures": ["Qwen3_5ForConditionalGeneration"]})
    with pytest.raises(ValueError, match=re.escape("--tool-call-parser qwen3_coder for Qwen3.5")):
        ServeConfig(model=model, enable_auto_tool_choice=True)
