"""Worker processes forked from a server that imported the training stack once.

The local launcher (:func:`lowcomm.train.launcher.launch`), the elastic launcher's replicas
(:class:`ForkedCommand`) and the test helper :func:`lowcomm.procs.workers.run_workers` start
their processes with ``multiprocessing``'s ``forkserver`` method where the platform has it
(Linux, macOS; elsewhere ``spawn``): a server
process imports :data:`PRELOAD` (torch, its compiler front end that the optimizers import on
first use, the worker, matplotlib's pyplot for the run folder's plot) once, runs nothing else,
and forks every worker from that state. A worker is as clean as a spawned one (no threads, no
CUDA context, nothing of the launching process), without each one importing torch again: a
tiny 2-worker job starts in about a third of the time, and a process that launches many jobs
(a benchmark, a test suite) pays the imports once.

A forked worker inherits the server's environment and standard streams as they were when the
server started, not the launching process's as they are now. :class:`Parent` carries both
across: the launching process's environment (with the variables torch elastic sets for the
worker on top) and its standard output and error (file descriptors passed with the process),
so a worker sees what a spawned one would. ``LOWCOMM_START_METHOD=spawn`` starts every worker in
a fresh interpreter instead.

Example::

    parent = Parent.here(start_method())   # in the launching process, as the workers start
    ...
    parent.adopt()                         # first thing in the worker
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

__all__ = [
    "PRELOAD",
    "START_METHOD_ENV",
    "ForkedCommand",
    "Parent",
    "call_in_parent_context",
    "exit_now",
    "preload",
    "start_method",
    "start_server",
    "stop_server",
]

SERVER_PID = os.getpid()
"""The process that imported this module: the fork server's pid in a worker forked from it
(where :data:`PRELOAD` imported it), the worker's own where it was imported later."""

SERVER_ENVIRONMENT = dict(os.environ)
"""The environment of the process that imported this module (the fork server's, in a worker
forked from it)."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "matplotlib.pyplot",
    "lowcomm.procs.forkserver",
    "lowcomm.train.worker",
)
"""What the fork server imports before it forks any worker (names, imported there: the
worker of ``lowcomm train`` among them, whose forked processes then start at once).
``torch._dynamo``: torch's optimizers import it on construction (two seconds a process on a
2-core machine);
``matplotlib.pyplot``: rank 0 draws the run's loss plot (the backend is chosen when it draws)."""

_ELASTIC_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
_ELASTIC_KEYS = frozenset(
    {
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
    }
)
"""The variables torch elastic sets for a worker (``LocalElasticAgent``): kept over the
launching process's where the server's environment is not known (see :meth:`Parent.adopt`)."""


START_METHOD_ENV = "LOWCOMM_START_METHOD"
"""Set to ``spawn`` to start every worker in a fresh interpreter instead (or ``forkserver``)."""


def start_method() -> str:
    """How the local launcher starts workers: :data:`START_METHOD_ENV` if set, else
    ``forkserver`` where this platform has it, else ``spawn``."""
    available = multiprocessing.get_all_start_methods()
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if not chosen:
        return "forkserver" if "forkserver" in available else "spawn"
    choices = [m for m in ("forkserver", "spawn") if m in available]
    if chosen not in choices:
        raise ValueError(
            f"{START_METHOD_ENV}={chosen!r}: choose one of {', '.join(choices)} (how the "
            f"workers start on this platform), or unset it"
        )
    return chosen


def preload() -> None:
    """Have the fork server import :data:`PRELOAD` when it starts (no effect once it has)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))


def start_server() -> bool:
    """Start the fork server now, if this platform's workers come from one, so that its imports
    of :data:`PRELOAD` run beside the launching process's own work instead of after it (the
    first worker's start waits for them). Called by ``lowcomm train`` before it parses its
    flags, which imports torch in the launching process too: the two imports overlap. Returns
    whether it started one (``False``: one was running, or workers are spawned)."""
    if start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return False
    preload()
    forkserver.ensure_running()
    return True


def stop_server() -> None:
    """End the fork server this process started (:func:`start_server`) before it served a
    worker, at once: it holds this process's standard output and error until its imports are
    done, so a command that fails on its flags would otherwise keep a caller that reads them
    waiting for seconds."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()  # type: ignore[attr-defined]  # (CPython's own, not in its stubs)


class _Stream:
    """A file descriptor of the launching process, handed to the worker as it starts (by the
    start method's own mechanism: each worker gets a duplicate of its own)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (_received, (reduction.DupFd(self.fd),))


def _stream(fd: int) -> _Stream | None:
    try:
        os.fstat(fd)
    except OSError:  # closed in this process: the worker keeps the server's
        return None
    return _Stream(fd)


def _received(dup: Any) -> Any:
    """In the worker: the descriptor, as the start method handed it over (``detach()`` gives
    its number in this process)."""
    return dup


class Parent:
    """What a worker takes from the process that launched it: its environment and its
    standard output and error (see the module docstring)."""

    def __init__(
        self, environment: dict[str, str], streams: tuple[Any, Any], *, forked: bool
    ) -> None:
        self.environment = environment
        self.streams = streams
        self.forked = forked

    @classmethod
    def here(cls, method: str) -> Parent:
        """This process's environment and standard streams, now, for workers started by
        ``method`` (a spawned worker has them already)."""
        forked = method == "forkserver"
        return cls(dict(os.environ), (_stream(1), _stream(2)), forked=forked)

    def adopt(self) -> None:
        """In the worker: take the launching process's standard output and error, and its
        environment with the variables torch elastic set for this worker on top (those whose
        value differs from the fork server's; where the server did not preload this module,
        the variables torch elastic is known to set). A spawned worker keeps what it has."""
        if not self.forked:
            return
        for target, stream in zip((1, 2), self.streams):
            if stream is not None:
                fd = stream.detach()
                if fd != target:
                    os.dup2(fd, target)
                    os.close(fd)
        if os.getppid() == SERVER_PID:
            own = {k: v for k, v in os.environ.items() if SERVER_ENVIRONMENT.get(k) != v}
        else:
            own = {
                k: v
                for k, v in os.environ.items()
                if k in _ELASTIC_KEYS or k.startswith(_ELASTIC_PREFIXES)
            }
        os.environ.clear()
        os.environ.update(self.environment)
        os.environ.update(own)


def call_in_parent_context(parent: Parent, fn: Callable[..., Any], *args: Any) -> Any:
    """A worker's entry point: :meth:`Parent.adopt`, then ``fn(*args)``."""
    parent.adopt()
    return fn(*args)


STARTED_WITHIN_S = 60.0
"""How long :class:`ForkedCommand` waits for its process to be in its own session."""


class ForkedCommand:
    """``python -m MODULE ARGS`` (``main``: the module's entry point; by default MODULE is
    ``lowcomm.train``, whose entry point is :func:`lowcomm.train.worker.main`) as
    ``subprocess.Popen(..., start_new_session=True)`` runs it (its own session, ``env`` as its
    whole environment, standard input from ``os.devnull``, output and error appended to
    ``log``), but forked from the server: the elastic launcher's replicas start without
    importing torch again (a replica that restarts heals sooner). The part of ``Popen``'s
    interface the launcher uses: ``pid``, :meth:`poll`, :meth:`wait`, ``returncode``
    (negative: the signal that ended it). The process is in its own session when the
    constructor returns, so ``os.killpg(pid, …)`` reaches it."""

    def __init__(
        self,
        main: Callable[[list[str]], int],
        args: Sequence[str],
        env: dict[str, str],
        log: str,
        *,
        module: str = "lowcomm.train",
    ) -> None:
        preload()
        ctx = multiprocessing.get_context("forkserver")
        started = ctx.Event()
        self.args = [sys.executable, "-m", module, *args]
        self._process = ctx.Process(
            target=_command_main,
            args=(main, module, list(args), dict(env), log, started),
            daemon=False,
        )
        self._process.start()
        if not started.wait(STARTED_WITHIN_S) and self._process.is_alive():
            self._process.kill()
            self._process.join()
            raise RuntimeError(f"a forked worker did not start within {STARTED_WITHIN_S:g} s")
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """``None`` while it runs, else its exit code."""
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has ended; ``subprocess.TimeoutExpired`` after ``timeout``."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def kill(self) -> None:
        """SIGKILL it (as ``Popen.kill``)."""
        if self.poll() is None:
            self._process.kill()


def _command_main(
    main: Callable[[list[str]], int],
    module: str,
    args: list[str],
    env: dict[str, str],
    log: str,
    started: Any,
) -> None:
    """In the forked process: what ``python -m MODULE ARGS`` does (``main(args)``, the module's
    entry point), set up as :class:`ForkedCommand` describes."""
    os.setsid()
    started.set()
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (out, 2)):
        os.dup2(fd, target)
    os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [f"python -m {module}", *args]
    exit_now(main(args))


def exit_now(code: int) -> None:
    """End a worker process whose run is over and whose files are written, with ``code``,
    skipping the interpreter's finalisation: objects of gloo's C++ threads released there can
    abort (SIGABRT) a process whose run succeeded. Logs and standard streams are flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
