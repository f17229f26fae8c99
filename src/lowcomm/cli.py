"""The ``lowcomm`` command line (also ``python -m lowcomm``).

The CLI owns the terminal: it configures logging for the ``lowcomm`` loggers, prints every
failure as one line and the final summary table. Library code only logs.

Exit codes (every command):

* 0: finished;
* 1: a worker failed (its rank and error on the line, its traceback in ``error-rank<r>.txt``);
* 2: a bad flag, setting or input file, found before anything ran or by a worker (a damaged
  checkpoint file, a setting only a worker can check);
* 3: training diverged: the loss became NaN or infinite (the summary names the step);
* 4: an output could not be written: a read-only, missing or full place (the path is named);
* 130: interrupted (Ctrl-C, or SIGTERM from a supervisor): the workers are stopped, and a
  ``lowcomm train`` run keeps what it had measured and says where ``--resume`` continues.

    lowcomm train                                   # CO2, 2 local workers, embedded corpus
    lowcomm train --algo diloco --workers 4 --steps 300
    lowcomm train --algo streaming --num-fragments 2 --overlap 1
    lowcomm train --config co2.toml --sync-every 24 # flags override the file
    lowcomm bench --quick                           # throughput over emulated slow links
    lowcomm simulate --preset co2-paper             # projected scaling to 8 ... 1024 workers
    lowcomm finetune --init runs/x --mode pertp --workers 2   # zeroth-order fine-tuning
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

__all__ = ["main"]

logger = logging.getLogger("lowcomm.cli")

EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_OUTPUT = 4
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.message = message


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line with a ``--help`` hint, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)


def _fail(prog: str, message: str, code: int = 2, *, help_hint: bool = True) -> int:
    hint = f" (see {prog} --help)" if code == EXIT_USAGE and help_hint else ""
    one_line = " ".join(str(message).split())
    print(f"{prog}: error: {one_line}{hint}", file=sys.stderr)
    return code


# --- entry point ------------------------------------------------------------------------------


def _build_parser() -> _Parser:
    from lowcomm import __version__
    from lowcomm.registry import algorithm_titles

    parser = _Parser(
        prog="lowcomm",
        description=(
            f"Data-parallel training over slow links: {algorithm_titles()}; benchmarks over "
            "emulated links, a scale simulator, a parallelism planner and zeroth-order "
            "fine-tuning."
        ),
    )
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    subparsers = parser.add_subparsers(dest="_command", metavar="COMMAND")
    from lowcomm.train.cli import add_subcommand as add_train

    add_train(subparsers)
    from lowcomm.bench.cli import add_subcommand as add_bench
    from lowcomm.bench.simulate import add_subcommand as add_simulate
    from lowcomm.plan.cli import add_subcommand as add_plan
    from lowcomm.zo.cli import add_subcommand as add_finetune

    add_bench(subparsers)
    add_simulate(subparsers)
    add_plan(subparsers)
    add_finetune(subparsers)
    _add_lighthouse(subparsers)
    return parser


# --- `lowcomm lighthouse` ---------------------------------------------------------------------


def _add_lighthouse(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "lighthouse",
        help="run the Lighthouse that the replicas of an elastic job on several machines join",
        description=(
            "Run torchft's Lighthouse (lowcomm[ft]) for an elastic job whose replicas run on "
            "several machines: each joins with lowcomm train --fault-tolerance --lighthouse "
            "ADDRESS --replica-id ID. It prints its address and runs until interrupted "
            "(Ctrl-C)."
        ),
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; give the address "
        "the other machines reach)",
    )
    p.add_argument("--port", type=int, default=29510, help="port (default 29510; 0: a free one)")
    p.add_argument("--min-replicas", type=int, default=1, help="replicas a sync needs (default 1)")
    p.add_argument(
        "--join-timeout",
        type=float,
        default=5.0,
        help="seconds a quorum waits for replicas that are alive but late (default 5)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds without a heartbeat after which a replica counts as dead (default 5)",
    )
    p.set_defaults(_run=_run_lighthouse)


def _run_lighthouse(args: argparse.Namespace, prog: str) -> int:
    from lowcomm.elastic import Lighthouse

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be >= 1, got {args.min_replicas}")
    for flag, value in (
        ("--join-timeout", args.join_timeout),
        ("--heartbeat-timeout", args.heartbeat_timeout),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")
    with Lighthouse(
        host=args.host,
        port=args.port,
        min_replicas=args.min_replicas,
        join_timeout_s=args.join_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
    ) as lighthouse:
        print(f"{prog}: listening on {lighthouse.address}", flush=True)
        print(
            f"join it with: lowcomm train --fault-tolerance --lighthouse {lighthouse.address} "
            "--replica-id replica_N",
            flush=True,
        )
        while True:
            time.sleep(3600)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _setup_logging() -> None:
    root = logging.getLogger("lowcomm")
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def _option_for(args: argparse.Namespace, path: str | None) -> str | None:
    """The flag whose value ``path`` concerns: the value itself, a file under it (``--out``
    for ``<out>/summary.json``) or a folder on its way (``/etc/passwd`` of ``--json
    /etc/passwd/x.json``)."""
    from lowcomm.train.cli import flag

    if not path:
        return None
    target = os.path.abspath(path)
    best: tuple[int, str] | None = None
    for key, value in vars(args).items():
        if key.startswith("_") or not isinstance(value, str) or not value:
            continue
        given = os.path.abspath(value)
        related = (
            target == given
            or target.startswith(given.rstrip(os.sep) + os.sep)
            or given.startswith(target.rstrip(os.sep) + os.sep)
        )
        if related and (best is None or len(given) > best[0]):
            best = (len(given), flag(key))
    return best[1] if best is not None else None


def _start_workers_early(argv: Sequence[str]) -> bool:
    """``lowcomm train`` that will start workers on this machine: start the server they are
    forked from before the flags are parsed (the parser imports torch), so that the server's
    imports and this process's run side by side (:func:`lowcomm.procs.forkserver.start_server`;
    a tiny job then starts 3 s sooner on 2 cores). Not for help, nor where this process is the
    worker (under torchrun) or one replica of another machine's job (``--lighthouse``).
    Returns whether it started the server (``main`` ends it if the command is refused before
    any worker starts)."""
    if not argv or argv[0] != "train" or os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    if any(a in ("-h", "--help") or a.startswith("--lighthouse") for a in argv):
        return False
    from lowcomm.procs.forkserver import start_server

    try:
        return start_server()
    except (OSError, ValueError) as e:  # the launch starts it later, or says why it cannot
        logging.getLogger(__name__).debug("the fork server did not start early: %s", e)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lowcomm`` command; returns the process exit code (module docstring)."""
    started = _start_workers_early(list(sys.argv[1:] if argv is None else argv))
    code = _main(argv)
    if started and code == EXIT_USAGE:  # refused before any worker started: end it now
        from lowcomm.procs.forkserver import stop_server

        stop_server()
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except _UsageError as e:
        return _fail(e.prog, e.message)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    run = getattr(args, "_run", None)
    if run is None:
        if extra:
            return _fail(parser.prog, f"unrecognized arguments: {' '.join(extra)}")
        return _fail(
            parser.prog, "choose a command: train, bench, simulate, plan, finetune, lighthouse"
        )
    prog = f"{parser.prog} {args._command}"
    if extra:
        return _fail(prog, f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging()
    from lowcomm.runfiles import describe_os_error
    from lowcomm.train.errors import TrainingDiverged, WorkerFailed

    try:
        with _term_as_interrupt():
            return int(run(args, prog))
    except WorkerFailed as e:
        where = f" (traceback: {e.traceback_path})" if e.traceback_path else ""
        if e.errno is not None:
            code = EXIT_OUTPUT
        elif e.bad_input:
            code = EXIT_USAGE
        else:
            code = EXIT_WORKER_FAILED
        message = f"worker rank {e.rank} failed: {e.error}{where}"
        return _fail(prog, message, code=code, help_hint=False)
    except TrainingDiverged as e:
        return _fail(prog, str(e), code=EXIT_DIVERGED)
    except OSError as e:  # an output that cannot be written, found after the checks
        return _fail(prog, describe_os_error(e, option=_option_for(args, e.filename)), EXIT_OUTPUT)
    except ValueError as e:  # a bad setting the command found after parsing
        return _fail(prog, str(e))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if _is_signal_exception(e):  # torch elastic's handler, left installed by a launch
            print(f"{prog}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        raise


def _is_signal_exception(error: BaseException) -> bool:
    """Whether ``error`` is torch elastic's ``SignalException`` (raised by the SIGTERM handler
    its launcher installs, which stays installed after it returns)."""
    return type(error).__name__ == "SignalException" and type(error).__module__.startswith(
        "torch.distributed.elastic"
    )


@contextlib.contextmanager
def _term_as_interrupt() -> Iterator[None]:
    """While a command runs, SIGTERM (a supervisor or ``kill`` stopping it) is handled as
    Ctrl-C: ``KeyboardInterrupt`` unwinds the command, so its workers are stopped, its run
    records what it had measured, and it exits 130 without a traceback. (A launch in progress
    installs torch elastic's own handler meanwhile; :func:`_is_signal_exception`.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
