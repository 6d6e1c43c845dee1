"""`epd serve`'s LoRA flags (issue 28): vLLM's names and defaults, and a bad
adapter refused with its reason before any process starts."""
from __future__ import annotations

from testkit.lora_adapters import make_adapter

from epd.cli import build_parser, main, serve_config
from epd.engine.lora.config import LoRAConfig
from epd.lora_modules import LoRAModule


def test_the_lora_flags_fill_the_engine_config(tiny_model, monkeypatch):
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", tiny_model])).engine.lora == LoRAConfig(False, 1, 16, None)  # vLLM's
    config = serve_config(parse(["serve", tiny_model, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                                 "--max-cpu-loras", "8", "--lora-modules", "a=/x/a",
                                 '{"name": "b", "path": "/x/b", "base_model_name": "base"}']))
    assert config.engine.lora == LoRAConfig(True, 4, 64, 8)
    assert config.lora_modules == (LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b", "base"))
    assert not config.allow_runtime_lora_updating  # vLLM's default (its env var unset)
    assert serve_config(parse(["serve", tiny_model, "--enable-lora", "--allow-runtime-lora-updating"])
                        ).allow_runtime_lora_updating


def test_serve_refuses_bad_lora_settings_before_any_process_starts(tiny_model, tmp_path, capsys):
    adapter = make_adapter(tiny_model, tmp_path / "big", r=16)
    cases = [(["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"big={adapter}"],
              "r = 16 is above --max-lora-rank 8"),
             (["--lora-modules", f"big={adapter}"], "--lora-modules needs --enable-lora"),
             (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
             (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
              "max_cpu_loras (1) must be at least max_loras (2)"),
             (["--enable-lora", "--lora-modules", f"big={tmp_path}"], "no adapter_config.json")]
    for flags, message in cases:
        assert main(["serve", tiny_model, *flags]) == 2
        assert message in capsys.readouterr().err


def test_enable_tower_lora_in_serve_and_worker(tiny_model, tmp_path, monkeypatch, capsys):
    from epd.cli import worker_config
    from epd.transport.wire.auth import make_keys

    monkeypatch.delenv("EPD_API_KEY", raising=False)
    parse = build_parser().parse_args
    config = serve_config(parse(["serve", tiny_model, "--enable-lora", "--enable-tower-lora"]))
    assert config.engine.lora == LoRAConfig(True, 1, 16, None, enable_tower_lora=True)
    # vLLM's experimental name for it is the same flag
    assert serve_config(parse(["serve", tiny_model, "--enable-lora", "--enable-tower-connector-lora"])
                        ).engine.lora.enable_tower_lora
    keys = str(make_keys(tmp_path / "keys"))
    worker = worker_config(parse(["worker", tiny_model, "--role", "encoder", "--api", "tcp://10.0.0.1:8001",
                                  "--worker-keys", keys, "--enable-lora", "--enable-tower-lora", "--max-loras", "2"]))
    assert worker.engine.lora == LoRAConfig(True, 2, 16, None, enable_tower_lora=True)
    assert main(["serve", tiny_model, "--enable-tower-lora"]) == 2
    assert "needs enable_lora (--enable-lora)" in capsys.readouterr().err


def test_serve_checks_an_adapters_tower_weights_with_enable_tower_lora(tiny_model, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    adapter = make_adapter(tiny_model, tmp_path / "vit", ("qkv", "q_proj"), r=4)
    tensors = load_file(f"{adapter}/adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("blocks.0.attn.qkv.lora_B.weight"))
    save_file({**tensors, key: torch.zeros(7, 4)}, f"{adapter}/adapter_model.safetensors")  # another tower
    assert main(["serve", tiny_model, "--enable-lora", "--enable-tower-lora", "--lora-modules", f"vit={adapter}"]) == 2
    assert "blocks.0.attn.qkv.lora_B.weight' has shape [7, 4]" in capsys.readouterr().err
