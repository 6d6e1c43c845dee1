"""A follower rank (1..N-1) of a tensor-parallel group: its shard of the model, its KV cache, a loop.

Started by rank 0 (leader.py) as `python -m epd.engine.parallel.follower SPEC_JSON`. It loads only
its slices of the checkpoint, says so in the group's store, meets the others (comm.py), then runs
what rank 0 sends (step_channel.py): "setup" (its KV cache: the same blocks as rank 0's, its own
heads), "forward" (the step's forward on its shard), "logits" (its part of the head's gather),
"read_kv" / "write_kv" (its heads of blocks handed over), "stop". It has no scheduler, sampler or sockets to the rest of EPD: rank 0 speaks for the group.
It exits when rank 0 is gone (its parent changed) or a collective fails.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

POLL_MS = 500  # how often an idle follower looks whether rank 0 is still there


@dataclass(frozen=True)
class FollowerSpec:
    model_dir: str
    run_dir: str
    rank: int
    size: int
    dtype: str  # "float32", ...
    timeout_s: float  # every collective's deadline
    startup_timeout_s: float
    num_threads: int

    def to_argv(self) -> list[str]:
        return [sys.executable, "-m", "epd.engine.parallel.follower", json.dumps(asdict(self))]


def loaded_key(rank: int) -> str:
    return f"loaded/{rank}"


def load_shard(model_dir: str, dtype: torch.dtype, shard):
    """This rank's shard of the checkpoint's language model, filled and packed."""
    from epd.engine.layers.mlp import pack_cpu_linears
    from epd.families.registry import family_of, load_hf_config

    hf_config = load_hf_config(model_dir)
    model = family_of(hf_config).load_text_shard(model_dir, hf_config, dtype, "cpu", shard)
    pack_cpu_linears(model)
    return model


@torch.inference_mode()
def run_follower(spec: FollowerSpec) -> None:
    from epd.engine.attention import get_backend
    from epd.engine.models.causal_lm import num_kv_layers
    from epd.engine.parallel import shm_allreduce
    from epd.engine.parallel.comm import GroupComm, GroupFailed, open_store
    from epd.engine.parallel.forward_inputs import forward_batch
    from epd.engine.parallel.shard import Shard
    from epd.engine.parallel.step_channel import StepReceiver

    parent = os.getppid()
    torch.set_num_threads(spec.num_threads)
    shard = Shard(spec.rank, spec.size)
    model = load_shard(spec.model_dir, getattr(torch, spec.dtype), shard)
    steps = StepReceiver(spec.run_dir, spec.rank)
    store = open_store(spec.run_dir, spec.size, spec.startup_timeout_s)
    store.set(loaded_key(spec.rank), "1")
    shard.comm = GroupComm.connect(store, spec.rank, spec.size, spec.timeout_s)

    def watch() -> None:
        if os.getppid() != parent:
            raise GroupFailed(f"tensor-parallel rank {spec.rank}: rank 0 is gone")

    shard.comm.shm = shm_allreduce.ShmAllReduce(shm_allreduce.shm_path(spec.run_dir), spec.rank, spec.size,
                                                shm_allreduce.SLOT_BYTES, spec.timeout_s, watch=watch)
    shard.comm.barrier()  # every rank has mapped the shared file: rank 0 unlinks it
    backend, kv, kv_caches = None, None, []
    while True:
        step = steps.recv(POLL_MS)
        if step is None:
            if os.getppid() != parent:  # rank 0 is gone
                return
            continue
        if step.op == "stop":
            return
        if step.op == "setup":  # the KV cache: rank 0's blocks, this rank's heads
            cfg = model.cfg
            backend = get_backend(step.values["attention_backend"])
            kv = torch.zeros(2, num_kv_layers(model), step.values["num_blocks"], step.values["block_size"],
                             cfg.num_kv_heads, cfg.head_dim, dtype=model.model.embed_tokens.weight.dtype)
            kv_caches = [(kv[0, i], kv[1, i]) for i in range(kv.shape[1])]
            backend.prepare(kv_caches[0][0], cfg.num_heads)
        elif step.op == "forward":
            input_ids, batch = forward_batch(step, backend, kv_caches, "cpu")
            model(input_ids, batch)  # its hidden states: rank 0 sends the rows it wants logits of
        elif step.op == "logits":
            model.compute_logits(step.tensors["hidden"])
        elif step.op == "read_kv":  # this rank's heads of the blocks, to rank 0 (leader.py gather_kv)
            index = torch.tensor(step.values["block_ids"], dtype=torch.long)
            shard.comm.gather(torch.stack((kv[0][:, index], kv[1][:, index])).contiguous())
        elif step.op == "write_kv":  # every head's K/V of the blocks: this rank's heads kept
            index = torch.tensor(step.values["block_ids"], dtype=torch.long)
            first, count = shard.kv_heads(step.tensors["k"].shape[-2])
            kv[0][:, index] = step.tensors["k"][..., first:first + count, :].to(kv.dtype)
            kv[1][:, index] = step.tensors["v"][..., first:first + count, :].to(kv.dtype)
        else:
            raise RuntimeError(f"tensor-parallel rank {spec.rank}: unknown step {step.op!r}")


def main(argv: list[str]) -> int:
    spec = FollowerSpec(**json.loads(argv[0]))
    try:
        run_follower(spec)
    except Exception as exc:  # the group fails with it: rank 0's next collective names this rank
        print(f"tensor-parallel rank {spec.rank} of {spec.size} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
