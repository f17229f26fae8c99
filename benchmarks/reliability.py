"""Reliability table: what ``lowcomm train`` does when a worker dies and when its input is bad.

Every row comes from real ``lowcomm train`` processes (the tiny job of
:mod:`lowcomm.testing.jobs`: tiny model, 2 workers, 12 steps, gloo on 127.0.0.1), run one after
another (bad inputs two at a time):

1. **Kill points and resumes.** For every algorithm, an uninterrupted reference run with
   checkpoints; then runs in which one worker is killed (SIGKILL) or exits at a chosen step,
   through the fault hook ``LOWCOMM_FAULT_INJECT`` (it fires right after that step's
   ``algo.step()``, before its evaluation and checkpoint), each resumed with ``--resume``. The
   resumed run's every rank state at the last step, rank 0's final model and algorithm state and
   its metrics are compared bit for bit with the reference's (:mod:`lowcomm.testing.runs`, the
   comparison the resume tests assert).
2. **Faults and restarts.** Faults of every mode (kill, exit, raise, hang) with
   ``--max-restarts 1``: whether the job completed with the fault-free final state, how long the
   failed worker group took to stop and to be restarted, and the line the restarted group
   reports; the same faults without restarts: the exit code, the line naming the failed rank,
   and how long until every worker had stopped.
3. **Bad inputs.** Bad flag values, config files, data, output folders and checkpoints: the exit
   code, whether a Python traceback reached the terminal, and the one-line message.
4. **Numeric guard.** A worker whose parameters turn NaN mid-round, under every outer
   algorithm, with ``--nan-policy skip`` (completes, one update skipped, finite model) and
   ``raise`` (stops with ``NonFiniteError``, no C++ abort).
5. **Consistency guard.** Two ranks that differ in their model or settings: refused on every
   rank with the same message naming the difference.

Each section is a :class:`Section` (a function returning table rows, its columns and a totals
line) in :data:`SECTIONS`; a new section is one more entry.

Reproduce (about 9 minutes on 2 CPU cores; ``--quick``: under a minute)::

    python benchmarks/reliability.py

which writes ``benchmarks/reliability.md`` (committed) and keeps every run's folder and log
under ``benchmarks/results/reliability/`` (not committed; emptied at the start of a run).
``--quick`` runs one case per fault section and a few bad inputs in
``benchmarks/results/reliability/quick/`` and writes its table there (``reliability-quick.md``)
unless ``--report`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import lowcomm
from lowcomm import schedules
from lowcomm.registry import REGISTRY, outer_names
from lowcomm.testing.jobs import (
    TINY_JOB,
    TINY_JOB_ALGO_ARGS,
    TINY_JOB_ARGS,
    TINY_JOB_STEPS,
    read_summary,
)
from lowcomm.testing.runs import RunComparison, compare_runs
from lowcomm.train import checkpoint as ckpt
from lowcomm.train.loop import FAULT_ENV

HERE = Path(__file__).resolve().parent

# the tiny job (lowcomm.testing.jobs): 12 steps, rounds of 4, 2 workers, dropout
WORKERS = int(TINY_JOB["workers"])
REFERENCE_EVERY = 3  # reference runs checkpoint at steps 3, 6, 9 and 12
RUN_TIMEOUT_S = 150.0  # any single lowcomm train process
REFUSAL_TIMEOUT_S = 90.0
HANG_COLLECTIVE_TIMEOUT_S = 5.0

TRACEBACK = "Traceback (most recent call last)"
_FAULT_LINE = "injects a fault"
_RESTART_LINE = "worker group restarted"
_LOG_PREFIX = re.compile(r"^\[rank \d+\] [A-Z]+: ")
ERROR_PREFIX = "lowcomm train: error: "

Row = dict[str, str]


# --- running lowcomm train ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What one ``lowcomm train`` process did. Times are seconds since it started; ``None`` where
    the event did not happen (or the process table could not be read)."""

    returncode: int | None  # None: killed at the timeout
    stderr: list[str]
    wall_s: float
    workers_started: bool = False
    fault_s: float | None = None  # the faulty worker announced its fault
    stopped_s: float | None = None  # every worker alive at the fault had exited
    restart_s: float | None = None  # the restarted group's first line

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def traceback(self) -> bool:
        return any(TRACEBACK in line for line in self.stderr)

    def last_line(self) -> str:
        lines = [line.strip() for line in self.stderr if line.strip()]
        return lines[-1] if lines else "(nothing on stderr)"

    def line_with(self, text: str) -> str | None:
        return next((_LOG_PREFIX.sub("", s.strip()) for s in self.stderr if text in s), None)

    def since_fault(self, t: float | None) -> float | None:
        return None if t is None or self.fault_s is None else t - self.fault_s


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _live_workers(launcher: int) -> set[int]:
    """The worker processes (``multiprocessing`` spawn children) of ``launcher`` that have not
    exited; empty where ``/proc`` cannot tell."""
    alive = set()
    for pid in _children(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"spawn_main" in cmdline and state not in ("Z", "X"):
            alive.add(pid)
    return alive


def run_train(
    args: Sequence[str],
    log: Path,
    *,
    cwd: Path,
    fault: str | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    pythonpath: Path | None = None,
) -> Outcome:
    """Run ``python -m lowcomm train ARGS`` in ``cwd`` (paths under it given relative to it, so
    that messages are short), with ``FAULT_ENV=fault`` and ``pythonpath`` first on the import
    path; its stdout and stderr are kept in
    ``log``. Times the fault, the workers' exit and a restart from the process table and the
    stderr lines as they arrive. Killed (its whole process group) after ``timeout_s``."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault is not None:
        env[FAULT_ENV] = fault
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    prefix = str(cwd) + os.sep
    args = [os.path.relpath(a, cwd) if a.startswith(prefix) else a for a in args]
    cmd = [sys.executable, "-m", "lowcomm", "train", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[float, str]] = []
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"$ cd {cwd} && PYTHONPATH={env.get('PYTHONPATH', '')} ")
        out.write(f"{FAULT_ENV}={fault or ''} {' '.join(cmd)}\n")
        out.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        assert proc.stderr is not None
        stderr = proc.stderr

        def read() -> None:
            for line in stderr:
                lines.append((time.monotonic() - t0, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        outcome = Outcome(None, [], 0.0)
        before: set[int] = set()
        watched: set[int] | None = None
        while proc.poll() is None:
            now = time.monotonic() - t0
            if now > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            alive = _live_workers(proc.pid)
            outcome.workers_started |= bool(alive)
            if outcome.fault_s is None:
                outcome.fault_s = next((t for t, s in list(lines) if _FAULT_LINE in s), None)
            if outcome.fault_s is not None and watched is None:
                watched = alive | before
            if watched is not None and outcome.stopped_s is None and not watched & alive:
                outcome.stopped_s = now
            before = alive
            time.sleep(0.05)
        timed_out = proc.poll() is None
        proc.wait()
        outcome.wall_s = time.monotonic() - t0
        reader.join(timeout=10)
        out.write("".join(s + "\n" for _, s in lines))
    outcome.returncode = None if timed_out else proc.returncode
    outcome.stderr = [s for _, s in lines]
    if outcome.fault_s is None:
        outcome.fault_s = next((t for t, s in lines if _FAULT_LINE in s), None)
    if outcome.fault_s is not None and outcome.stopped_s is None and not timed_out:
        outcome.stopped_s = outcome.wall_s
    outcome.restart_s = next((t for t, s in lines if _RESTART_LINE in s), None)
    return outcome


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _git_state(repo: Path) -> str:
    """``git <commit>`` of the checkout ``repo``, noting uncommitted changes under src/; empty
    outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        changes = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    if commit.returncode != 0:
        return ""
    dirty = " with uncommitted changes in src/" if changes.stdout.strip() else ""
    return f"git {commit.stdout.strip()}{dirty}"


def train_args(algo: str, out: Path, *extra: str) -> list[str]:
    return ["--algo", algo, *TINY_JOB_ARGS, *TINY_JOB_ALGO_ARGS[algo], "--out", str(out), *extra]


@dataclass
class Lab:
    """The folder the runs go to, and the reference runs shared by the sections.

    The ``lowcomm`` package is copied into ``<root>/sources`` first and every run imports that
    copy, so that editing the source tree while the table is being made cannot mix versions
    (a reference from one and a resumed run from another)."""

    root: Path
    references: dict[str, Path] = field(default_factory=dict)
    sources_digest: str = ""
    _reference_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        package = Path(lowcomm.__file__).resolve().parent
        copy = self.sources / "lowcomm"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
        self.sources_digest = _digest(copy)

    @property
    def sources(self) -> Path:
        return self.root / "sources"

    def folder(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def train(
        self,
        args: Sequence[str],
        log: Path,
        *,
        fault: str | None = None,
        timeout_s: float = RUN_TIMEOUT_S,
    ) -> Outcome:
        return run_train(
            args, log, cwd=self.root, fault=fault, timeout_s=timeout_s, pythonpath=self.sources
        )

    def reference(self, algo: str) -> Path:
        """The uninterrupted run of ``algo`` (made once), checkpointing every
        :data:`REFERENCE_EVERY` steps. Thread-safe: a caller asking while another thread
        makes it waits for that run."""
        with self._reference_lock:
            return self._reference(algo)

    def _reference(self, algo: str) -> Path:
        if algo not in self.references:
            out = self.folder("references", algo)
            args = train_args(algo, out, "--checkpoint-every", str(REFERENCE_EVERY))
            print(f"[{time.strftime('%H:%M:%S')}] reference run: {algo}", flush=True)
            outcome = self.train(args, out.with_suffix(".log"))
            if outcome.returncode != 0:
                raise RuntimeError(f"the reference run of {algo} failed: {outcome.last_line()}")
            self.references[algo] = out
        return self.references[algo]


def resumed_at(run: Path) -> list[int] | None:
    try:
        return list(read_summary(run)["resumed_at"])
    except (OSError, KeyError, ValueError):
        return None


# --- section 1: kill points and resumes --------------------------------------------------------


@dataclass(frozen=True)
class KillPoint:
    algo: str
    label: str  # where in the algorithm's schedule
    rank: int
    step: int
    mode: str  # kill or exit
    every: int  # --checkpoint-every of the faulted run

    @property
    def resume_step(self) -> int:
        """The last checkpoint before the fault (the one of the fault's own step is not written:
        the hook fires before it)."""
        return (self.step - 1) // self.every * self.every


def _kill_points(algo: str) -> list[KillPoint]:
    """Two kill points per algorithm (rank 1 killed mid-round, rank 0 exiting right after an
    all-reduce was launched); a fault at a checkpoint step for co2 and the fragment methods, and
    two more for co2."""
    schedule = REGISTRY[algo].schedule
    fragmented = schedule is schedules.FRAGMENTS
    # resumes from step 9; co2's checkpoint there holds round 2's result, not yet applied, the
    # fragment methods' the all-reduce launched at step 9
    points = [KillPoint(algo, "mid-round", 1, 10, "kill", 3)]
    if fragmented:  # fragment all-reduces are launched at odd steps
        points.append(KillPoint(algo, "all-reduce just launched (in flight)", 0, 11, "exit", 4))
    elif schedule is schedules.EVERY_STEP:  # an all-reduce every step, completed within it
        points.append(KillPoint(algo, "after a step's all-reduce", 0, 8, "exit", 4))
    else:  # round 2's all-reduce is launched at step 8; co2's stays in flight through round 3
        points.append(KillPoint(algo, "round all-reduce just launched", 0, 8, "exit", 4))
    if fragmented or algo == "co2":
        # the fault precedes that step's checkpoint: the run resumes from step 3
        points.append(KillPoint(algo, "at a checkpoint step", 1, 6, "kill", 3))
    if algo == "co2":
        points += [
            # resumes from step 4, whose checkpoint holds round 1's all-reduce in flight
            KillPoint(algo, "in-flight round in the checkpoint", 1, 5, "exit", 4),
            KillPoint(algo, "last step, before the final checkpoint", 0, 12, "kill", 3),
        ]
    return points


KILL_POINTS: list[KillPoint] = [p for algo in TINY_JOB_ALGO_ARGS for p in _kill_points(algo)]
KILL_POINTS_QUICK: list[KillPoint] = [
    KillPoint("co2", "round all-reduce just launched", 1, 8, "kill", 4)
]


def kill_resume_rows(lab: Lab, points: Sequence[KillPoint]) -> list[Row]:
    """Fault a run at each kill point, resume it, and compare it with the algorithm's reference
    (asked for once the resumed run is over: :meth:`Lab.reference` may be made meanwhile by
    another thread)."""
    rows = []
    for i, point in enumerate(points):
        out = lab.folder("kill-resume", f"{i:02d}-{point.algo}-r{point.rank}s{point.step}")
        print(
            f"[{time.strftime('%H:%M:%S')}] {point.algo}: {point.mode} rank {point.rank} "
            f"at step {point.step}",
            flush=True,
        )
        args = train_args(point.algo, out, "--checkpoint-every", str(point.every))
        fault = f"{point.rank}:{point.step}:{point.mode}"
        faulted = lab.train(args, out.with_suffix(".faulted.log"), fault=fault)
        resumed = lab.train([*args, "--resume"], out.with_suffix(".resumed.log"))
        reference = lab.reference(point.algo)
        if resumed.returncode != 0:
            result = RunComparison(problem=f"resume failed: {resumed.last_line()}")
        else:
            result = compare_runs(reference, out)
        at = resumed_at(out)
        resumed_from = "-" if not at else ", ".join(map(str, at))
        if at is not None and at != [point.resume_step]:
            resumed_from += f" (expected {point.resume_step})"
        if result.problem is not None:
            identical = f"no ({result.problem})"
        else:
            identical = "yes" if result.identical else "no"
        rows.append(
            {
                "algorithm": point.algo,
                "kill point": point.label,
                "fault": f"rank {point.rank}, step {point.step}, {point.mode}",
                "checkpoint every": str(point.every),
                "faulted run exit": _code(faulted),
                "resumed from step": resumed_from,
                "identical": identical,
                "differing tensors": (
                    "-"
                    if result.problem
                    else f"{len(result.differing_tensors)} of {result.tensors}"
                ),
                "other differences": (
                    "-"
                    if result.problem
                    else (", ".join(result.differing_values[:3]) or "0")
                    + (" ..." if len(result.differing_values) > 3 else "")
                ),
            }
        )
    return rows


def kill_resume_totals(rows: list[Row]) -> str:
    mismatches = sum(r["identical"] != "yes" for r in rows)
    algos = len({r["algorithm"] for r in rows})
    return f"{len(rows)} kill points over {algos} algorithms, {mismatches} mismatches"


# --- section 2: faults and restarts ------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    mode: str  # kill, exit, raise or hang
    restarts: int


FAULTS: list[Fault] = [
    Fault(1, 10, "kill", 1),
    Fault(0, 7, "exit", 1),
    Fault(1, 5, "raise", 1),
    Fault(1, 8, "hang", 1),
    Fault(1, 5, "kill", 0),
    Fault(0, 5, "exit", 0),
    Fault(1, 5, "raise", 0),
    Fault(0, 5, "hang", 0),
]
FAULTS_QUICK: list[Fault] = [Fault(1, 10, "kill", 1), Fault(1, 5, "raise", 0)]
FAULT_ALGO = "co2"


def _seconds(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def _verdict(result: RunComparison) -> str:
    if result.problem is not None:
        return f"no ({result.problem})"
    if result.identical:
        return "yes"
    others = ", ".join(result.differing_values[:2])
    return f"no ({len(result.differing_tensors)} of {result.tensors} tensors; {others or '-'})"


def _short(line: str) -> str:
    """A report line without the prefix every error line of the command starts with."""
    return line[len(ERROR_PREFIX) :] if line.startswith(ERROR_PREFIX) else line


def _code(outcome: Outcome) -> str:
    return "timeout" if outcome.returncode is None else str(outcome.returncode)


def fault_rows(lab: Lab, faults: Sequence[Fault]) -> list[Row]:
    """Inject each fault into a co2 run checkpointing as the reference does."""
    rows = []
    for i, fault in enumerate(faults):
        reference = lab.reference(FAULT_ALGO)
        name = f"{i:02d}-{fault.mode}-r{fault.rank}s{fault.step}-restarts{fault.restarts}"
        out = lab.folder("faults", name)
        print(f"[{time.strftime('%H:%M:%S')}] fault {name}", flush=True)
        extra = ["--checkpoint-every", str(REFERENCE_EVERY)]
        extra += ["--max-restarts", str(fault.restarts)]
        if fault.mode == "hang":
            extra += ["--collective-timeout", str(HANG_COLLECTIVE_TIMEOUT_S)]
        outcome = lab.train(
            train_args(FAULT_ALGO, out, *extra),
            out.with_suffix(".log"),
            fault=f"{fault.rank}:{fault.step}:{fault.mode}",
        )
        completed = outcome.returncode == 0
        if fault.restarts:
            report = outcome.line_with(_RESTART_LINE) or outcome.last_line()
            same = _verdict(compare_runs(reference, out)) if completed else "-"
        else:
            report, same = _short(outcome.last_line()), "-"
        named = f"worker rank {fault.rank} failed" in report
        rows.append(
            {
                "restarts": str(fault.restarts),
                "fault": f"{fault.mode}, rank {fault.rank}, step {fault.step}",
                "exit code": _code(outcome),
                "completed": "yes" if completed else "no",
                "final state = fault-free": same,
                "workers stopped after (s)": _seconds(outcome.since_fault(outcome.stopped_s)),
                "restarted after (s)": _seconds(outcome.since_fault(outcome.restart_s)),
                "names the faulty rank": "yes" if named else "no",
                "report line": report,
            }
        )
    return rows


def fault_totals(rows: list[Row]) -> str:
    restarted = [r for r in rows if r["restarts"] != "0"]
    plain = [r for r in rows if r["restarts"] == "0"]
    ok = sum(r["completed"] == "yes" and r["final state = fault-free"] == "yes" for r in restarted)
    stopped = sum(r["exit code"] not in ("0", "timeout") for r in plain)
    named = sum(r["names the faulty rank"] == "yes" for r in rows)
    return (
        f"{len(rows)} faults injected; with restarts {ok} of {len(restarted)} runs completed "
        f"with the fault-free final state; without restarts {stopped} of {len(plain)} runs "
        f"stopped with an error; {named} of {len(rows)} reports name the faulty rank"
    )


# --- section 3: bad inputs ---------------------------------------------------------------------


@dataclass(frozen=True)
class BadInput:
    label: str
    # (lab, case folder, fresh output folder) -> arguments after the valid base ones
    make: Callable[[Lab, Path, Path], list[str]]


def flags(*args: str) -> Callable[[Lab, Path, Path], list[str]]:
    return lambda lab, folder, out: list(args)


def _config(text: str) -> Callable[[Lab, Path, Path], list[str]]:
    def make(lab: Lab, folder: Path, out: Path) -> list[str]:
        path = folder / "config.toml"
        path.write_text(text)
        return ["--config", str(path)]

    return make


def _data(content: bytes | None, *, folder_name: str | None = None) -> Callable[..., list[str]]:
    """``--data`` a file with ``content`` (``None``: a path that does not exist), or an empty
    folder called ``folder_name``."""

    def make(lab: Lab, folder: Path, out: Path) -> list[str]:
        if folder_name is not None:
            path = folder / folder_name
            path.mkdir()
        else:
            path = folder / "corpus.txt"
            if content is not None:
                path.write_bytes(content)
        return ["--data", str(path)]

    return make


def _checkpoint(
    change: Callable[[Path], None] | None, *extra: str, resume: bool = True
) -> Callable[[Lab, Path, Path], list[str]]:
    """Resume (into a copy of co2's reference run) from its step-9 checkpoint after ``change``
    to that checkpoint's folder, with ``extra`` flags."""

    def make(lab: Lab, folder: Path, out: Path) -> list[str]:
        run = folder / "run"
        shutil.copytree(lab.reference("co2"), run)
        step = run / ckpt.CHECKPOINTS / "step-000009"
        if change is not None:
            change(step)
        args = ["--out", str(run), *extra]
        return [*args, "--resume", str(step)] if resume else args

    return make


def _truncate(name: str, keep: float) -> Callable[[Path], None]:
    def change(step: Path) -> None:
        path = step / name
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    return change


def _remove(name: str) -> Callable[[Path], None]:
    return lambda step: (step / name).unlink()


def _copy(src: str, dst: str) -> Callable[[Path], None]:
    def change(step: Path) -> None:
        shutil.copyfile(step / src, step / dst)

    return change


def _write(name: str, text: str) -> Callable[[Path], None]:
    def change(step: Path) -> None:
        (step / name).write_text(text)

    return change


def _out_is_file(lab: Lab, folder: Path, out: Path) -> list[str]:
    path = folder / "a-file"
    path.write_text("not a folder\n")
    return ["--out", str(path)]


def _resume_without_checkpoint(lab: Lab, folder: Path, out: Path) -> list[str]:
    out.mkdir()
    return ["--resume"]


BAD_INPUTS: list[BadInput] = [
    # flag values
    BadInput("--steps -5", flags("--steps", "-5")),
    BadInput("--steps ten", flags("--steps", "ten")),
    BadInput("--workers 0", flags("--workers", "0")),
    BadInput("--algo nosuch", flags("--algo", "nosuch")),
    BadInput("--no-such-flag 1", flags("--no-such-flag", "1")),
    BadInput("--compression int3", flags("--compression", "int3")),
    BadInput("--compression topk:2", flags("--compression", "topk:2")),
    BadInput("--link 10parsecs", flags("--link", "10parsecs")),
    BadInput(
        "--algo streaming --num-fragments 3 (sync every 4)",
        flags("--algo", "streaming", "--num-fragments", "3"),
    ),
    BadInput(
        "--algo streaming --num-fragments 2 --overlap 4 (sync every 4)",
        flags("--algo", "streaming", "--num-fragments", "2", "--overlap", "4"),
    ),
    BadInput("--n-head 3 (n-embd 32)", flags("--n-head", "3")),
    BadInput("--lr nan", flags("--lr", "nan")),
    BadInput("--dropout 1.5", flags("--dropout", "1.5")),
    BadInput("--collective-timeout 0", flags("--collective-timeout", "0")),
    BadInput("--backend nccl (no GPU)", flags("--backend", "nccl")),
    BadInput("--block-size 100000 (longer than the corpus)", flags("--block-size", "100000")),
    # config files
    BadInput("config: unknown key (sync_evry = 4)", _config("sync_evry = 4\n")),
    BadInput("config: malformed TOML", _config("steps = = 12\n[unclosed\n")),
    BadInput("config: a table", _config("[model]\nn_layer = 2\n")),
    BadInput('config: wrong type (lr = "fast")', _config('lr = "fast"\n')),
    BadInput(
        "config: file does not exist",
        lambda lab, folder, out: ["--config", str(folder / "missing.toml")],
    ),
    # data
    BadInput("--data: path does not exist", _data(None)),
    BadInput("--data: empty file", _data(b"")),
    BadInput("--data: not UTF-8 (binary bytes)", _data(bytes(range(256)) * 64)),
    BadInput("--data: empty folder", _data(None, folder_name="empty")),
    # output folder
    BadInput("--out: an existing file", _out_is_file),
    BadInput("--out: holds a run, no --overwrite", _checkpoint(None, resume=False)),
    # checkpoints to resume from
    BadInput("--resume: no checkpoint in --out", _resume_without_checkpoint),
    BadInput(
        "--resume: path does not exist",
        lambda lab, folder, out: ["--resume", str(folder / "no-such-run")],
    ),
    BadInput("--resume: rank-1.pt truncated to half", _checkpoint(_truncate("rank-1.pt", 0.5))),
    BadInput("--resume: rank-0.pt empty", _checkpoint(_truncate("rank-0.pt", 0.0))),
    BadInput("--resume: rank-1.pt missing", _checkpoint(_remove("rank-1.pt"))),
    BadInput(
        "--resume: rank-1.pt replaced by rank-0.pt", _checkpoint(_copy("rank-0.pt", "rank-1.pt"))
    ),
    BadInput("--resume: meta.json corrupt", _checkpoint(_write(ckpt.MANIFEST, "{not json"))),
    BadInput("--resume: written by 2 workers, run has 3", _checkpoint(None, "--workers", "3")),
    BadInput("--resume: written by co2, run is diloco", _checkpoint(None, "--algo", "diloco")),
]
BAD_INPUTS_QUICK = [
    "--steps -5",
    "config: unknown key (sync_evry = 4)",
    "--data: path does not exist",
    "--resume: rank-1.pt truncated to half",
]


def bad_input_rows(lab: Lab, cases: Sequence[BadInput], *, jobs: int = 2) -> list[Row]:
    """Run ``lowcomm train`` (co2, the tiny settings) with each bad input, ``jobs`` at a time
    (most are refused before any worker starts)."""
    prepared = []
    for i, case in enumerate(cases):  # files first, in order (some copy a reference run)
        folder = lab.folder("bad-inputs", f"{i:02d}")
        folder.mkdir()
        out = folder / "out"
        prepared.append((i, case, folder, [*train_args("co2", out), *case.make(lab, folder, out)]))

    def row(item: tuple[int, BadInput, Path, list[str]]) -> Row:
        i, case, folder, args = item
        print(f"[{time.strftime('%H:%M:%S')}] bad input: {case.label}", flush=True)
        outcome = lab.train(args, folder / "run.log", timeout_s=REFUSAL_TIMEOUT_S)
        return {
            "#": str(i + 1),
            "input": case.label,
            "exit code": _code(outcome),
            "traceback": "yes" if outcome.traceback else "no",
            "workers started": "yes" if outcome.workers_started else "no",
            "message": _short(outcome.last_line()),
        }

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(row, prepared))


def bad_input_totals(rows: list[Row]) -> str:
    codes: dict[str, int] = {}
    for r in rows:
        codes[r["exit code"]] = codes.get(r["exit code"], 0) + 1
    by_code = ", ".join(f"{n} with exit code {c}" for c, n in sorted(codes.items()))
    tracebacks = sum(r["traceback"] == "yes" for r in rows)
    started = sum(r["workers started"] == "yes" for r in rows)
    return (
        f"{len(rows)} bad inputs: {by_code}; {tracebacks} with a traceback; "
        f"{started} refused only after workers started"
    )


# --- section 4: numeric guard -----------------------------------------------------------------

GUARD_ALGOS = list(outer_names())
GUARD_FAULT = "1:5:nan"  # rank 1's first parameter turns NaN after step 5 (mid-round 2)


def _summary_of(out: Path) -> dict[str, Any] | None:
    try:
        return read_summary(out)
    except (OSError, ValueError):
        return None


def numeric_guard_rows(lab: Lab, quick: bool) -> list[Row]:
    """A worker diverges (NaN in its parameters) under each algorithm, with either policy."""
    rows = []
    for algo in GUARD_ALGOS[:1] if quick else GUARD_ALGOS:
        for policy in ("skip", "raise"):
            out = lab.folder("numeric-guard", f"{algo}-{policy}")
            print(f"[{time.strftime('%H:%M:%S')}] numeric guard {algo} {policy}", flush=True)
            outcome = lab.train(
                train_args(algo, out, "--nan-policy", policy),
                out.with_suffix(".log"),
                fault=GUARD_FAULT,
            )
            summary = _summary_of(out) if outcome.returncode == 0 else None
            val = None if summary is None else summary.get("val_loss_final")
            finite = val is not None and val == val and abs(val) != float("inf")
            rows.append(
                {
                    "algorithm": algo,
                    "policy": policy,
                    "exit code": _code(outcome),
                    "skipped updates": "-" if summary is None else str(summary["skipped_updates"]),
                    "final val loss": "-" if val is None else f"{val:.3f}",
                    "finite": "-" if summary is None else "yes" if finite else "no",
                    "C++ abort": "yes"
                    if any("terminate called" in x for x in outcome.stderr)
                    else "no",
                    "report line": _short(outcome.last_line()) if policy == "raise" else "-",
                }
            )
    return rows


def numeric_guard_totals(rows: list[Row]) -> str:
    skip = [r for r in rows if r["policy"] == "skip"]
    raised = [r for r in rows if r["policy"] == "raise"]
    ok = sum(r["exit code"] == "0" and r["finite"] == "yes" for r in skip)
    one = sum(r["skipped updates"] == "1" for r in skip)
    stopped = sum(r["exit code"] == "1" and "NonFiniteError" in r["report line"] for r in raised)
    aborts = sum(r["C++ abort"] == "yes" for r in rows)
    return (
        f"{len(skip)} diverging runs with skip: {ok} completed with a finite model, {one} with "
        f"exactly one skipped update; {len(raised)} with raise: {stopped} stopped with "
        f"NonFiniteError; {aborts} C++ aborts"
    )


# --- section 5: consistency guard -------------------------------------------------------------

CONSISTENCY_CASES: list[tuple[str, str]] = [
    ("same model and settings", "same"),
    ("rank 1 built from another seed", "seed"),
    ("rank 1 has a wider layer", "shape"),
    ("rank 1 has outer_lr 0.5 (rank 0: 0.7)", "outer_lr"),
    ("rank 1 has inner lr 0.02 (rank 0: 0.01)", "inner_lr"),
    ("rank 1 has shard_outer_state=True", "sharded"),
    ("lowcomm train: rank 1 parsed --lr 1e-3", "job_lr"),
    ("lowcomm train: rank 1 read another corpus", "job_data"),
]


def _consistency_job(rank: int, world_size: int, cases: list[str]) -> list[str | None]:
    """Each case on a real 2-rank gloo group: the message every rank raised, or None."""
    from lowcomm.data import load_corpus
    from lowcomm.train.config import TrainConfig
    from lowcomm.train.loop import check_same_job

    messages: list[str | None] = []
    for case in cases:
        other = rank == 1
        try:
            if case.startswith("job_"):
                corpus = load_corpus(None)
                if case == "job_data" and other:
                    corpus.val = corpus.val[:-1]
                lr = 1e-3 if case == "job_lr" and other else 2e-3
                check_same_job(TrainConfig(algo="co2", lr=lr, out=f"runs/r{rank}"), corpus)
            else:
                torch.manual_seed(4 if case == "seed" and other else 3)
                width = 9 if case == "shape" and other else 8
                model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Linear(width, 3))
                lr = 0.02 if case == "inner_lr" and other else 0.01
                inner = torch.optim.AdamW(model.parameters(), lr=lr)
                algo = lowcomm.DiLoCo(
                    model,
                    inner,
                    sync_every=4,
                    outer_lr=0.5 if case == "outer_lr" and other else 0.7,
                    shard_outer_state=case == "sharded" and other,
                )
                algo.step()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def consistency_rows(lab: Lab, quick: bool) -> list[Row]:
    from lowcomm.testing import run_workers

    cases = CONSISTENCY_CASES[:3] if quick else CONSISTENCY_CASES
    print(f"[{time.strftime('%H:%M:%S')}] consistency guard: {len(cases)} cases", flush=True)
    per_rank = run_workers(_consistency_job, WORKERS, [key for _, key in cases], timeout_s=120)
    rows = []
    for i, (label, _) in enumerate(cases):
        messages = [r[i] for r in per_rank]
        rows.append(
            {
                "ranks": label,
                "refused": "yes" if messages[0] is not None else "no",
                "on every rank, same message": "yes"
                if all(m == messages[0] for m in messages)
                else "no",
                "message": messages[0] or "-",
            }
        )
    return rows


def consistency_totals(rows: list[Row]) -> str:
    differing = rows[1:]
    refused = sum(
        r["refused"] == "yes" and r["on every rank, same message"] == "yes" for r in differing
    )
    return (
        f"{len(differing)} differences tried: {refused} refused on every rank with the same "
        f"message; agreeing ranks {'passed' if rows[0]['refused'] == 'no' else 'were refused'}"
    )


# --- the report --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """One table of the report: ``rows(lab, quick)`` runs its cases (a subset when ``quick``)
    and returns one row per case, keyed by ``columns``; ``totals(rows)`` sums them up in a line.
    """

    key: str  # for --sections
    title: str
    intro: str
    columns: tuple[str, ...]
    rows: Callable[[Lab, bool], list[Row]]
    totals: Callable[[list[Row]], str]


SECTIONS: list[Section] = [
    Section(
        "kill-resume",
        "Kill points tried and mismatches found",
        "A worker is killed (SIGKILL) or exits (`os._exit(3)`) right after `algo.step()` of the "
        "step given, before that step's evaluation and checkpoint; the run is then resumed with "
        "`--resume` (the latest complete checkpoint) and compared with an uninterrupted run "
        f"checkpointing every {REFERENCE_EVERY} steps: both ranks' full state at step "
        f"{TINY_JOB_STEPS} (model, inner optimizer, algorithm state, RNG states), rank 0's "
        "final model and algorithm state, and the metrics and summary numbers, bit for bit. "
        "Streaming DiLoCo and CoCoDC run 2 fragments with overlap 1.",
        (
            "algorithm",
            "kill point",
            "fault",
            "checkpoint every",
            "faulted run exit",
            "resumed from step",
            "identical",
            "differing tensors",
            "other differences",
        ),
        lambda lab, quick: kill_resume_rows(lab, KILL_POINTS_QUICK if quick else KILL_POINTS),
        kill_resume_totals,
    ),
    Section(
        "faults",
        "Faults injected and runs completed",
        f"{FAULT_ALGO}, checkpoints every {REFERENCE_EVERY} steps, `--collective-timeout "
        f"{HANG_COLLECTIVE_TIMEOUT_S:g}` for hangs (the hung worker sleeps; its peer's "
        "collective times out). Times are seconds after the faulty worker announced its fault: "
        "until every worker alive then had exited (read from the process table), and until the "
        "restarted group's first line. With restarts the report line is the restarted group's, "
        "the final state is compared as in the first table; without, it is the launcher's last "
        f"line, less the `{ERROR_PREFIX.strip()}` prefix.",
        (
            "restarts",
            "fault",
            "exit code",
            "completed",
            "final state = fault-free",
            "workers stopped after (s)",
            "restarted after (s)",
            "names the faulty rank",
            "report line",
        ),
        lambda lab, quick: fault_rows(lab, FAULTS_QUICK if quick else FAULTS),
        fault_totals,
    ),
    Section(
        "bad-inputs",
        "Bad inputs tried and how each was reported",
        "Each input is added to a valid co2 command (the tiny settings, a fresh `--out`). "
        "Traceback: whether a Python traceback reached stderr. Workers started: whether the "
        "launcher got as far as starting workers. The message is the last line on stderr, less "
        f"the `{ERROR_PREFIX.strip()}` prefix where it has one.",
        ("#", "input", "exit code", "traceback", "workers started", "message"),
        lambda lab, quick: bad_input_rows(
            lab, [c for c in BAD_INPUTS if c.label in BAD_INPUTS_QUICK] if quick else BAD_INPUTS
        ),
        bad_input_totals,
    ),
    Section(
        "numeric-guard",
        "Numeric guard: diverging workers",
        f"`{FAULT_ENV}={GUARD_FAULT}` sets one value of rank 1's first parameter to NaN after "
        "step 5 (mid-round 2), with `--nan-policy skip` and `raise`. Skipped updates and the "
        "final validation loss come from `summary.json`; C++ abort: whether 'terminate called' "
        "reached stderr.",
        (
            "algorithm",
            "policy",
            "exit code",
            "skipped updates",
            "final val loss",
            "finite",
            "C++ abort",
            "report line",
        ),
        numeric_guard_rows,
        numeric_guard_totals,
    ),
    Section(
        "consistency",
        "Consistency guard: ranks that start out different",
        "Two real ranks (gloo, 127.0.0.1) build a DiLoCo over a small model, or run `lowcomm "
        "train`'s own check of its settings and corpus, with one difference on rank 1; the "
        "first `step()` (or the job's start) compares them. The message is rank 0's.",
        ("ranks", "refused", "on every rank, same message", "message"),
        consistency_rows,
        consistency_totals,
    ),
]


def section(key: str) -> Section:
    """The section of :data:`SECTIONS` called ``key``."""
    return next(s for s in SECTIONS if s.key == key)


MESSAGE_CHARS = 120


def _cell(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MESSAGE_CHARS:
        text = text[: MESSAGE_CHARS - 1] + "…"
    return text.replace("|", "\\|")


def render(
    results: Sequence[tuple[Section, list[Row]]],
    *,
    command: str,
    runtime_s: float | None,
    sources: str = "",
    load: tuple[float, float] | None = None,
) -> str:
    """The report: description, command, machine line, a table per section, the totals.
    ``sources`` says which lowcomm sources ran; ``load`` is the 1-minute load average at the
    start and at the end (timings depend on it)."""
    machine = (
        f"{datetime.date.today().isoformat()} · {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPU cores · Python {platform.python_version()} · "
        f"torch {torch.__version__} · lowcomm {lowcomm.__version__}"
    )
    if sources:
        machine += f" ({sources})"
    if runtime_s is not None:
        machine += f" · {runtime_s / 60:.1f} minutes"
    if load is not None:
        machine += f" · load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
    lines = [
        "# Reliability of `lowcomm train`",
        "",
        "What `lowcomm train` does when a worker dies and when its input is bad, from real "
        f"processes: a tiny GPT ({TINY_JOB['n_layer']} layers, width {TINY_JOB['n_embd']}, "
        f"context {TINY_JOB['block_size']}, batch {TINY_JOB['batch_size']}), {WORKERS} workers, "
        f"{TINY_JOB_STEPS} inner steps, rounds of {TINY_JOB['sync_every']}, dropout "
        f"{TINY_JOB['dropout']}, gloo on 127.0.0.1. Faults are injected with the "
        f"test-only hook `{FAULT_ENV}=RANK:STEP[:MODE]`. Kill points: a faulted run resumed "
        "from its checkpoint must end bit-identical to an uninterrupted one. Faults: whether the "
        "job completes under `--max-restarts 1` and how the failure is reported. Bad inputs: "
        "each should be refused with one line naming the problem, no traceback.",
        "",
        f"Command: `{command}`",
        "",
        machine,
    ]
    for number, (section, rows) in enumerate(results, 1):
        lines += ["", f"## {number}. {section.title}", "", section.intro, ""]
        lines.append("| " + " | ".join(section.columns) + " |")
        lines.append("|" + " --- |" * len(section.columns))
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in section.columns) + " |")
    lines += ["", "## Totals", ""]
    for number, (section, rows) in enumerate(results, 1):
        lines.append(f"- {number}. {section.title}: {section.totals(rows)}")
    return "\n".join(lines) + "\n"


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one case per fault section, few inputs")
    keys = [s.key for s in SECTIONS]
    ap.add_argument(
        "--sections",
        nargs="+",
        choices=keys,
        default=keys,
        help="run only these sections (default: all, in this order)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="folder for the runs, emptied first (default: benchmarks/results/reliability/, "
        "with --quick its quick/ subfolder)",
    )
    ap.add_argument("--report", type=Path, help="default: benchmarks/reliability.md")
    args = ap.parse_args(argv)
    report = args.report
    out = args.out or HERE / "results" / "reliability" / ("quick" if args.quick else "")
    if report is None:
        report = out / "reliability-quick.md" if args.quick else HERE / "reliability.md"
    chosen = [s for s in SECTIONS if s.key in args.sections]

    if out.exists():
        shutil.rmtree(out)
    lab = Lab(out)
    t0 = time.monotonic()
    load_start = _load()
    results = [(section, section.rows(lab, args.quick)) for section in chosen]
    runtime = time.monotonic() - t0
    git = _git_state(Path(lowcomm.__file__).resolve().parents[2])
    sources = ", ".join(filter(None, [git, f"sources {lab.sources_digest}"]))
    command = "python benchmarks/reliability.py" + (" " + " ".join(argv) if argv else "")
    if argv is None and len(sys.argv) > 1:
        command = "python benchmarks/reliability.py " + " ".join(sys.argv[1:])
    text = render(
        results, command=command, runtime_s=runtime, sources=sources, load=(load_start, _load())
    )
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text)
    print(text)
    print(f"wrote {report} ({runtime:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
