"""What ``lowcomm train`` checks and prepares on this machine before its workers start
(:mod:`lowcomm.train.launcher` starts them): warnings about cores and memory, the backend,
torchrun's layout, the output folder, the checkpoint to resume from and the corpus, and the
removal of a previous run's files with ``overwrite``."""

from __future__ import annotations

import os
import shutil

import torch

import lowcomm.train.checkpoint as ckpt
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.failures import attempt
from lowcomm.train.metrics import RUN_FILES, check_writable_folder, previous_run_files
from lowcomm.train.worker import resolve_backend

__all__ = [
    "WORKER_BASE_BYTES",
    "WORKER_BYTES_PER_PARAMETER",
    "check_environment",
    "check_torchrun_layout",
    "prepare_output",
    "resource_warnings",
    "under_torchrun",
]


WORKER_BASE_BYTES = 400e6
"""Memory a CPU worker takes before its model: the interpreter with torch and lowcomm
(measured: about 415 MB resident per worker of the default job)."""
WORKER_BYTES_PER_PARAMETER = 40
"""Memory per model parameter in a worker: parameters, gradients, AdamW's two moments, the
anchor, send and receive buffers and outer state, in fp32 (about ten copies)."""


def _available_memory() -> int | None:
    """Memory available to new processes (``MemAvailable`` of ``/proc/meminfo``), if known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resource_warnings(
    workers: int, *, parameters: int, cpu_workers: bool, flag: str = "--workers"
) -> list[str]:
    """What a user should hear before ``workers`` local processes start: more CPU workers than
    cores (each gets a slice of one, start-up alone takes minutes, and throughput does not
    grow), and an estimate of their memory that exceeds what is available."""
    out = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpu_workers and cores and workers > cores:
        out.append(
            f"{flag} {workers} on {cores} CPU core(s): each worker gets {cores / workers:.2g} of "
            "a core, so start-up takes minutes and the job runs no faster than with "
            f"{cores}; use at most {cores} workers on this machine (or one per GPU)"
        )
    need = workers * (WORKER_BASE_BYTES + WORKER_BYTES_PER_PARAMETER * parameters)
    available = _available_memory()
    if available is not None and need > 0.8 * available:
        out.append(
            f"{flag} {workers} may run out of memory: about {need / 1e9:.1f} GB for "
            f"{workers} worker processes, {available / 1e9:.1f} GB available; use fewer workers"
        )
    return out


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another torch elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_environment(cfg: TrainConfig) -> None:
    """Checks that need this machine rather than the config alone: the backend, torchrun's
    layout (:func:`check_torchrun_layout`), the output folder (created and writable, else an
    ``OSError`` naming it; not a file; no previous run in it unless ``overwrite`` or
    ``resume``), the checkpoint to resume from (complete, same world size and settings), the
    corpus and how the workers start (``LOWCOMM_START_METHOD``).

    Raises :class:`ConfigError` (a ``ValueError``) in the parent, before any worker starts.
    """
    from lowcomm.balance import load_documents
    from lowcomm.data import load_corpus
    from lowcomm.train.forkserver import start_method

    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "backend", "'nccl' needs CUDA GPUs and none is available; use gloo or auto"
        )
    if resolve_backend(cfg.backend) == "nccl" and not under_torchrun():
        n_gpus = torch.cuda.device_count()
        if cfg.world_size > n_gpus:
            raise ConfigError(
                "workers",
                f"({cfg.world_size}) exceeds the {n_gpus} CUDA device(s) nccl can use; "
                f"use at most {n_gpus} workers or --backend gloo",
            )
    check_torchrun_layout(cfg)
    if not under_torchrun():
        start_method()  # a bad LOWCOMM_START_METHOD is a ValueError naming the choices
    _check_output(cfg)
    if cfg.out is not None and os.path.exists(cfg.out):
        if not os.path.isdir(cfg.out):
            raise ConfigError("out", f"{cfg.out!r} exists and is not a folder; choose another path")
        found = [
            n for n in (*RUN_FILES, ckpt.CHECKPOINTS) if os.path.exists(os.path.join(cfg.out, n))
        ]
        # A worker group torchrun restarted continues the run in this folder.
        if found and not cfg.overwrite and cfg.resume is None and attempt() == 0:
            raise ConfigError(
                "out",
                f"{cfg.out!r} already holds a run ({', '.join(found)}); choose another folder "
                "or set overwrite (--overwrite) to replace it",
            )
    if cfg.resume is not None:
        folder = ckpt.find_checkpoint(cfg.resume, cfg.out)
        world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else cfg.world_size
        ckpt.check_compatible(folder, cfg, world)
    # what the workers will read: with --documents whole documents (a folder's .py files too, at
    # least ten of them, cut to pieces of at most block_size: no window to fit), else windows
    documents = cfg.documents and cfg.data is not None
    try:
        corpus = load_documents(cfg.data) if documents else load_corpus(cfg.data)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("data", f"cannot be used: {e}") from e
    if documents:
        return
    need = cfg.block_size + 1
    for split in ("train", "val"):
        n = len(getattr(corpus, split))
        if n < need:
            raise ConfigError(
                "block_size",
                f"({cfg.block_size}) is too long for the corpus: its {split} split has {n} "
                f"tokens, a window needs {need}; use a smaller block_size or more text",
            )


def _check_output(cfg: TrainConfig) -> None:
    """The output folder can be written (raises ``OSError`` naming the path), unless a file is
    in its place (refused below as a setting)."""
    if cfg.out is not None and not (os.path.exists(cfg.out) and not os.path.isdir(cfg.out)):
        check_writable_folder(cfg.out)


def check_torchrun_layout(cfg: TrainConfig) -> None:
    """Under torchrun with ``nodes`` > 1: torchrun must have started the layout the flags ask
    for, ``nodes`` x ``procs_per_node`` processes in all (``WORLD_SIZE``), ``procs_per_node`` on
    this machine (``LOCAL_WORLD_SIZE``), ranks node-major (``RANK`` = node rank x
    ``procs_per_node`` + ``LOCAL_RANK``, as torchrun numbers them when every node starts the same
    number). Raises :class:`ConfigError` naming the torchrun flags that give it."""
    if not under_torchrun() or cfg.nodes == 1:
        return
    nodes, per_node = cfg.nodes, cfg.procs_per_node
    fix = f"start it with torchrun --nnodes {nodes} --nproc-per-node {per_node}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world != cfg.world_size:
        raise ConfigError(
            "nodes",
            f"({nodes}) x procs_per_node ({per_node}) = {cfg.world_size} processes, but torchrun "
            f"started {world} (WORLD_SIZE); {fix}",
        )
    if local_world != per_node:
        raise ConfigError(
            "procs_per_node",
            f"({per_node}) differs from the {local_world} processes torchrun started on this "
            f"machine (LOCAL_WORLD_SIZE); {fix}",
        )
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank % local_world != local_rank:
        raise ConfigError(
            None,
            f"torchrun's ranks are not node-major: rank {rank} is local rank {local_rank} of "
            f"{local_world}, where node groups need rank = node x {local_world} + local rank; "
            f"give every node the same --nproc-per-node ({per_node})",
        )


def prepare_output(cfg: TrainConfig) -> None:
    """With ``cfg.overwrite``, remove the files and checkpoints of a previous run from
    ``cfg.out`` so that none is left stale; without it, do nothing (:func:`check_environment`
    refuses such a folder).

    Call it before :func:`~lowcomm.train.launcher.launch`. Under torchrun every rank may call
    it: no rank writes before all of them have joined the process group.
    """
    if not cfg.overwrite or cfg.out is None or not os.path.isdir(cfg.out):
        return
    if attempt() > 0:  # torchrun restarted the group: the folder holds this very run
        return
    checkpoints = os.path.join(cfg.out, ckpt.CHECKPOINTS)
    # another rank under torchrun may be removing it too: check what is left afterwards
    shutil.rmtree(checkpoints, ignore_errors=True)
    shutil.rmtree(os.path.join(cfg.out, "replicas"), ignore_errors=True)  # an elastic job's
    if os.path.exists(checkpoints):
        raise ConfigError(
            "out",
            f"{cfg.out!r}: cannot remove the checkpoints of the previous run; remove "
            f"{checkpoints!r} yourself or choose another folder",
        )
    for path in previous_run_files(cfg.out):
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank under torchrun got there first
            pass
        except OSError as e:
            raise ConfigError(
                "out",
                f"{cfg.out!r}: cannot remove {os.path.basename(path)} of the previous "
                f"run ({e.strerror or e}); remove it yourself or choose another folder",
            ) from None
