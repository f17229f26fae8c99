"""Start the workers of a ``lowcomm train`` job.

Three ways, one worker function (:func:`lowcomm.train.worker.run_worker`):

* **Local** (the default): ``workers`` processes on this machine through torch's own elastic
  launcher (``elastic_launch``, c10d rendezvous on ``127.0.0.1`` at a free port; workers forked
  from a server that imported torch once, :mod:`lowcomm.procs.forkserver`). The
  rendezvous store listens on ``127.0.0.1`` only and gloo is bound to the loopback interface,
  so nothing of the job is reachable from other machines. With ``max_restarts`` K > 0 the
  elastic agent restarts the whole group after a failure, up to K times, and the restarted
  workers resume from the run's latest complete checkpoint.
* **Under torchrun** (``TORCHELASTIC_RUN_ID`` is set): torchrun already started one process per
  worker, possibly on several machines, so this process *is* a worker and runs the loop
  in-process; ``--workers`` is ignored. Two nodes of four workers each::

      torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
          --rdzv-endpoint HOST:29400 -m lowcomm train --algo co2

* **Processes placed by the caller** (:func:`launch_processes`): one process per worker, each
  started with a command prefix and environment of the caller's choosing, such as a network
  namespace of :mod:`lowcomm.bench.netshape` (``ip netns exec NS``) and the ``env://``
  variables of its address there.

With ``nodes`` K > 1 and ``procs_per_node`` M, the local launch starts K x M workers, emulating
K nodes of M processes (ranks node-major); under torchrun the flags must describe the layout
torchrun started (:func:`check_torchrun_layout`)::

      torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
          --rdzv-endpoint HOST:29400 -m lowcomm train --algo co2 --nodes 2 --procs-per-node 4

Workers write their own output (rank 0 shows the progress bar). Every way a failed worker
becomes a :class:`WorkerFailed` naming its rank and error, with its traceback saved to
``<out>/error-rank<r>.txt``. The root cause is reported, not its knock-on effects, by the one
rule of :func:`lowcomm.train.failures.root_cause`: a worker killed by a signal (no Python error
of its own) is named over the peers that then lost their connection to it; collectives time out
after ``collective_timeout`` seconds, so a stalled worker cannot hang the others forever.

What is checked and prepared on this machine before the workers start
(:func:`check_environment`, :func:`prepare_output`, ...) is :mod:`lowcomm.train.preflight`'s
(importable from here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from lowcomm.guard import mentions_peer_loss
from lowcomm.procs.forkserver import Parent, call_in_parent_context, preload, start_method
from lowcomm.train.config import TrainConfig
from lowcomm.train.errors import WorkerFailed
from lowcomm.train.failures import (
    error_line,
    is_bad_input,
    read_failures,
    root_cause,
    save_traceback,
)
from lowcomm.train.preflight import (
    check_environment,
    check_link_time,
    check_torchrun_layout,
    prepare_output,
    resource_warnings,
    under_torchrun,
)
from lowcomm.train.worker import host_loopback_store, run_worker

__all__ = [
    "WorkerFailed",
    "WorkerProcess",
    "check_environment",
    "check_link_time",
    "check_torchrun_layout",
    "launch",
    "launch_processes",
    "prepare_output",
    "resource_warnings",
    "under_torchrun",
]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _loopback_rendezvous_store() -> Iterator[int]:
    """Host the rendezvous store on 127.0.0.1 (at a free port, yielded) for the duration.

    torch elastic's c10d rendezvous creates its store with ``multi_tenant=True``, which reuses a
    server already running on that port in this process: this one, listening on loopback only
    (the store it would create itself listens on every interface).
    """
    store = host_loopback_store(0, multi_tenant=True)
    port = int(store.port)
    try:
        yield port
    finally:
        del store


@contextlib.contextmanager
def _unshared_agent_store() -> Iterator[None]:
    """Have the elastic agent give every attempt of the worker group a store of its own.

    By default the agent shares one store with all attempts (listening on every interface),
    and a restarted group can read the previous attempt's addresses from it and fail to
    connect (pytorch/pytorch#135712). With sharing off, rank 0 hosts a fresh store on loopback
    at a new port for every attempt (:func:`lowcomm.train.worker.run_worker`). The setting is
    torch's environment variable, read by the agent in this process; it is restored afterwards.
    """
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def _most_likely_first(failures: dict[int, Any]) -> list[int]:
    """The ranks of torch elastic's failures, the most likely root cause first.

    A worker that raised wrote an error file; peers torn down after it only carry a signal.
    Those with an error of their own first; then those without one (killed by a signal, the
    peer the others lost); then those whose error is that they lost a peer (a worker that aborted
    on a broken connection before it could record its failure); each by time, then rank.
    """

    def key(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, failure = item
        message = failure.error_file_data.get("message")
        if message in (None, "", "<NONE>"):
            order = 1
        else:
            text = message.get("message", message) if isinstance(message, dict) else message
            order = 2 if mentions_peer_loss(str(text)) else 0
        return (order, failure.timestamp, rank)

    return [rank for rank, _ in sorted(failures.items(), key=key)]


def _failure_message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):  # error file payload: {"message": ..., "extraInfo": ...}
        message = message.get("message", message)
    text = str(message).strip()
    if not text or text.startswith(("To enable traceback", "Signal ")):
        if failure.exitcode < 0:
            text = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
        else:
            text = f"exited with code {failure.exitcode}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0].strip() if lines else text


def launch(
    cfg: TrainConfig, *, quiet: bool = True, job: Callable[..., Any] | None = None
) -> dict[str, Any] | None:
    """Run the job; return rank 0's summary where this process is (or launched) rank 0.

    Args:
        cfg: the configuration, ``name`` and ``out`` resolved (:meth:`TrainConfig.with_paths`).
        quiet: silence the torch elastic launcher's own logs (a failure is still raised).
        job: what each worker runs (:func:`~lowcomm.train.worker.run_worker`); by default the
            training loop. ``lowcomm finetune`` passes its own, with its own ``cfg`` (which has
            the fields read here: ``world_size``, ``max_restarts``, ``out``).

    Raises:
        WorkerFailed: a worker raised or died; the first failure is reported. Under torchrun,
            this process's worker raised (its traceback is saved as under the local launch).
    """
    if getattr(cfg, "lighthouse", None) is not None:
        # one replica of an elastic job, joining its Lighthouse: this process is the replica
        try:
            return run_worker(cfg, False) if job is None else run_worker(cfg, False, job=job)
        except Exception as e:
            path = save_traceback(traceback.format_exc(), cfg.out, 0)
            raise WorkerFailed(0, error_line(e), path, bad_input=is_bad_input(e)) from e
    if under_torchrun():
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            logger.info(
                "running under torchrun (world size %s): --workers is ignored",
                os.environ.get("WORLD_SIZE", "?"),
            )
            if cfg.max_restarts:
                logger.warning(
                    "--max-restarts is ignored under torchrun: use torchrun's own "
                    "--max-restarts (restarted workers resume from the latest checkpoint)"
                )
            restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
            if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                logger.warning(
                    "torchrun --max-restarts with the agent's shared store: a restarted group "
                    "can read the previous attempt's addresses and hang; set "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (pytorch/pytorch#135712)"
                )
        try:
            return run_worker(cfg, False) if job is None else run_worker(cfg, False, job=job)
        except Exception as e:  # KeyboardInterrupt and SystemExit go through unchanged
            path = save_traceback(traceback.format_exc(), cfg.out, rank)
            code = e.errno if isinstance(e, OSError) and e.filename else None
            raise WorkerFailed(
                rank, error_line(e), path, errno=code, bad_input=is_bad_input(e)
            ) from e

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Error files of failed workers go to a scratch folder; the message is read from them
    # before the launcher returns, so the folder can go when it does.
    with (
        tempfile.TemporaryDirectory(prefix="lowcomm-launch-") as log_dir,
        _loopback_rendezvous_store() as port,
        _unshared_agent_store(),
    ):
        endpoint = f"127.0.0.1:{port}"
        launch_config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cfg.world_size,
            run_id=f"lowcomm-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            rdzv_configs={"timeout": 120},
            max_restarts=cfg.max_restarts,
            monitor_interval=0.1,
            start_method=start_method(),
            local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            with _quiet_launcher_logs(quiet), _own_term_handler():
                args = (cfg, True, log_dir) if job is None else (cfg, True, log_dir, job)
                preload()
                results = elastic_launch(launch_config, call_in_parent_context)(
                    Parent.here(launch_config.start_method), run_worker, *args
                )
        except ChildFailedError as e:
            # The agent gives up after the last of its max_restarts restarts.
            rank, record, error, text = _final_failure(
                e.failures, log_dir, attempt=cfg.max_restarts
            )
            path = save_traceback(text, cfg.out, rank)
            code = record.get("errno") if record is not None else None
            bad = bool(record.get("bad_input")) if record is not None else False
            raise WorkerFailed(rank, error, path, errno=code, bad_input=bad) from None
        except SignalException:  # Ctrl-C / SIGTERM reached the launcher: workers are stopped
            raise KeyboardInterrupt from None
    return results.get(0)


@dataclasses.dataclass(frozen=True)
class WorkerProcess:
    """Where and how one worker of :func:`launch_processes` runs."""

    env: Mapping[str, str]
    """Added to this process's environment: ``torch.distributed``'s ``env://`` variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (the worker splits the machine's cores by it), and whatever else the
    place needs (``GLOO_SOCKET_IFNAME``)."""
    prefix: Sequence[str] = ()
    """A command that runs the worker's command line in its place (``ip netns exec NS``)."""


def launch_processes(
    cfg: TrainConfig, workers: Sequence[WorkerProcess], *, timeout_s: float
) -> dict[str, Any]:
    """Run the job as one process per entry of ``workers`` (rank r is ``workers[r]``) and wait
    for all of them; return rank 0's summary (``<out>/summary.json``).

    Each process is ``[*prefix, python, -m, lowcomm.train, CONFIG_JSON, --failure-dir, DIR]``
    (:func:`lowcomm.train.worker.main`) with its ``env``, in a session of its own, its output
    captured. Call :func:`check_environment` and :func:`prepare_output` first, as for
    :func:`launch`.

    Raises:
        WorkerFailed: a worker failed (the root cause is reported) or the job did not finish
            within ``timeout_s`` (then every worker still running is stopped).
    """
    if len(workers) != cfg.world_size:
        raise ValueError(f"{len(workers)} worker processes for a job of {cfg.world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    assert cfg.out is not None, "call TrainConfig.with_paths() first"
    with tempfile.TemporaryDirectory(prefix="lowcomm-workers-") as scratch:
        config_path = os.path.join(scratch, "config.json")
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f)
        command = [sys.executable, "-m", "lowcomm.train", config_path, "--failure-dir", scratch]
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[str] = []
        try:
            for rank, worker in enumerate(workers):
                logs.append(os.path.join(scratch, f"worker-rank{rank}.log"))
                with open(logs[-1], "wb") as log:
                    # A session of its own: the worker and anything it starts stop together.
                    procs.append(
                        subprocess.Popen(
                            [*worker.prefix, *command],
                            env={**os.environ, **worker.env},
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            outcome, failed_rank = _wait(procs, time.monotonic() + timeout_s)
        finally:
            _stop(procs)
        if outcome != "ok":
            _raise_failure(cfg, procs, logs, scratch, failed_rank=failed_rank, timeout_s=timeout_s)
    summary_path = os.path.join(cfg.out, "summary.json")
    try:
        with open(summary_path, encoding="utf-8") as f:
            summary: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"the workers finished but {summary_path} cannot be read: {e}") from e
    return summary


_PEER_GRACE_S = 3.0
_STOP_GRACE_S = 5.0
_TAIL_LINES = 40


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float) -> tuple[str, int | None]:
    """``("ok", None)`` when all exited 0; ``("failed", rank)`` once a worker exits otherwise
    (after a short grace for the others to record their own errors); ``("timeout", None)`` at
    ``deadline``."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return "ok", None
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            grace = min(deadline, time.monotonic() + _PEER_GRACE_S)
            while time.monotonic() < grace and any(p.poll() is None for p in procs):
                time.sleep(0.05)
            return "failed", failed[0]
        if time.monotonic() >= deadline:
            return "timeout", None
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the workers still running (SIGTERM to each one's process group, then SIGKILL)."""
    running = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        running = [p for p in running if p.poll() is None]
        if not running:
            return
    for p in running:  # pragma: no cover - SIGKILL does not fail
        logger.error("worker process %d did not stop", p.pid)


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_TAIL_LINES:])


def _raise_failure(
    cfg: TrainConfig,
    procs: list[subprocess.Popen[bytes]],
    logs: list[str],
    scratch: str,
    *,
    failed_rank: int | None,
    timeout_s: float,
) -> None:
    """Raise ``WorkerFailed`` for the root cause (:func:`~lowcomm.train.failures.root_cause`
    of the workers' records, ``failed_rank`` the first worker seen to exit with an error); a
    worker without a record is described by its exit and its output's last line, and a job
    that timed out (``failed_rank`` ``None``) without any record by the first worker that was
    still running."""
    timed_out = failed_rank is None
    cause = root_cause(read_failures(scratch), [] if failed_rank is None else [failed_rank])
    record = cause[1] if cause is not None else None
    if record is not None:
        rank = int(record["rank"])
        path = save_traceback(record.get("traceback"), cfg.out, rank)
        raise WorkerFailed(
            rank,
            str(record["error"]),
            path,
            errno=record.get("errno"),
            bad_input=bool(record.get("bad_input")),
        )
    if failed_rank is None:
        # Stopped by _stop: the first worker that had not finished.
        stopped = [
            r for r, p in enumerate(procs) if p.returncode in (-signal.SIGTERM, -signal.SIGKILL)
        ]
        rank = stopped[0] if stopped else 0
        error = f"did not finish within {timeout_s:g} s and was stopped"
    else:
        rank = failed_rank
        code = procs[rank].returncode
        assert code is not None
        if code < 0:
            error = f"killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            error = f"exited with code {code}"
    tail = _tail(logs[rank])
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    if last and not timed_out:
        error = f"{error}: {last}"
    path = save_traceback(tail, cfg.out, rank)
    raise WorkerFailed(rank, error, path)


def _final_failure(
    failures: dict[int, Any], folder: str, *, attempt: int
) -> tuple[int, Mapping[str, Any] | None, str, str | None]:
    """``(rank, its failure record or None, error, traceback)`` of the root cause of a failed
    attempt (:func:`~lowcomm.train.failures.root_cause` of the records the workers wrote in
    ``folder``).

    ``failures`` are torch elastic's (global rank -> ``ProcessFailure``: exit code, error file);
    a worker that left no record of its own is described from them.
    """
    cause = root_cause(read_failures(folder, attempt=attempt), _most_likely_first(failures))
    assert cause is not None, "torch elastic reports at least one failure"
    rank, record = cause
    if record is not None:
        return rank, record, str(record["error"]), record.get("traceback")
    return rank, None, _failure_message(failures[rank]), _traceback_of(failures[rank])


def _traceback_of(failure: Any) -> str | None:
    message = failure.error_file_data.get("message")
    if not isinstance(message, dict):
        return None
    text = message.get("extraInfo", {}).get("py_callstack")
    return str(text) if text else None


_LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""The signals torch elastic's launcher takes over while it runs (its default)."""


@contextlib.contextmanager
def _own_term_handler() -> Iterator[None]:
    """Give the signals the elastic launcher takes over back to the handlers they had once it
    returns: it installs its own (raising ``SignalException``) and leaves them in place, so a
    Ctrl-C or SIGTERM during whatever this process does next would surface as torch's
    exception instead of an interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    numbers = [getattr(signal, n) for n in _LAUNCHER_SIGNALS if hasattr(signal, n)]
    saved = {sig: signal.getsignal(sig) for sig in numbers}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # (None: a handler not installed from Python, left alone)
                signal.signal(sig, handler)


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
