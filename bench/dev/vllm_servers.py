"""The vLLM servers `python -m bench.dev.vs_vllm` starts: `vllm serve`, and vLLM's own encoder disaggregation.

`VllmProcess` is one `vllm serve` from vLLM's environment. `VllmEcPeer` is
vLLM's 1E + 1PD deployment (label "vllm-ec"): two `vllm serve` instances of
the checkpoint with `--ec-transfer-config` naming `ECExampleConnector` (the
encoder instance `ec_producer`, which in vLLM 0.32 runs the vision tower only
and holds no KV cache; the prefill-decode instance `ec_consumer`), sharing
one `shared_storage_path` for the embeddings, and our proxy
(bench/dev/vllm_ec_proxy.py) in front. Every process is pinned to the same CPUs
as the other servers, and each vLLM instance gets the same KV budget
(`VLLM_CPU_KVCACHE_SPACE`).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from bench.dev.checkout import checkout_env, python_m
from epd.bench.compare import ServeProcess

EC_CONNECTOR = "ECExampleConnector"


class VllmProcess(ServeProcess):
    """`vllm serve MODEL` on a free port, pinned to `cpus` like EPD's servers."""

    name = "vllm serve"

    def __init__(self, vllm_bin: str, model: str, cpus, extra: list[str], log_path: Path, kv_cache_gib: int):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        self._launch(lambda port: [vllm_bin, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                                   "--dtype", "float32", *extra], cpus, log_path, env=env)


class ProxyProcess(ServeProcess):
    """`python -m bench.dev.vllm_ec_proxy` on a free port in front of an encoder and a PD instance."""

    name = "vllm-ec proxy"

    def __init__(self, encoder_url: str, pd_url: str, cpus, log_path: Path):
        self._launch(lambda port: [*python_m("vllm_ec_proxy"), "--encoder-url", encoder_url,
                                   "--pd-url", pd_url, "--port", str(port)], cpus, log_path, env=checkout_env())


def ec_transfer_config(role: str, storage_path: Path) -> str:
    """`--ec-transfer-config`'s JSON for `role` ("ec_producer" or "ec_consumer")."""
    return json.dumps({"ec_connector": EC_CONNECTOR, "ec_role": role,
                       "ec_connector_extra_config": {"shared_storage_path": str(storage_path)}})


class VllmEcPeer:
    """vLLM's encoder disaggregation behind one URL, used like a `ServeProcess` (`base_url`,
    `started_s`, `wait_ready`, `stop`). Both instances start at once, as a deployment
    script would start them; the proxy starts once both are ready. `storage_path` is emptied
    first: embeddings left from an earlier run would be loaded, not encoded."""

    name = "vllm-ec"

    def __init__(self, vllm_bin: str, model: str, cpus, extra: list[str], log_dir: Path, kv_cache_gib: int,
                 storage_path: Path):
        self.cpus, self.log_dir = cpus, log_dir
        shutil.rmtree(storage_path, ignore_errors=True)
        storage_path.mkdir(parents=True)
        self.started_s = time.monotonic()
        self.processes: list[ServeProcess] = []
        try:
            for role, part in (("ec_producer", "encoder"), ("ec_consumer", "pd")):
                flags = [*extra, "--ec-transfer-config", ec_transfer_config(role, storage_path)]
                self.processes.append(VllmProcess(vllm_bin, model, cpus, flags, log_dir / f"server-vllm-ec-{part}.log",
                                                  kv_cache_gib))
        except BaseException:
            self.stop()
            raise
        self.encoder, self.pd = self.processes
        self.proxy: ProxyProcess | None = None

    @property
    def base_url(self) -> str:
        assert self.proxy is not None, "wait_ready first"
        return self.proxy.base_url

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        """The served model name, once both instances and then the proxy answer."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.wait_ready(max(1.0, deadline - time.monotonic()))
        self.proxy = ProxyProcess(self.encoder.base_url, self.pd.base_url, self.cpus,
                                  self.log_dir / "server-vllm-ec-proxy.log")
        self.processes.append(self.proxy)
        return self.proxy.wait_ready(max(60.0, deadline - time.monotonic()))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
