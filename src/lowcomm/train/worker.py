"""One worker process of a ``lowcomm train`` job: set up from its environment, train, tear down.

:func:`run_worker` is what every launcher of :mod:`lowcomm.train.launcher` runs in each worker
process: it reads torch elastic's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``...), picks the device and backend, configures logging, joins
the process group with a bounded collective timeout, runs :func:`lowcomm.train.loop.train`, and
records an exception for the launcher (:mod:`lowcomm.train.failures`) before it propagates.

Where the workers of a machine compute, and over which backend, is :func:`place_workers`'s
rule: with a GPU for every local worker, worker k uses ``cuda:k`` and its process group runs
collectives on CUDA tensors on NCCL and those on CPU tensors on gloo
(:func:`process_group_backend`); with fewer GPUs than workers (or ``backend = "gloo"``), worker
k uses ``cuda:(k mod G)`` and every collective runs on gloo, which takes CUDA tensors (it
copies them through pinned host memory); without CUDA (or ``device = "cpu"``), the workers run
on the CPU over gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import host_store
from lowcomm.train.config import DEVICES, TrainConfig, config_from_dict
from lowcomm.train.errors import ConfigError
from lowcomm.train.failures import attempt, describe_attempt, is_peer_loss, record_failure
from lowcomm.train.loop import train

__all__ = [
    "PID_DIR_ENV",
    "Placement",
    "host_loopback_store",
    "main",
    "place_workers",
    "process_group_backend",
    "resolve_backend",
    "run_worker",
    "usable_cores",
    "visible_gpus",
]

logger = logging.getLogger(__name__)


def visible_gpus() -> int:
    """The CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` applied); 0 without
    CUDA. Safe before the workers start: it does not create a CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (a container's or
    ``taskset``'s share of the machine), else every core; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the workers of one machine compute and the backend that joins them
    (:func:`place_workers`)."""

    backend: str
    """``"nccl"`` or ``"gloo"``."""
    gpus: int
    """The CUDA devices the workers use (``cuda:0`` ... ``cuda:gpus-1``); 0: the CPU."""
    workers: int
    """The worker processes on this machine."""

    @property
    def on_gpu(self) -> bool:
        """Whether the workers compute on GPUs."""
        return self.gpus > 0

    @property
    def shares_gpus(self) -> bool:
        """Whether some GPU holds more than one worker (then every collective runs on gloo)."""
        return self.on_gpu and self.workers > self.gpus

    def device(self, local_rank: int) -> torch.device:
        """The device of the worker of local rank ``local_rank``: ``cuda:(local_rank mod G)``
        on GPUs, else the CPU."""
        if not self.on_gpu:
            return torch.device("cpu")
        return torch.device("cuda", local_rank % self.gpus)

    def threads(self, cores: int | None = None) -> int:
        """Intra-op threads for each worker: the ``cores`` this machine gives the job (default
        :func:`usable_cores`) shared among its workers, at least 1. The same share on GPUs:
        the workers' host work (the Python loop, gloo's copies and transfers) runs there."""
        return max(1, (usable_cores() if cores is None else cores) // max(1, self.workers))

    def describe(self) -> str:
        """One line for the start-up log: ``"2 workers share 1 GPU over gloo (worker k on
        cuda:k mod 1)"``."""
        n = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        if not self.on_gpu:
            return f"{n} on the CPU over {self.backend}"
        gpus = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
        if self.shares_gpus:
            most = math.ceil(self.workers / self.gpus)
            return (
                f"{n} share {gpus} over {self.backend} (worker k on cuda:k mod {self.gpus}, "
                f"up to {most} a GPU)"
            )
        return f"{n}, one GPU each (worker k on cuda:k), over {self.backend}"


def place_workers(
    backend: str, workers: int, *, device: str = "auto", gpus: int | None = None
) -> Placement:
    """Where ``workers`` worker processes on this machine compute, and over which backend.

    With G GPUs visible (``gpus``; default :func:`visible_gpus`):

    * ``device`` ``"cpu"``, or ``"auto"`` with G = 0: every worker on the CPU, over gloo;
    * ``backend`` ``"auto"``: NCCL when every worker has a GPU of its own (``workers`` <= G,
      worker k on ``cuda:k``), else gloo with worker k on ``cuda:(k mod G)``: NCCL refuses
      two ranks on one device, gloo takes CUDA tensors (through pinned host memory);
    * ``"nccl"``: worker k on ``cuda:k``; more workers than GPUs is refused;
    * ``"gloo"``: worker k on ``cuda:(k mod G)`` (the GPUs are used; ``device = "cpu"`` keeps
      the workers on the CPU).

    Every worker of a machine computes the same placement, and under torchrun every machine
    must see as many GPUs for the same ``workers`` (``LOCAL_WORLD_SIZE``), or ``auto`` may
    choose a different backend there: give ``backend`` explicitly on mixed machines.

    Raises:
        ConfigError: keyed by the setting to change: ``nccl`` without GPUs (or with
            ``device = "cpu"``), ``nccl`` with more workers than GPUs, ``device = "cuda"``
            without CUDA.
    """
    visible = visible_gpus() if gpus is None else gpus
    if device not in DEVICES:
        raise ConfigError("device", f"must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        if backend == "nccl":
            raise ConfigError(
                "backend",
                "'nccl' needs the workers on GPUs, and device is 'cpu'; use gloo or auto "
                "(or device cuda)",
            )
        return Placement("gloo", 0, workers)
    if visible == 0:
        if device == "cuda":
            raise ConfigError(
                "device",
                "'cuda' needs a CUDA device and none is available (torch.cuda.is_available() "
                "is False); use cpu or auto",
            )
        if backend == "nccl":
            raise ConfigError(
                "backend", "'nccl' needs CUDA GPUs and none is available; use gloo or auto"
            )
        return Placement("gloo", 0, workers)
    if backend == "nccl" and workers > visible:
        raise ConfigError(
            "workers",
            f"({workers}) exceeds the {visible} CUDA device(s) on this machine, and nccl puts "
            f"one worker on each GPU (it refuses two on one device); use --backend gloo (the "
            f"workers then share the GPUs: worker k on cuda:k mod {visible}) or at most "
            f"{visible} workers",
        )
    if backend == "auto":
        backend = "nccl" if workers <= visible else "gloo"
    return Placement(backend, visible, workers)


def resolve_backend(backend: str, workers: int = 1, *, device: str = "auto") -> str:
    """The backend :func:`place_workers` chooses for ``workers`` local workers: ``auto`` is
    ``nccl`` when every worker has a GPU of its own, else ``gloo``."""
    return place_workers(backend, workers, device=device).backend


def process_group_backend(backend: str) -> str:
    """The backend string a job's process groups are created with: ``nccl`` becomes
    ``cpu:gloo,cuda:nccl`` (collectives on CUDA tensors run on NCCL, those on CPU tensors on
    gloo); ``gloo`` stays."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _setup_worker_logging(rank: int, quiet: bool = False) -> None:
    # Spawned workers start with a fresh interpreter: configure the lowcomm loggers again.
    # Under torchrun the CLI in this same process has configured them already.
    root = logging.getLogger("lowcomm")
    root.setLevel(logging.INFO if rank == 0 and not quiet else logging.WARNING)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    fmt = "%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.propagate = False


PEER_LOSS_LINGER_S = 1.0
"""A locally launched worker that failed because it lost a peer stays this long before it
exits, so that the launcher sees the peer end first (its monitor looks every 0.1 s)."""


def run_worker(
    cfg: TrainConfig,
    launched_locally: bool,
    failure_dir: str | None = None,
    job: Callable[..., dict[str, Any] | None] | None = None,
) -> dict[str, Any] | None:
    """Entry point of one worker process: set up ``torch.distributed`` from the environment
    (torchrun / elastic launch variables), train, tear down.

    Args:
        cfg: the checked configuration, ``name`` and ``out`` resolved. Passed as it is (pickled
            to a worker process), so it is not checked again.
        launched_locally: ``True`` when ``lowcomm train`` launched this worker on this machine;
            gloo is then bound to the loopback interface.
        failure_dir: where to record an exception (:func:`~lowcomm.train.failures.record_failure`),
            so the launcher can tell the first failure from its knock-on effects, and a
            restarted group what went wrong.
        job: what the worker runs, ``job(cfg, device=device)``: by default the training loop
            (:func:`lowcomm.train.loop.train`); ``lowcomm finetune`` passes its own job and
            config (any object with the fields this function reads: ``quiet``, ``backend``,
            ``collective_timeout``, and ``device`` if it has one).

    Returns:
        The run summary on global rank 0, ``None`` elsewhere.
    """
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run_worker(cfg, launched_locally, rank, failure_dir, job or train)
    except BaseException as e:
        if failure_dir is not None:
            record_failure(failure_dir, rank, e)
            if launched_locally and is_peer_loss(e):
                # The launcher names the first worker it sees end; one forked from the fork
                # server exits at once, before the launcher may have seen the peer it lost.
                time.sleep(PEER_LOSS_LINGER_S)
        raise


PID_DIR_ENV = "LOWCOMM_PID_DIR"
"""For benchmarks only: a folder where every worker writes its process id, in
``rank<R>.attempt<A>`` (the chaos benchmark's checkpoint-restart runs kill a worker by it). Not a
user setting."""


def _run_worker(
    cfg: TrainConfig,
    launched_locally: bool,
    rank: int,
    failure_dir: str | None,
    job: Callable[..., dict[str, Any] | None],
) -> dict[str, Any] | None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _setup_worker_logging(rank, cfg.quiet)
    pids = os.environ.get(PID_DIR_ENV)
    if pids:  # (benchmarks: which process is which rank, to signal one)
        with open(os.path.join(pids, f"rank{rank}.attempt{attempt()}"), "w") as f:
            f.write(str(os.getpid()))
    placement = place_workers(cfg.backend, local_world, device=getattr(cfg, "device", "auto"))
    # Workers on one machine share its cores; oversubscribing them slows everyone down.
    torch.set_num_threads(placement.threads())
    device = placement.device(local_rank)
    if device.type == "cuda":
        # before the process group and the model: every CUDA tensor made without an index
        # (and gloo's and NCCL's own streams) lands on this worker's GPU
        torch.cuda.set_device(device)
    # nccl: NCCL for CUDA tensors (every bucket, gradient and payload), gloo for the few CPU
    # tensors of the control path (step counts, tables, gathered objects), which NCCL refuses;
    # gloo: both, CUDA tensors through pinned host memory
    backend = process_group_backend(placement.backend)
    if rank == 0 and placement.on_gpu:
        logger.info("lowcomm train: %s", placement.describe())
    if launched_locally and "gloo" in backend:
        lo = _loopback_interface()
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    if rank == 0 and attempt() > 0:
        logger.warning(
            "worker group restarted (restart %d) after a failure: %s",
            attempt(),
            describe_attempt(failure_dir, attempt() - 1),
        )
    # A collective that waits longer than this for a peer fails instead of hanging: a dead or
    # stalled worker stops the others within a bounded time.
    timeout = datetime.timedelta(seconds=cfg.collective_timeout)
    group = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if getattr(cfg, "fault_tolerance", False) and group > 1:
        # an elastic replica of several processes (a node group, DDP inside): their process
        # group meets in the store the launcher (or torchrun's agent) hosts for this replica
        # alone, fresh at every restart (group rank 0 hosts it when no agent does); the
        # replicas meet in torchft's
        hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        shared = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=rank == 0 and not hosted,
            timeout=timeout,
        )
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        node = dist.PrefixStore(f"lowcomm/replica/{restart}", shared)
        dist.init_process_group(backend, store=node, rank=rank, world_size=group, timeout=timeout)
    elif getattr(cfg, "fault_tolerance", False):
        # an elastic replica: a process group of its own (the replicas meet in torchft's)
        own = host_store("127.0.0.1", 0, timeout=timeout)
        dist.init_process_group(backend, store=own, rank=0, world_size=1, timeout=timeout)
    elif launched_locally:
        store = _loopback_store(rank, timeout)
        world = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
        # torchrun's LOCAL_WORLD_SIZE counts one agent's processes; several agents on one
        # machine (--nnodes 2 on loopback) share its cores all the same
        torch.set_num_threads(_threads_per_process())
    try:
        summary = job(cfg, device=device)
        # Leave together: a rank tearing down its process group while rank 0 is still writing
        # the run folder can abort in gloo's connection threads at interpreter exit.
        dist.barrier()
        return summary
    finally:
        dist.destroy_process_group()


def _threads_per_process() -> int:
    """This machine's usable cores over the job's processes on it, counted by host name over
    the default group (every rank takes part)."""
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    here = max(1, names.count(socket.gethostname()))
    return max(1, usable_cores() // here)


def _loopback_store(rank: int, timeout: datetime.timedelta) -> dist.Store:
    """The store of a locally launched group, at the ``MASTER_PORT`` the elastic agent chose.

    Rank 0 hosts it on a socket bound to 127.0.0.1 (a store created by ``env://`` listens on
    every interface); the others connect to it. The launcher has the agent pick a fresh port for
    every attempt, so a restarted group never reads the previous attempt's addresses.
    """
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    return host_loopback_store(port, timeout=timeout)


def host_loopback_store(port: int, **kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore`` server listening on 127.0.0.1 only, at ``port`` (0: a free port; read it
    back from ``store.port``). ``kwargs`` go to ``TCPStore`` (``timeout``, ``multi_tenant``)."""
    return host_store("127.0.0.1", port, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """``python -m lowcomm.train CONFIG_JSON [--failure-dir DIR]``: one worker of a job that
    :func:`lowcomm.train.launcher.launch_processes` started, set up from the environment it is
    given (``torch.distributed``'s ``env://`` variables)."""
    parser = argparse.ArgumentParser(prog="python -m lowcomm.train")
    parser.add_argument("config", metavar="CONFIG_JSON")
    parser.add_argument("--failure-dir", default=None)
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        cfg = config_from_dict(json.load(f), source=args.config)
    run_worker(cfg, False, args.failure_dir)
    return 0
