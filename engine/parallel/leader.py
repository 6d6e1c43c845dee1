"""Rank 0 of a tensor-parallel group: the language model the rest of the engine holds.

`start_group` starts ranks 1..N-1 (follower.py, one process each), loads rank 0's
shard, waits until every follower has loaded its own (watching that none died),
and meets them (comm.py). What it returns, a `TensorParallelLM`, is a `CausalLM`
(engine/models/causal_lm.py) to the runner: its `cfg` has this rank's head counts
(the KV cache holds this rank's heads; the block table is rank 0's and the same
for all), and its `forward` and `compute_logits` first send the followers the
same call (forward_inputs.py over step_channel.py), then run rank 0's shard; the
collectives inside the layers (layers.py) join the ranks. The scheduler, block
manager, sampler and worker plane never know there is a group.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import weakref

import torch
from torch import nn

from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.parallel import shm_allreduce
from epd.engine.parallel.comm import GroupComm, GroupFailed, open_store, wait_for
from epd.engine.parallel.follower import FollowerSpec, load_shard, loaded_key
from epd.engine.parallel.forward_inputs import forward_step
from epd.engine.parallel.shard import Shard, TensorParallelError
from epd.engine.parallel.step_channel import Step, StepSender, StepTimeout

COLLECTIVE_TIMEOUT_S = 60.0  # a collective's deadline: one layer's work on the slowest rank, with a wide margin
STARTUP_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint


def check_supported(config, device: str) -> None:
    """TensorParallelError naming what this step of tensor parallelism does not serve yet."""
    size = config.tensor_parallel_size
    refused = []
    if not device.startswith("cpu"):
        refused.append(f"device {device} (CPU with gloo only so far)")
    if config.lora.enable_lora:
        refused.append("--enable-lora")
    if config.speculative_config is not None:
        refused.append("--speculative-config")
    if config.kv_cache_dtype != "auto":
        refused.append(f"--kv-cache-dtype {config.kv_cache_dtype}")
    if refused:
        raise TensorParallelError(f"--tensor-parallel-size {size} does not serve " + "; ".join(refused) + " yet")


class TensorParallelLM(nn.Module):
    """Rank 0's shard, with the followers run in step with it."""

    def __init__(self, local: nn.Module, shard: Shard, num_kv_heads: int, sender: StepSender,
                 followers: list[subprocess.Popen], run_dir: str):
        """`num_kv_heads`: the whole model's (what the KV hand-over carries)."""
        super().__init__()
        self.local, self.shard, self.comm = local, shard, shard.comm
        self.handover_kv_heads = num_kv_heads  # the runner's block_shape: what KVTransfer carries
        self.cfg, self.positions, self.model = local.cfg, local.positions, local.model
        self.bidirectional_mm = getattr(local, "bidirectional_mm", False)
        self.sender, self.followers = sender, followers
        self._close = weakref.finalize(self, _stop, sender, followers, run_dir)

    def setup(self, num_blocks: int, block_size: int, attention_backend: str) -> None:
        """The followers' KV caches: `num_blocks` blocks of `block_size`, as rank 0's."""
        self._send(Step("setup", {"num_blocks": num_blocks, "block_size": block_size,
                                  "attention_backend": attention_backend}))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        self._send(forward_step(input_ids, batch))
        return self.local(input_ids, batch)

    def forward_with_aux(self, input_ids, batch, aux_layer_ids):
        raise TensorParallelError("an EAGLE-3 or MTP head with --tensor-parallel-size > 1 is not served yet")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_samples, hidden] -> logits [num_samples, vocab] (float32), gathered from every rank."""
        self._send(Step("logits", tensors={"hidden": hidden}))
        return self.local.compute_logits(hidden)

    # -- the KV hand-over: the wire carries every K/V head, each rank holds its own ----------------

    def gather_kv(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's K/V of `block_ids` ([num_layers, n, block_size, its heads, head_dim] each) -> every
        head's, from the ranks that hold them (the followers read theirs on the same call)."""
        self._send(Step("read_kv", {"block_ids": block_ids}))
        runs = self.comm.gather(torch.stack((k, v)).contiguous())  # [2, L, n, bs, local heads, D] each
        whole = torch.cat([runs[rank] for rank, _, _ in self.shard.holders(self.handover_kv_heads)], dim=-2)
        return whole[0], whole[1]

    def scatter_kv(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's K/V of `block_ids` -> rank 0's heads of it (the followers write theirs)."""
        self._send(Step("write_kv", {"block_ids": block_ids}, {"k": k, "v": v}))
        first, count = self.shard.kv_heads(self.handover_kv_heads)
        return k[..., first:first + count, :], v[..., first:first + count, :]

    def _send(self, step: Step) -> None:
        check_followers(self.followers)
        try:
            self.sender.send(step)
        except StepTimeout as exc:
            raise GroupFailed(str(exc)) from None

    def close(self) -> None:
        """Stops the followers (also done when this object is collected or the process exits)."""
        self._close()


def check_followers(followers: list[subprocess.Popen]) -> None:
    """GroupFailed naming the first follower that has exited."""
    for rank, proc in enumerate(followers, start=1):
        code = proc.poll()
        if code is not None:
            raise GroupFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")


def start_group(model_dir: str, dtype: torch.dtype, size: int, num_kv_heads: int, num_threads: int | None = None,
                timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallelLM:
    """Ranks 1..size-1 started, rank 0's shard loaded, the group met: rank 0's model.
    `num_kv_heads`: the whole model's K/V heads."""
    run_dir = tempfile.mkdtemp(prefix="epd-tp-")
    threads = num_threads or torch.get_num_threads()
    specs = [FollowerSpec(str(model_dir), run_dir, rank, size, str(dtype).removeprefix("torch."), timeout_s,
                          STARTUP_TIMEOUT_S, threads) for rank in range(1, size)]
    shm_allreduce.create(run_dir, size, shm_allreduce.SLOT_BYTES)  # before the followers map it
    sender = StepSender(run_dir, size, timeout_s)
    followers = [subprocess.Popen(spec.to_argv(), env={**os.environ, "PYTHONUNBUFFERED": "1"}) for spec in specs]
    try:
        shard = Shard(0, size)
        local = load_shard(str(model_dir), dtype, shard)
        store = open_store(run_dir, size, STARTUP_TIMEOUT_S)

        def all_loaded() -> bool:
            check_followers(followers)
            return store.check([loaded_key(r) for r in range(1, size)])

        wait_for(all_loaded, STARTUP_TIMEOUT_S, f"loading the {size - 1} other tensor-parallel ranks")
        shard.comm = GroupComm.connect(store, 0, size, timeout_s)
        shard.comm.shm = shm_allreduce.ShmAllReduce(shm_allreduce.shm_path(run_dir), 0, size,
                                                    shm_allreduce.SLOT_BYTES, timeout_s,
                                                    watch=lambda: check_followers(followers))
        shard.comm.barrier()  # every rank has mapped the shared file: nothing of it is left on disk
        shm_allreduce.shm_path(run_dir).unlink()
    except BaseException:
        _stop(sender, followers, run_dir)
        raise
    return TensorParallelLM(local, shard, num_kv_heads, sender, followers, run_dir)


def _stop(sender: StepSender, followers: list[subprocess.Popen], run_dir: str) -> None:
    try:
        sender.send_stop()
    finally:
        sender.close()
    for proc in followers:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shm_allreduce.shm_path(run_dir).unlink(missing_ok=True)
    shutil.rmtree(run_dir, ignore_errors=True)
