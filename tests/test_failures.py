"""Worker failures in `lowcomm train`: the root cause is named, the others stop within a bounded
time, `--max-restarts` restarts the group from the last checkpoint with the same result, and
processes exit without C++ aborts. Faults are injected by the test-only hook ``FAULT_ENV``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from lowcomm.cli import main
from lowcomm.testing.jobs import TINY_JOB_ALGO_ARGS, TINY_JOB_ARGS, read_summary
from lowcomm.testing.runs import assert_same_run, read_records
from lowcomm.train import launcher
from lowcomm.train.checkpoint import complete_checkpoints, rank_file
from lowcomm.train.faults import LOST_STATE_ENV, mark_lost
from lowcomm.train.loop import FAULT_ENV

ABORT = "terminate called"  # what a C++ std::terminate at shutdown prints


def _start(
    out: str, *extra: str, fault: str | None = None, lost: str | None = None
) -> subprocess.Popen[str]:
    """``python -m lowcomm train`` (co2, the tiny config) in a subprocess: its stderr holds the
    workers' too, C++ messages included (``lost``: a :data:`LOST_STATE_ENV` folder)."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, LOST_STATE_ENV)}
    if fault is not None:
        env[FAULT_ENV] = fault
    if lost is not None:
        env[LOST_STATE_ENV] = lost
    cmd = [sys.executable, "-m", "lowcomm", "train", "--algo", "co2", *TINY_JOB_ARGS]
    cmd += TINY_JOB_ALGO_ARGS["co2"]
    return subprocess.Popen(
        [*cmd, "--out", out, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """What ``proc`` (:func:`_start`) printed and its exit code; killed after 150 s."""
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _train_at_once(
    *runs: tuple[str, tuple[str, ...], str | None],
    lost: str | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Independent :func:`_start` runs ``(out, extra, fault)`` at once (their start-up, mostly
    imports on one core each, overlaps), each waited for (and read) in a thread of its own."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for out, extra, fault in runs:
            procs.append(_start(out, *extra, fault=fault, lost=lost if fault else None))
        with ThreadPoolExecutor(len(procs)) as pool:
            return list(pool.map(_wait, procs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)


def _train(out: str, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """:func:`_start`, waited for."""
    return _wait(_start(out, *extra, fault=fault))


@pytest.mark.timeout(300)
def test_restart_after_a_killed_worker_ends_as_a_run_without_the_fault(tmp_path: Any) -> None:
    clean, restarted = str(tmp_path / "clean"), str(tmp_path / "restarted")
    # the run without the fault and the faulted one, at once (independent runs), over an
    # emulated link (it delays, it does not change a bit)
    # rank 1 is SIGKILLed after step 10; the group restarts and resumes from the newest
    # complete checkpoint: step 9's, or step 6's where rank 0 had not yet finished step 9's
    # (nothing holds rank 1 back between the two: on a loaded machine it can be a step ahead)
    # rank 1's machine is lost with it: its replacement reads its checkpoint across the link
    lost = tmp_path / "lost"
    lost.mkdir()
    mark_lost(str(lost), 1, 0)
    link = ("--link", "20mbit:50ms", "--tune-link", "off", "--checkpoint-every", "3")
    first, proc = _train_at_once(
        (clean, link, None),
        (restarted, (*link, "--max-restarts", "1"), "1:10"),
        lost=str(lost),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert ABORT not in first.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker group restarted (restart 1) after a failure" in proc.stderr
    assert ABORT not in proc.stderr
    resumes = [r for r in read_records(restarted) if r["kind"] == "resume"]
    assert [(r["step"], r["restart"]) for r in resumes] in ([(9, 1)], [(6, 1)]), resumes
    assert_same_run(clean, restarted, resumed_at=[resumes[0]["step"]])
    # the lost rank waited for the link's latency and its file's bytes at 20 Mbit/s; rank 0 read
    # its own disk
    (note,) = (json.loads(p.read_text()) for p in lost.glob("attempt1.rank*.json"))
    folder = dict(complete_checkpoints(restarted))[resumes[0]["step"]]
    assert note["rank"] == 1 and note["bytes"] == os.path.getsize(rank_file(folder, 1))
    assert note["link_s"] == pytest.approx(0.05 + 8 * note["bytes"] / 20e6)
    assert note["waited_s"] >= note["link_s"]
    # tokens/s counts the whole job: the steps redone after the restart and the restart itself
    summary = read_summary(restarted)
    lost = summary["lost_to_restarts_s"]
    assert lost > 0
    assert summary["train_time_s"] > lost
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["train_time_s"])
    assert f"{lost:.1f} s lost to restarts" in proc.stdout


@pytest.mark.timeout(200)
def test_a_killed_worker_is_named_and_the_others_stop(tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    proc = _train(out, fault="1:5")  # _wait's timeout bounds how long the others take
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "lowcomm train: error: worker rank 1 failed: killed by signal 9 (SIGKILL)"
    assert ABORT not in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(200)
def test_the_failing_worker_is_named_not_its_peers(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    out = str(tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "1:5:raise")
    assert main(["train", "--algo", "diloco", *TINY_JOB_ARGS, "--out", out]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    expected = f"worker rank 1 failed: RuntimeError: fault injected by {FAULT_ENV} at step 5"
    assert line.startswith(f"lowcomm train: error: {expected} (traceback: "), line
    with open(os.path.join(out, "error-rank1.txt")) as f:
        assert "Traceback" in f.read()


@pytest.mark.timeout(200)
def test_a_stalled_worker_makes_the_others_time_out(
    tmp_path: Any, monkeypatch: Any, capsys: Any
) -> None:
    out = str(tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "1:5:hang")
    argv = ["train", "--algo", "localsgd", *TINY_JOB_ARGS, "--collective-timeout", "2"]
    argv += ["--out", out]
    assert main(argv) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("lowcomm train: error: worker rank 0 failed: CollectiveError:"), line
    assert "Timed out" in line and "Likely cause" in line


@pytest.mark.timeout(300)
def test_a_diverging_worker_is_skipped_or_stops_the_run(tmp_path: Any) -> None:
    # rank 1's parameters turn NaN after step 5 (mid-round): CO2's round-2 average is skipped;
    # with --nan-policy raise every rank stops there instead (the two runs at once)
    skipped, raised = str(tmp_path / "skip"), str(tmp_path / "raise")
    proc, stopped = _train_at_once(
        (skipped, (), "1:5:nan"), (raised, ("--nan-policy", "raise"), "1:5:nan")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(skipped)
    assert summary["skipped_updates"] == 1
    assert summary["val_loss_final"] < summary["val_loss_initial"]  # finite, and it learned
    assert "update skipped alike on every rank (1 skipped so far)" in proc.stderr
    # told once (by the group's rank 0), not by every rank; and recovered from, not diverged
    assert proc.stderr.count("update skipped alike on every rank") == 1
    assert summary["status"] == "finished"
    assert summary["nonfinite"]["diverged"] is False
    assert (summary["nonfinite"]["first_step"], summary["nonfinite"]["first_rank"]) == (6, 1)
    assert "non-finite loss   at step 6 (rank 1), recovered" in proc.stdout
    # --nan-policy raise: every rank stops at that average, cleanly, with one line
    proc = stopped
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "failed: NonFiniteError: CO2: the averaged pseudo-gradient of round 2 holds NaN" in last
    assert ABORT not in proc.stderr
    assert "Traceback" not in proc.stderr


def _failure(exitcode: int, timestamp: int = 0, message: str = "") -> Any:
    return types.SimpleNamespace(
        exitcode=exitcode,
        timestamp=timestamp,
        message=message,
        error_file_data={"message": {"message": message} if message else ""},
        signal_name=lambda: signal.Signals(-exitcode).name,
    )


def test_a_worker_that_aborted_on_a_lost_peer_is_not_named_over_the_one_that_died(
    tmp_path: Any,
) -> None:
    # rank 0 aborted (gloo's IoException) before it could record anything, its error file
    # saying only that it lost its peer; rank 1 was SIGKILLed: rank 1 is the cause
    lost = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:17815: Connection reset by peer"
    failures = {0: _failure(-signal.SIGABRT, 1, lost), 1: _failure(-signal.SIGKILL, 1)}
    rank, _, error, _ = launcher._final_failure(failures, str(tmp_path), attempt=0)
    assert (rank, error) == (1, "killed by signal 9 (SIGKILL)")
    # an error of its own still comes first
    failures[2] = _failure(1, 2, "ValueError: bad batch")
    assert launcher._final_failure(failures, str(tmp_path), attempt=0)[0] == 2


def test_root_cause_prefers_a_real_error_then_a_silent_death(tmp_path: Any) -> None:
    folder = str(tmp_path)

    def record(rank: int, time: float, error: str, peer_lost: bool) -> None:
        path = os.path.join(folder, f"failure-rank{rank}-attempt0.json")
        with open(path, "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "time": time,
                    "attempt": 0,
                    "error": error,
                    "peer_lost": peer_lost,
                    "traceback": "Traceback ...",
                },
                f,
            )

    lost = "RuntimeError: Connection closed by peer"
    record(0, 1.0, lost, True)
    failures = {0: _failure(1), 1: _failure(-signal.SIGKILL)}
    # every record is a lost peer: the worker that died without one is the cause
    rank, record_, error, _ = launcher._final_failure(failures, folder, attempt=0)
    assert (rank, record_, error) == (1, None, "killed by signal 9 (SIGKILL)")
    # a worker's own error wins, even a later one
    record(2, 2.0, "ValueError: bad batch", False)
    rank, record_, error, text = launcher._final_failure(failures, folder, attempt=0)
    assert (rank, error, text) == (2, "ValueError: bad batch", "Traceback ...")
    assert record_ is not None and record_["rank"] == 2
    # records of an earlier attempt of the group do not count
    rank, _, error, _ = launcher._final_failure(failures, folder, attempt=1)
    assert (rank, error) == (0, "exited with code 1")


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    with launcher._loopback_rendezvous_store() as port:
        assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, and nothing else
    assert _listening_addresses(port) == []
