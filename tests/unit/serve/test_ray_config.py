"""`epd serve --cluster ray` flags: parsed into RayConfig, bad ones refused with
a message naming the flag (no Ray needed: nothing starts)."""
from __future__ import annotations

import pytest

from epd.cli import build_parser, main, serve_config
from epd.processes.ray_config import RayConfig, parse_resources


def _config(model: str, *flags: str):
    return serve_config(build_parser().parse_args(["serve", model, *flags]))


def test_flags_become_per_role_resources(tiny_model):
    config = _config(tiny_model, "--cluster", "ray", "--ray-address", "10.0.0.1:6379",
                     "--encoder-resources", '{"CPU": 4, "epd_encoder_node": 1}', "--decode-resources", '{"GPU": 0.5}')
    assert config.ray == RayConfig(address="10.0.0.1:6379", encoder_resources=(("CPU", 4.0), ("epd_encoder_node", 1.0)),
                                   decode_resources=(("GPU", 0.5),))
    assert config.ray.resources("encoder") == {"CPU": 4.0, "epd_encoder_node": 1.0}
    assert config.ray.resources("decode") == {"GPU": 0.5}
    assert config.ray.resources("pd") == config.ray.resources("prefill") == {"CPU": 1.0}  # the default
    assert _config(tiny_model).ray is None  # the local launcher stays the default


@pytest.mark.parametrize("text, words", [("CPU=4", "JSON object"), ("[1]", "JSON object"), ("{}", "non-empty"),
                                          ('{"CPU": -1}', "non-negative"), ('{"GPU": "half"}', "non-negative")])
def test_bad_resources_name_the_flag(text, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_resources("--prefill-resources", text)
    assert "--prefill-resources" in str(info.value)


@pytest.mark.parametrize("flags, words", [
    (["--encoder-resources", '{"CPU": 1}'], "--encoder-resources need --cluster ray"),
    (["--ray-address", "10.0.0.1:6379"], "--ray-address need --cluster ray"),
    (["--cluster", "ray", "--decode-resources", "{"], "--decode-resources takes a JSON object"),
])
def test_cli_refuses_with_a_message(tiny_model, flags, words, capsys):
    assert main(["serve", tiny_model, *flags]) == 2
    assert f"epd serve: {words}" in capsys.readouterr().err


def test_ray_and_external_workers_exclude_each_other(tiny_model, tmp_path):
    from epd.transport.wire.auth import make_keys

    keys = make_keys(tmp_path / "keys")
    with pytest.raises(ValueError, match="drop --external-workers"):
        _config(tiny_model, "--cluster", "ray", "--external-workers", "--worker-keys", str(keys))


def test_an_absent_cluster_is_named_at_once():
    """ray.init would retry an address nobody answers for minutes; the launcher says so first."""
    pytest.importorskip("ray")
    from testkit.server import free_port

    from epd.processes.ray_cluster import _check_reachable

    address = f"127.0.0.1:{free_port()}"  # bound and closed again: nobody listens
    with pytest.raises(ValueError, match=f"--ray-address {address}: no Ray cluster answers there"):
        _check_reachable(address)
