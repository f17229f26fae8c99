"""Interrupts: Ctrl-C (SIGINT to the command's process group, as a terminal sends it) and SIGTERM
(a supervisor or ``kill``) stop a ``lowcomm`` command with exit code 130 and no traceback; a
``lowcomm train`` run keeps what it had measured in ``summary.json`` (``"status":
"interrupted"``) and says where ``--resume`` continues, as a failed run does. Real processes:
the command in a session of its own, signalled once its run has written a checkpoint (or, for
``lowcomm bench``, once its real-link cell is running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowcomm.testing.jobs import tiny_job_args

EXIT_INTERRUPTED = 130  # the documented exit code (lowcomm --help, docs/train.md)


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the command ended with {proc.returncode} before {path}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c", "sigterm"],
)
def test_an_interrupted_run_exits_130_and_says_where_to_resume(
    tmp_path: Path, sig: signal.Signals, group: bool
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--algo", "co2", *tiny_job_args(steps=4000), "--checkpoint-every", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", *argv, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _wait_for(out / "checkpoints" / "step-000008" / "meta.json", proc, 90)
        if group:  # a terminal's Ctrl-C reaches every process of the foreground group
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        stdout, stderr = (b.decode() for b in proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    assert stderr.strip().splitlines()[-1] == "lowcomm train: interrupted"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps_done"] >= 8
    checkpoint = summary["checkpoint"]
    assert checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "meta.json"))
    line = next(x for x in stdout.splitlines() if "interrupted; measured before" in x)
    assert f"last complete checkpoint {checkpoint} (--resume continues from it)" in line, line


@pytest.mark.timeout(240)
def test_sigterm_during_a_real_link_cell_of_bench_exits_130(tmp_path: Path) -> None:
    """After an emulated cell (torch elastic's launcher, which takes over SIGTERM and leaves its
    handler in place), a SIGTERM while a real-link cell's workers run in their network
    namespaces stops them and the command with 130, without torch's ``SignalException``."""
    from lowcomm.bench.netshape import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "bench"
    argv = ["bench", "--algos", "co2", "--links", "100mbit", "--workers", "2"]
    argv += ["--steps", "12", "--eval-every", "12", "--eval-batches", "1", "--ceiling-steps", "2"]
    argv += ["--real-links", "100mbit", "--real-algos", "co2", "--no-overhead", "--no-memory"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", *argv, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        # the real cell's run folder appears once its workers are started
        cells = out / "cells"
        deadline = time.monotonic() + 180
        while not any(p.name.endswith("-real") for p in cells.glob("*")):
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "the real-link cell did not start"
            time.sleep(0.1)
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = (b.decode() for b in proc.communicate(timeout=60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "lowcomm bench: interrupted"
