"""Interrupts: Ctrl-C (SIGINT to the command's process group, as a terminal sends it) and SIGTERM
(a supervisor or ``kill``) stop a ``lowcomm`` command with exit code 130 and no traceback; a
``lowcomm train`` run keeps what it had measured in ``summary.json`` (``"status":
"interrupted"``) and says where ``--resume`` continues, as a failed run does. Real processes:
the command in a session of its own, signalled once its run has written a checkpoint (or, for
``lowcomm bench``, once its real-link cell is running).

The three commands run at once (their start-up, mostly imports on one core each, overlaps),
each watched and signalled by a thread of its own as its moment comes; the tests then check
what each did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lowcomm.testing.jobs import tiny_job_args

EXIT_INTERRUPTED = 130  # the documented exit code (lowcomm --help, docs/train.md)


@dataclass
class Interrupted:
    """What a command signalled by :func:`_interrupt` did."""

    out: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    problem: str | None = None
    """Why it was not signalled as planned (it ended first, its moment did not come in time)."""


class _Command:
    """``python -m lowcomm ARGV --out OUT`` in a session of its own, its output to files."""

    def __init__(self, folder: Path, argv: list[str]) -> None:
        folder.mkdir(parents=True)
        self.result = Interrupted(folder / "out")
        self._files = (folder / "stdout.txt", folder / "stderr.txt")
        with open(self._files[0], "wb") as stdout, open(self._files[1], "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lowcomm", *argv, "--out", str(self.result.out)],
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )

    def interrupt(
        self, ready: Callable[[], bool], what: str, timeout_s: float, sig: int, group: bool
    ) -> None:
        """Once ``ready()`` (``what``: for the report), within ``timeout_s``: send ``sig`` to
        the command (``group``: to its process group), then wait (at most 60 s) for it to
        exit. What went otherwise is the result's ``problem``."""
        result = self.result
        try:
            deadline = time.monotonic() + timeout_s
            while not ready():
                if self.proc.poll() is not None:
                    result.problem = f"the command ended with {self.proc.returncode} before {what}"
                    return
                if time.monotonic() > deadline:
                    result.problem = f"{what} did not come within {timeout_s} s"
                    return
                time.sleep(0.1)
            if group:  # a terminal's Ctrl-C reaches every process of the foreground group
                os.killpg(self.proc.pid, sig)
            else:
                os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=60)
        except Exception as e:  # reported by the test
            result.problem = f"{type(e).__name__}: {e}"
        finally:
            self.stop()
            result.returncode = self.proc.returncode
            result.stdout, result.stderr = (f.read_text(errors="replace") for f in self._files)

    def stop(self) -> None:
        """Kill what is left of the command (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _run_argv() -> list[str]:
    return ["train", "--algo", "co2", *tiny_job_args(steps=4000), "--checkpoint-every", "4"]


def _bench_argv() -> list[str]:
    argv = ["bench", "--algos", "co2", "--links", "100mbit", "--workers", "2"]
    argv += ["--steps", "12", "--eval-every", "12", "--eval-batches", "1", "--ceiling-steps", "2"]
    argv += ["--real-links", "100mbit", "--real-algos", "co2", "--no-overhead", "--no-memory"]
    return argv


RUNS = {"ctrl-c": (signal.SIGINT, True), "sigterm": (signal.SIGTERM, False)}
"""The interrupted ``lowcomm train`` runs: the signal and whether it goes to the group."""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Interrupted]]:
    """Each command of the module, signalled at its moment: the :data:`RUNS`, a ``lowcomm
    train`` run signalled once it has written its step-8 checkpoint, and ``bench`` (where real
    links can be shaped here), a ``lowcomm bench`` sent SIGTERM 2 s after the workers of its
    real-link cell started."""
    from lowcomm.bench.netshape import unavailable_reason

    tmp = tmp_path_factory.mktemp("interrupts")
    commands: dict[str, _Command] = {}
    watchers: list[threading.Thread] = []
    try:
        for name, (sig, group) in RUNS.items():
            command = commands[name] = _Command(tmp / name, _run_argv())
            step8 = command.result.out / "checkpoints" / "step-000008" / "meta.json"
            watchers.append(
                threading.Thread(
                    target=command.interrupt, args=(step8.exists, str(step8), 90, sig, group)
                )
            )
        if unavailable_reason() is None:
            bench = commands["bench"] = _Command(tmp / "bench", _bench_argv())
            cells = bench.result.out / "cells"
            started: list[float] = []

            def real_cell_running() -> bool:
                # the real cell's run folder appears once its workers are started
                if not started and any(p.name.endswith("-real") for p in cells.glob("*")):
                    started.append(time.monotonic())
                return bool(started) and time.monotonic() > started[0] + 2.0

            what = "the real-link cell"
            watchers.append(
                threading.Thread(
                    target=bench.interrupt,
                    args=(real_cell_running, what, 180, signal.SIGTERM, False),
                )
            )
        for watcher in watchers:
            watcher.start()
        for watcher in watchers:
            watcher.join(timeout=300)
        yield {name: command.result for name, command in commands.items()}
    finally:
        for command in commands.values():
            command.stop()


@pytest.mark.timeout(360)  # the first test of the module waits for every command
@pytest.mark.parametrize("name", list(RUNS))
def test_an_interrupted_run_exits_130_and_says_where_to_resume(
    name: str, interrupted: dict[str, Interrupted]
) -> None:
    run = interrupted[name]
    stdout, stderr = run.stdout, run.stderr
    assert run.problem is None, f"{run.problem}\n{stderr[-3000:]}"
    assert run.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    assert stderr.strip().splitlines()[-1] == "lowcomm train: interrupted"
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] >= 8
    checkpoint = summary["checkpoint"]
    assert checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "meta.json"))
    line = next(x for x in stdout.splitlines() if "interrupted; measured before" in x)
    assert f"last complete checkpoint {checkpoint} (--resume continues from it)" in line, line


@pytest.mark.timeout(360)
def test_sigterm_during_a_real_link_cell_of_bench_exits_130(
    interrupted: dict[str, Interrupted],
) -> None:
    """After an emulated cell (torch elastic's launcher, which takes over SIGTERM and leaves its
    handler in place), a SIGTERM while a real-link cell's workers run in their network
    namespaces stops them and the command with 130, without torch's ``SignalException``."""
    from lowcomm.bench.netshape import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    run = interrupted["bench"]
    stderr = run.stderr
    assert run.problem is None, f"{run.problem}\n{stderr[-3000:]}"
    assert run.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "lowcomm bench: interrupted"
