"""What ``lowcomm train`` checks and prepares on this machine before its workers start
(:mod:`lowcomm.train.launcher` starts them): warnings about cores and memory, the backend,
torchrun's layout, the output folder, the checkpoint to resume from and the corpus, and the
removal of a previous run's files with ``overwrite``."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

import lowcomm.train.checkpoint as ckpt
from lowcomm.runfiles import check_writable_folder
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.failures import attempt
from lowcomm.train.metrics import RUN_FILES, previous_run_files
from lowcomm.train.outer_keys import sync_codec
from lowcomm.train.worker import Placement, place_workers

if TYPE_CHECKING:
    from lowcomm.tune.choose import LinkProfile

__all__ = [
    "ATTEMPTS",
    "WORKER_BASE_BYTES",
    "WORKER_BYTES_PER_PARAMETER",
    "check_environment",
    "check_link_time",
    "check_torchrun_layout",
    "link_seconds",
    "local_placement",
    "prepare_output",
    "replica_restart",
    "resource_warnings",
    "under_torchrun",
]

logger = logging.getLogger(__name__)


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


def local_placement(cfg: TrainConfig) -> Placement:
    """Where the job's workers on this machine compute, and over which backend
    (:func:`~lowcomm.train.worker.place_workers`): ``workers`` processes on a local launch,
    torchrun's ``LOCAL_WORLD_SIZE`` under torchrun. Raises :class:`ConfigError` for a backend
    or device this machine cannot give them."""
    local = cfg.world_size
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return place_workers(cfg.backend, local, device=cfg.device)


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
    from lowcomm.procs.forkserver import start_method

    # nccl without GPUs, nccl with more workers than GPUs, cuda without CUDA: refused here,
    # before any worker starts (each worker places itself by the same rule)
    placement = local_placement(cfg)
    if cfg.algo == "noloco" and placement.on_gpu and placement.backend == "gloo":
        # gloo's send and recv hand the tensor's memory to its transport as host memory: they
        # take no CUDA tensors (its collectives copy them through the host, its point-to-point
        # operations do not)
        raise ConfigError(
            "algo",
            "noloco exchanges its groups' parameters point to point (send and recv), which "
            "gloo cannot do on CUDA tensors, and here the workers are on GPUs over gloo; give "
            f"every worker a GPU of its own (at most {placement.gpus} workers, backend auto or "
            "nccl) or run the workers on the CPU (--device cpu)",
        )
    check_torchrun_layout(cfg)
    if cfg.fault_tolerance:
        from lowcomm.elastic.replica import require_torchft

        try:
            require_torchft()
        except ValueError as e:
            raise ConfigError("fault_tolerance", f"cannot run here: {e}") from None
    if not under_torchrun():
        start_method()  # a bad LOWCOMM_START_METHOD is a ValueError naming the choices
    _check_output(cfg)
    if cfg.out is not None and os.path.exists(cfg.out):
        if not os.path.isdir(cfg.out):
            raise ConfigError("out", f"{cfg.out!r} exists and is not a folder; choose another path")
        found = [
            n for n in (*RUN_FILES, ckpt.CHECKPOINTS) if os.path.exists(os.path.join(cfg.out, n))
        ]
        # A worker group torchrun restarted continues the run in this folder, and so does a
        # Lighthouse replica started again with its own command line.
        restarted = attempt() > 0 or replica_restart(cfg) is not None
        if found and not cfg.overwrite and cfg.resume is None and not restarted:
            raise ConfigError(
                "out",
                f"{cfg.out!r} already holds a run ({', '.join(found)}); choose another folder "
                "or set overwrite (--overwrite) to replace it",
            )
    if cfg.resume is not None:
        skipped: list[tuple[str, str]] = []
        folder = ckpt.find_checkpoint(cfg.resume, cfg.out, skipped=skipped)
        for damaged, why in skipped:
            logger.warning(
                "checkpoint %s is damaged (%s): resuming from %s, the newest that verifies",
                damaged,
                why,
                folder,
            )
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


LONG_LINK_S = 3600.0
"""A job whose syncs alone take longer than this on its emulated link is told so at start-up,
with the total (:func:`link_seconds`)."""


def link_seconds(cfg: TrainConfig, parameters: int) -> float | None:
    """A lower bound on the seconds the job's communication takes on its emulated ``link``
    alone (compute not counted), for a model of ``parameters`` parameters: DDP's all-reduce
    every step; an outer algorithm's warm start (an all-reduce every step) and one sync per
    round (and SparseLoCo's early rounds), with the settings given, or, where the settings are
    chosen from the link, the cheapest the choice can reach (int2 syncs, the shortest warm
    start in int2). ``None``
    without a link, or for an algorithm whose traffic this does not bound (gossip, DeMo). The
    default job, which the choice may switch to SparseLoCo (``algo_from_link``), is bounded by
    the cheaper of the two."""
    if cfg.link is None:
        return None
    from lowcomm.tune.choose import LinkProfile

    link = LinkProfile.parse(cfg.link, emulated=True)
    n = cfg.nodes if cfg.hierarchical else cfg.world_size
    if n < 2:
        return 0.0
    payload = 4.0 * parameters
    if cfg.algo == "ddp":
        return cfg.steps * link.network().allreduce_time(payload, n)
    own = _outer_link_seconds(cfg, parameters, link, n)
    if cfg.algo_from_link and cfg.tune_link != "off":  # the choice may switch the algorithm
        from lowcomm.tune.evidence import FALLBACKS

        for fallback in FALLBACKS:
            try:
                alt = _outer_link_seconds(cfg.replace(algo=fallback.algo), parameters, link, n)
            except ConfigError:
                continue
            if alt is not None and own is not None:
                own = min(own, alt)
    return own


def _outer_link_seconds(
    cfg: TrainConfig, parameters: int, link: LinkProfile, n: int
) -> float | None:
    """:func:`link_seconds` of an outer algorithm's job (``None``: not bounded)."""
    from lowcomm.registry import REGISTRY
    from lowcomm.schedules import SPARSE_GATHER, sparse_bytes_per_element
    from lowcomm.tune.choose import early_syncs, encoded_ratio, sync_seconds, warm_length
    from lowcomm.tune.evidence import evidence_for

    entry = REGISTRY[cfg.algo]
    payload = 4.0 * parameters
    sparse = entry.schedule is SPARSE_GATHER
    if not entry.is_outer or not (entry.schedule.rounds_all_reduce or sparse):
        return None

    def sync(codec: str | None) -> float:
        if codec in (None, "none"):
            return sync_seconds(None, payload, n, link, 1.0)
        return sync_seconds(codec, payload, n, link, encoded_ratio(codec, [(parameters,)]))

    kwargs = cfg.algorithm_kwargs()
    warm = cfg.sync_warmup_steps()
    codec, warm_codec = sync_codec(cfg.algorithm), kwargs.get("sync_warmup_compression")
    evidence = evidence_for(cfg.algo)
    if cfg.tune_link != "off" and evidence is not None:
        # the choice may compress further and shorten the warm start, as far as was measured
        if cfg.value("compression") is None:
            codec = "int2"
        if cfg.value("sync_warmup_compression") is None:
            warm_codec = "int2"
        shares = [share for share, _, _ in evidence.warm]
        shares += [share for _, share, _, _ in evidence.combined]
        if cfg.value("sync_warmup") is None and warm and shares:
            shortest = min(shares)
            warm = min(warm, warm_length(shortest, cfg.steps, cfg.sync_every))
    rounds = max(0, cfg.steps - warm) // cfg.sync_every
    if sparse:  # its exact wire bytes, all-gathered, early rounds included
        a: Any = cfg.algorithm  # (a SparseLoCoConfig)
        sent = parameters * sparse_bytes_per_element(a.density, a.chunk, a.bits)
        rounds += early_syncs(kwargs, cfg.sync_every)
        return warm * sync(warm_codec) + rounds * link.network().allgather_time(sent, n)
    return warm * sync(warm_codec) + rounds * sync(codec)


def check_link_time(cfg: TrainConfig, parameters: int) -> str | None:
    """Refuse a job whose communication on its emulated link alone (:func:`link_seconds`)
    cannot end within the time :data:`~lowcomm.train.config.MAX_STEPS` steps bounds (a year),
    as ``steps`` is refused; return a line saying how long it takes where that is over
    :data:`LONG_LINK_S`, else ``None``."""
    from lowcomm.train.config import FASTEST_STEP_S, MAX_STEPS

    seconds = link_seconds(cfg, parameters)
    if seconds is None or seconds <= LONG_LINK_S:
        return None
    hours = seconds / 3600
    if seconds > MAX_STEPS * FASTEST_STEP_S:
        raise ConfigError(
            "link",
            f"({cfg.link}) makes the job's syncs alone take at least {hours / 24 / 365.25:,.1f} "
            "years; use a faster link, fewer steps or a longer sync_every",
        )
    return (
        f"--link {cfg.link}: the job's syncs alone take at least {hours:,.1f} hours on this "
        f"link ({parameters:,} parameters, {cfg.steps:,} steps); a faster link, fewer steps, "
        "a longer --sync-every or --compression shortens it"
    )


ATTEMPTS = "attempts"
"""The folder under a Lighthouse replica's ``out`` that keeps its earlier attempts' files
(``attempts/0/``, ``attempts/1/``, …) when it is started again with the same command line."""


def replica_restart(cfg: TrainConfig) -> int | None:
    """For a replica joining a Lighthouse (``lighthouse`` given) whose ``out`` already holds
    a run: the number of this start of it (1 for the first restart, 2, …), where that run is
    an earlier start of the same replica with the same settings that has not finished; else
    ``None`` (no run there, or not such a replica).

    A supervisor (a shell loop, systemd) restarts a replica that died with its own command
    line; the replica then continues in its folder and is healed from its peers at their next
    sync, while its earlier starts' files are kept under :data:`ATTEMPTS`.

    Raises:
        ConfigError: keyed ``out``, when the run there is this replica's but finished, or of
            other settings (named).
    """
    if cfg.lighthouse is None or cfg.out is None or cfg.overwrite or cfg.resume is not None:
        return None
    path = os.path.join(cfg.out, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("replica_id") != cfg.replica_id:
        return None
    diff = ckpt.config_difference(saved, cfg)
    if diff is not None:
        key, before, now = diff
        raise ConfigError(
            "out",
            f"{cfg.out!r} holds replica {cfg.replica_id}'s run with {key}={before!r}, but this "
            f"start has {key}={now!r}; restart a replica with the settings it was started "
            "with, or choose another folder",
        )
    status = None
    summary = os.path.join(cfg.out, "summary.json")
    with (
        contextlib.suppress(OSError, ValueError, AttributeError),
        open(summary, encoding="utf-8") as f,
    ):
        status = json.load(f).get("status")
    if status in ("finished", "diverged"):
        raise ConfigError(
            "out",
            f"{cfg.out!r} holds replica {cfg.replica_id}'s run, which {status} "
            "(summary.json): there is nothing to continue; choose another folder or set "
            "overwrite (--overwrite) to start it anew",
        )
    root = os.path.join(cfg.out, ATTEMPTS)
    earlier = [n for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
    return len(earlier) + 1


def _keep_earlier_attempt(cfg: TrainConfig, number: int) -> None:
    """Move the files of a Lighthouse replica's previous start (number ``number`` − 1) from its
    ``out`` into ``attempts/<number − 1>/``, and number this process's start ``number``."""
    from lowcomm.train.replica import ATTEMPT_ENV

    assert cfg.out is not None
    if int(os.environ.get("RANK", "0") or 0) == 0:  # a node group's rank 0 writes its folder
        keep = os.path.join(cfg.out, ATTEMPTS, str(number - 1))
        os.makedirs(keep, exist_ok=True)
        names = previous_run_files(cfg.out) + glob.glob(
            os.path.join(glob.escape(cfg.out), "summary-*.json")
        )
        for path in names:
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, os.path.join(keep, os.path.basename(path)))
        logger.warning(
            "replica %s started again (start %d): its earlier start's files are kept in %s",
            cfg.replica_id,
            number,
            keep,
        )
    # read by this process's replica (lowcomm.train.replica.ElasticReplica) for its records
    os.environ[ATTEMPT_ENV] = str(number)


def prepare_output(cfg: TrainConfig) -> None:
    """With ``cfg.overwrite``, remove the files and checkpoints of a previous run from
    ``cfg.out`` so that none is left stale; for a Lighthouse replica started again
    (:func:`replica_restart`), keep its earlier start's files under :data:`ATTEMPTS`; else do
    nothing (:func:`check_environment` refuses a folder that holds a run).

    Call it before :func:`~lowcomm.train.launcher.launch`. Under torchrun every rank may call
    it: no rank writes before all of them have joined the process group.
    """
    number = replica_restart(cfg)
    if number is not None:
        _keep_earlier_attempt(cfg, number)
        return
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
