"""Start the workers of a ``lowcomm train`` job.

Two ways, one worker function (:func:`lowcomm.train.loop.run_worker`):

* **Local** (the default): ``workers`` processes on this machine through torch's own elastic
  launcher (``elastic_launch``, c10d rendezvous on ``127.0.0.1`` at a free port, spawn, no
  restarts). gloo is bound to the loopback interface.
* **Under torchrun** (``TORCHELASTIC_RUN_ID`` is set): torchrun already started one process per
  worker, possibly on several machines, so this process *is* a worker and runs the loop
  in-process; ``--workers`` is ignored. Two nodes of four workers each::

      torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
          --rdzv-endpoint HOST:29400 -m lowcomm train --algo co2

Workers write their own output (rank 0 shows the progress bar). Either way a failed worker
becomes a :class:`WorkerFailed` naming its rank and error, with its traceback saved to
``<out>/error-rank<r>.txt``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.loop import error_line, resolve_backend, run_worker
from lowcomm.train.metrics import RUN_FILES, previous_run_files

__all__ = ["WorkerFailed", "check_environment", "launch", "prepare_output", "under_torchrun"]

logger = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A worker process failed.

    Attributes:
        rank: its global rank.
        error: its error, one line (``"ValueError: ..."``).
        traceback_path: a file holding the worker's traceback, when one could be written.
    """

    def __init__(self, rank: int, error: str, traceback_path: str | None = None) -> None:
        self.rank = rank
        self.error = error
        self.traceback_path = traceback_path
        super().__init__(f"worker rank {rank} failed: {error}")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another torch elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_environment(cfg: TrainConfig) -> None:
    """Checks that need this machine rather than the config alone: the backend, the output
    folder (not a file; no previous run in it unless ``overwrite``) and the corpus.

    Raises :class:`ConfigError` (a ``ValueError``) in the parent, before any worker starts.
    """
    from lowcomm.data import load_corpus

    if cfg.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "backend", "'nccl' needs CUDA GPUs and none is available; use gloo or auto"
        )
    if resolve_backend(cfg.backend) == "nccl" and not under_torchrun():
        n_gpus = torch.cuda.device_count()
        if cfg.workers > n_gpus:
            raise ConfigError(
                "workers",
                f"({cfg.workers}) exceeds the {n_gpus} CUDA device(s) nccl can use; "
                f"use at most {n_gpus} workers or --backend gloo",
            )
    if cfg.out is not None and os.path.exists(cfg.out):
        if not os.path.isdir(cfg.out):
            raise ConfigError("out", f"{cfg.out!r} exists and is not a folder; choose another path")
        found = [n for n in RUN_FILES if os.path.exists(os.path.join(cfg.out, n))]
        if found and not cfg.overwrite:
            raise ConfigError(
                "out",
                f"{cfg.out!r} already holds a run ({', '.join(found)}); choose another folder "
                "or set overwrite (--overwrite) to replace it",
            )
    try:
        corpus = load_corpus(cfg.data)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("data", f"cannot be used: {e}") from e
    need = cfg.block_size + 1
    for split in ("train", "val"):
        n = len(getattr(corpus, split))
        if n < need:
            raise ConfigError(
                "block_size",
                f"({cfg.block_size}) is too long for the corpus: its {split} split has {n} "
                f"tokens, a window needs {need}; use a smaller block_size or more text",
            )


def prepare_output(cfg: TrainConfig) -> None:
    """With ``cfg.overwrite``, remove the files of a previous run from ``cfg.out`` so that none
    is left stale; without it, do nothing (:func:`check_environment` refuses such a folder).

    Call it before :func:`launch`. Under torchrun every rank may call it: no rank writes before
    all of them have joined the process group.
    """
    if not cfg.overwrite or cfg.out is None or not os.path.isdir(cfg.out):
        return
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    # A worker that raised wrote an error file; peers torn down after it only carry a signal.
    # Prefer the one with an error, then the earliest, then the lowest rank.
    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        has_error = failure.error_file_data.get("message") not in (None, "", "<NONE>")
        return (not has_error, failure.timestamp, rank)

    return min(failures.items(), key=key)


def _failure_message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):  # error file payload: {"message": ..., "extraInfo": ...}
        message = message.get("message", message)
    text = str(message).strip()
    if not text or text.startswith("To enable traceback"):
        if failure.exitcode < 0:
            text = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
        else:
            text = f"exited with code {failure.exitcode}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0].strip() if lines else text


def launch(cfg: TrainConfig, *, quiet: bool = True) -> dict[str, Any] | None:
    """Run the job; return rank 0's summary where this process is (or launched) rank 0.

    Args:
        cfg: the configuration, ``name`` and ``out`` resolved (:meth:`TrainConfig.with_paths`).
        quiet: silence the torch elastic launcher's own logs (a failure is still raised).

    Raises:
        WorkerFailed: a worker raised or died; the first failure is reported. Under torchrun,
            this process's worker raised (its traceback is saved as under the local launch).
    """
    if under_torchrun():
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            logger.info(
                "running under torchrun (world size %s): --workers is ignored",
                os.environ.get("WORLD_SIZE", "?"),
            )
        try:
            return run_worker(cfg, False)
        except Exception as e:  # KeyboardInterrupt and SystemExit go through unchanged
            path = _save_text(traceback.format_exc(), cfg.out, rank)
            raise WorkerFailed(rank, error_line(e), path) from e

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    endpoint = f"127.0.0.1:{_free_port()}"
    # Error files of failed workers go to a scratch folder; the message is read from them
    # before the launcher returns, so the folder can go when it does.
    with tempfile.TemporaryDirectory(prefix="lowcomm-launch-") as log_dir:
        launch_config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cfg.workers,
            run_id=f"lowcomm-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            rdzv_configs={"timeout": 120},
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
            local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            with _quiet_launcher_logs(quiet):
                results = elastic_launch(launch_config, run_worker)(cfg, True, log_dir)
        except ChildFailedError as e:
            recorded = _first_recorded_failure(log_dir)
            if recorded is not None:
                rank = int(recorded["rank"])
                path = _save_text(recorded["traceback"], cfg.out, rank)
                raise WorkerFailed(rank, str(recorded["error"]), path) from None
            rank, failure = _root_cause(e.failures)
            path = _save_traceback(failure, cfg.out, rank)
            raise WorkerFailed(rank, _failure_message(failure), path) from None
        except SignalException:  # Ctrl-C / SIGTERM reached the launcher: workers are stopped
            raise KeyboardInterrupt from None
    return results.get(0)


def _first_recorded_failure(folder: str) -> dict[str, Any] | None:
    """The earliest ``failure-rank<r>.json`` written by :func:`run_worker`: the root cause.

    A worker that fails takes its peers down with it (their collectives lose a partner), and
    torch elastic may report any of them; the earliest exception is the one that matters.
    """
    records = []
    for name in os.listdir(folder):
        if name.startswith("failure-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue
    if not records:
        return None
    return min(records, key=lambda r: (r["time"], r["rank"]))


def _save_traceback(failure: Any, out: str | None, rank: int) -> str | None:
    message = failure.error_file_data.get("message")
    if not isinstance(message, dict):
        return None
    return _save_text(message.get("extraInfo", {}).get("py_callstack"), out, rank)


def _save_text(text: str | None, out: str | None, rank: int) -> str | None:
    """Keep a failed worker's traceback as ``<out>/error-rank<r>.txt``; its path, or ``None``."""
    if not text or out is None:
        return None
    path = os.path.join(out, f"error-rank{rank}.txt")
    try:
        os.makedirs(out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return None
    return path


@contextlib.contextmanager
def _quiet_launcher_logs(quiet: bool) -> Iterator[None]:
    """Silence the torch elastic agent's own logging (start-up notes, and a multi-screen dump
    when a worker fails); the CLI reports a failure in one line instead."""
    if not quiet:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    saved: dict[str, bool] = {}
    for name, obj in list(logging.root.manager.loggerDict.items()):
        if isinstance(obj, logging.Logger) and name.startswith(prefixes):
            saved[name] = obj.disabled
            obj.disabled = True
    try:
        yield
    finally:
        for name, disabled in saved.items():
            logging.getLogger(name).disabled = disabled
