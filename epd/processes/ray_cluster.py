"""`epd serve --cluster ray`: every worker in a Ray actor, placed by per-role
resources, supervised through Ray. Imported only with `--cluster ray`, so
Ray stays an optional extra (`pip install epd[ray]`).

Ray places, restarts and scales the processes; ZeroMQ stays the data plane.
Each actor runs exactly what `epd worker` runs: it binds its inbox on tcp on
its node's address, registers with the API's collector over CURVE with
`Ready` (transport/wire/auth.py), and reads its own node's embedding cache
(`<cache root>/node-<node ip>`), so across nodes embeddings travel inside
`EncodeDone` and KV inside `KVTransfer`, as between `epd worker` hosts.

`RaySupervisor` is a `Supervisor` (epd/processes/supervisor.py), as
`LocalSupervisor` is: the same interface, the same backoff and down retry.

How a worker is kept up. The actor's `run` method is the worker loop: it
returns only after Shutdown. Actors are created with Ray's `max_restarts=-1`
and `run` is called with `max_task_retries=0`, so when the worker's process
dies (a crash, a kill, its node lost) Ray restarts the actor (on any node
whose resources allow: a lost node's workers come back on the others) and
the pending `run` fails with `RayActorError`. `watch` sees that failure
within POLL_S, tells the orchestrator (`on_exit`, which routes around the
worker and recovers its requests), waits for the restarted actor (a `node`
call with `max_task_retries=-1` waits through Ray's restart) and calls `run`
again; the new process binds a new inbox and registers with `Ready` under
the same worker id, so the registry and router follow it to its new node.
A worker that exits more than `max_restarts` times within `restart_window_s`
is given up on and its role reported down, as the local launcher does: its
actor is killed, and every `down_retry_s` a fresh actor is created under the
same worker id (placed by Ray anew: a node that came back, or another).
Nothing here `sees_exit` at once: an actor on a lost node or behind a
partition is noticed by Ray late or never, so the registry judges Ray's
workers by their silence too.
"""
from __future__ import annotations

import asyncio
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

try:
    import ray
    from ray.exceptions import RayActorError, RayError
except ImportError:  # the CLI prints it as "epd serve: ..." and exits 2
    raise ValueError("--cluster ray needs Ray: pip install 'epd[ray]'") from None

from epd.config import ServeConfig
from epd.processes.ray_config import RayConfig
from epd.processes.worker_entry import WorkerLaunch, run_worker
from epd.processes.supervisor import POLL_S, SHUTDOWN_GRACE_S, ExitCallback, Supervisor
from epd.transport.wire.addresses import parse_worker_id, tcp_address, worker_id as make_worker_id
from epd.transport.wire.auth import API, WORKER, make_keys
from epd.transport.wire.roles import Role
from epd.transport.wire.worker_io import WorkerSpec

LOCAL_OBJECT_STORE_BYTES = 200 << 20  # a Ray we start ourselves moves no data: ZeroMQ does
CONNECT_TIMEOUT_S = 10.0
WAKE_TIMEOUT_S = 120.0  # a worker reported lost whose actor neither restarts nor answers: restart it by force
KEY_FILES = (f"{WORKER}.key_secret", f"{WORKER}.key", f"{API}.key")  # what a worker host needs


@dataclass(frozen=True)
class RayPlane:
    """What the launcher needs from a Ray cluster: where workers register, with which keys, who keeps them up."""

    collector: str  # tcp://<this node's address>:<worker port>, CURVE
    keys_dir: str  # the API's worker-plane keys
    supervisor: RaySupervisor


def start_ray_plane(config: ServeConfig, run_dir: str) -> RayPlane:
    """Joins the cluster at `config.ray.address` (or starts a local Ray), binds
    nothing yet: returns the collector address on this node and a supervisor
    whose actors will register there.

    Keys: with `--worker-keys DIR`, every node holds DIR (as for `epd worker`)
    and the actors read it there. Without, a fresh pair is made in the run
    directory and the worker's half travels to the actors as arguments, over
    Ray's own control plane (token-authenticated: RAY_AUTH_MODE=token)."""
    rc: RayConfig = config.ray
    if rc.address:
        _check_reachable(rc.address)
        ray.init(address=rc.address, namespace="epd", log_to_driver=True)
    else:
        # logical CPUs: at least what the workers ask for, encoders up to --encoders MAX included
        # (they share the cores as local workers do)
        wanted = sum(rc.resources(role).get("CPU", 0) for role, _ in config.mode_roles())
        if config.encoder_scaling is not None:
            extra = config.encoder_scaling.max_encoders - config.encoder_scaling.min_encoders
            wanted += extra * rc.resources(Role.ENCODER).get("CPU", 0)
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(wanted)), include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, namespace="epd", log_to_driver=True)
    node_ip = ray.util.get_node_ip_address()
    collector = tcp_address(node_ip, config.worker_port or config.port + 1)
    if config.worker_keys:
        keys_dir, shipped = config.worker_keys, None
    else:
        keys_dir = str(make_keys(os.path.join(run_dir, "plane-keys")))
        shipped = {name: (Path(keys_dir) / name).read_bytes() for name in KEY_FILES}
    cache_root = config.mm_cache_dir or os.path.join(tempfile.gettempdir(), "epd-mm-cache")

    def launch(role: Role, index: int) -> WorkerLaunch:
        resources = rc.resources(role)
        engine = config.engine
        if resources.get("GPU", 0) > 0:  # a fraction of a GPU: that share of --gpu-memory-utilization
            engine = replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization
                             * min(1.0, resources["GPU"]))
        spec = WorkerSpec(make_worker_id(role, index), role, inbox="", apis=(collector,), mm_cache_dir=cache_root,
                          mm_cache_bytes=config.mm_cache_bytes, keys_dir=config.worker_keys,
                          max_image_bytes=config.media.max_blob_bytes,
                          reports_kv_blocks=role.holds_kv and config.router == "cache_aware")
        return WorkerLaunch(spec, config.model, engine, max_image_pixels=config.media.max_image_pixels,
                            mm_processor_kwargs=config.files.mm_processor_kwargs, tokenizer=config.files.tokenizer,
                            num_threads=config.threads_per_worker or max(1, int(resources.get("CPU", 1))),
                            nice=config.worker_nice(role), decode_limits=config.media.decode_limits())

    supervisor = RaySupervisor(config.mode_roles(), launch, rc, shipped, max_restarts=config.limits.max_restarts,
                               restart_window_s=config.limits.restart_window_s,
                               down_retry_s=config.limits.down_retry_s)
    print(f"EPD: Ray cluster with {len(ray.nodes())} nodes; workers register at {collector}", flush=True)
    return RayPlane(collector, keys_dir, supervisor)


def _check_reachable(address: str) -> None:
    """A clear message for a cluster that is not there (ray.init would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and other forms Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ValueError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                         f"start one with `ray start --head`") from None


class WorkerActor:
    """One EPD worker in a Ray actor. `run` is `epd worker`: it returns after Shutdown."""

    def __init__(self, launch: WorkerLaunch, keys: dict[str, bytes] | None):
        self.launch = launch
        self.keys = keys

    def node(self) -> str:
        """This actor's node address (answers once a restarted actor is up)."""
        return ray.util.get_node_ip_address()

    def run(self) -> int:
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:  # a free port for the inbox, as `epd worker --port 0`
            s.bind((ip, 0))
            port = s.getsockname()[1]
        spec = self.launch.spec
        keys_dir = spec.keys_dir
        if self.keys is not None:  # the API's fresh keys: this node's copy, 0700 like `epd keys`
            keys_dir = tempfile.mkdtemp(prefix="epd-keys-")
            for name, data in self.keys.items():
                path = Path(keys_dir) / name
                path.write_bytes(data)
                path.chmod(0o600)
        # each node its own cache: never shared with another node's workers, even on one file system
        spec = replace(spec, inbox=tcp_address(ip, port), keys_dir=keys_dir,
                       mm_cache_dir=os.path.join(spec.mm_cache_dir, f"node-{ip}"))
        print(f"EPD worker {spec.worker_id}: inbox {spec.inbox} (CURVE), registering with {', '.join(spec.apis)}", flush=True)
        try:
            run_worker(replace(self.launch, spec=spec), spawned=False)
        finally:
            if self.keys is not None:
                shutil.rmtree(keys_dir, ignore_errors=True)
        return 0


class RaySupervisor(Supervisor):
    """The `Supervisor` interface over Ray actors (see the module docstring)."""

    def __init__(self, roles: list[tuple[Role, int]], launch: Callable[[Role, int], WorkerLaunch],
                 config: RayConfig, keys: dict[str, bytes] | None, max_restarts: int = 5,
                 restart_window_s: float = 60.0, down_retry_s: float = 30.0):
        super().__init__(max_restarts, restart_window_s, down_retry_s)
        self.initial = list(roles)
        self.launch = launch
        self.config = config
        self.keys = keys
        self.actors: dict[str, object] = {}  # worker id -> actor handle
        self.runs: dict[str, ray.ObjectRef] = {}  # worker id -> its running `run`
        self.waking: dict[str, ray.ObjectRef] = {}  # worker id -> `node` of a restarting actor
        self._waking_since: dict[str, float] = {}
        self._not_before: dict[str, float] = {}  # worker id -> when `run` may be called again (backoff)

    # ---------------------------------------------------------- interface

    def start(self) -> None:
        for role, index in self.initial:
            self._create(role, index)

    def add_worker(self, role: Role | str) -> str:
        """Starts one more worker of `role` (placed by Ray like the others); returns its worker id."""
        role = Role.parse(role)
        used = {parse_worker_id(w)[1] for w in self.actors if parse_worker_id(w)[0] == role}
        index = next(i for i in range(len(used) + 1) if i not in used)
        return self._create(role, index)

    def remove_worker(self, worker_id: str) -> None:
        """Stops `worker_id` for good: the actor is killed and never restarted.
        Like LocalSupervisor.remove_worker, the exit is not reported as a
        fault: the caller (the encoder pool) retired and drained the worker
        first and then tells the orchestrator to forget it."""
        actor = self.actors.pop(worker_id, None)
        if actor is None:
            raise KeyError(f"no worker {worker_id!r}")
        self.runs.pop(worker_id, None)
        self.waking.pop(worker_id, None)
        ray.kill(actor, no_restart=True)

    def all_alive(self) -> bool:
        """No worker's `run` has ended (start-up checks this)."""
        refs = list(self.runs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        for ref in done:
            worker_id = next(w for w, r in self.runs.items() if r == ref)
            print(f"EPD: worker {worker_id} ended during start-up: {_outcome(ref)[1]}", flush=True)
        return not done

    async def watch(self, on_exit: ExitCallback) -> None:
        while True:
            self._reap(on_exit)
            self._wake()
            await asyncio.sleep(POLL_S)

    def stop(self) -> None:
        """Lets workers told to stop (Shutdown) end, then kills every actor. Idempotent."""
        if self._stopping or not ray.is_initialized():
            return
        self._stopping = True
        refs = list(self.runs.values())
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_GRACE_S)
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except RayError:
                pass
        ray.shutdown()

    def sees_exit(self, worker_id: str) -> bool:
        """Never at once: Ray tells of an actor on a lost node late, of one behind a partition never."""
        return False

    # ----------------------------------------------------------- internals

    def _holds(self, worker_id: str) -> bool:
        return worker_id in self.actors

    def _start_again(self, worker_id: str) -> None:
        """A fresh actor for a worker given up on (the old one was killed for good)."""
        role, index = parse_worker_id(worker_id)
        self._create(role, index)

    def _create(self, role: Role, index: int) -> str:
        worker_id = make_worker_id(role, index)
        resources = self.config.resources(role)
        options = dict(num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources,
                       max_restarts=-1, max_task_retries=0)
        actor = ray.remote(WorkerActor).options(**options).remote(self.launch(role, index), self.keys)
        self.actors[worker_id] = actor
        self.runs[worker_id] = actor.run.remote()
        return worker_id

    def _reap(self, on_exit: ExitCallback) -> None:
        """Workers whose `run` ended: report, then wait for Ray's restart (or give up)."""
        refs = list(self.runs.values())
        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            worker_id = next(w for w, r in self.runs.items() if r == ref)
            del self.runs[worker_id]
            code, why = _outcome(ref)
            delay = self._exited(worker_id, code, f"ended ({why})", on_exit)
            if delay is None:
                ray.kill(self.actors[worker_id], no_restart=True)
                continue
            print(f"EPD: worker {worker_id} ended ({why}); Ray restarts it, `run` again in {delay:g} s",
                  flush=True)
            self._not_before[worker_id] = time.monotonic() + delay
            self._waking_since[worker_id] = time.monotonic()
            self.waking[worker_id] = self.actors[worker_id].node.options(max_task_retries=-1).remote()

    def _wake(self) -> None:
        """Restarted actors that answer: run their worker again."""
        refs = list(self.waking.values())
        if not refs:
            return
        for worker_id in list(self.waking):
            # Ray said "unavailable" but the actor lives on (a partition): its old `run` holds the
            # actor, so `node` never answers and the registry has it dead; a restart makes it register
            if time.monotonic() - self._waking_since[worker_id] > WAKE_TIMEOUT_S:
                print(f"EPD: worker {worker_id} did not come back in {WAKE_TIMEOUT_S:g} s: restarting its actor",
                      flush=True)
                self._waking_since[worker_id] = time.monotonic()
                ray.kill(self.actors[worker_id], no_restart=False)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            worker_id = next(w for w, r in self.waking.items() if r == ref)
            if time.monotonic() < self._not_before.get(worker_id, 0):
                continue
            del self.waking[worker_id]
            try:
                node = ray.get(ref)
            except RayError as exc:  # dead for good (or unreachable): try once more later
                print(f"EPD: worker {worker_id} not back yet: {type(exc).__name__}", flush=True)
                self.waking[worker_id] = self.actors[worker_id].node.options(max_task_retries=-1).remote()
                continue
            self._count_restart(worker_id)
            print(f"EPD: worker {worker_id} restarting on node {node}", flush=True)
            self.runs[worker_id] = self.actors[worker_id].run.remote()



def _outcome(ref: ray.ObjectRef) -> tuple[int | None, str]:
    """(exit code, why) of a finished `run`: 0 after Shutdown, 1 when the worker raised, None when its process died."""
    try:
        return ray.get(ref), "shut down"
    except RayActorError as exc:
        return None, f"its process or node died: {type(exc).__name__}"
    except RayError as exc:
        return 1, f"it failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
