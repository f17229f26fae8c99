"""The supervisors of docs/fault-tolerance.md ("Restarting a replica"), run as a user would run
them: ``examples/supervise/replica.sh`` (a shell loop) keeps replica_0 of an elastic job
running and ``examples/supervise/lowcomm-replica@.service`` (a systemd unit) replica_1. Each
replica is SIGKILLed once mid-run; its supervisor starts it again with its own command line, it
continues in its folder (its earlier start's files kept under ``attempts/0/``), is healed from
the other replica and both end with the same model.

systemd itself does not run in a test: the unit's ``ExecStart`` runs under :class:`_Unit`, which
follows the unit's restart rules (``Restart=on-failure``, ``RestartPreventExitStatus``,
``SuccessExitStatus``) as systemd documents them; only that scheduling is emulated.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUPERVISE = ROOT / "examples" / "supervise"
DOCS = ROOT / "docs" / "fault-tolerance.md"

# 64 steps: a replica is killed at step 8 and the other once the first is healed (step 12 or
# 16); the two then train in step with each other (every sync needs both), so the 48 or so steps
# left are seconds in which the second kill lands long before the job could end
JOB = """\
algo = "diloco"
steps = 64
sync_every = 4
eval_every = 64
eval_batches = 1
batch_size = 2
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
warmup = 2
quiet = true
"""


def test_the_docs_show_the_supervisors_as_they_are_in_examples() -> None:
    text = DOCS.read_text()
    for name in ("replica.sh", "lowcomm-replica@.service"):
        body = (SUPERVISE / name).read_text()
        assert body.strip() in text, f"docs/fault-tolerance.md does not show {name} as it is"


class _Unit:
    """A service unit's ``ExecStart`` started and restarted by the unit's own rules, in a thread:
    restarted when it exits with a code that is neither success (0 or ``SuccessExitStatus``) nor
    in ``RestartPreventExitStatus``, or when it is killed by a signal (``Restart=on-failure``),
    after ``RestartSec`` (scaled by ``delay_scale``)."""

    def __init__(self, path: Path, instance: str, replace: dict[str, str], cwd: Path) -> None:
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(path.read_text())
        service = parser["Service"]
        assert service["Restart"] == "on-failure"
        command = service["ExecStart"].replace("%i", instance)
        for old, new in replace.items():
            command = command.replace(old, new)
        self.argv = shlex.split(command)
        self.success = {0, *map(int, service.get("SuccessExitStatus", "").split())}
        self.prevent = set(map(int, service.get("RestartPreventExitStatus", "").split()))
        self.delay_s = float(service.get("RestartSec", "0.1"))
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.result: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, delay_scale: float) -> None:
        self.delay_s *= delay_scale
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.starts += 1
            self.proc = subprocess.Popen(
                self.argv, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            code = self.proc.wait()
            if code >= 0 and (code in self.success or code in self.prevent):
                self.result = code
                return
            time.sleep(self.delay_s)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(x).get("step", -1) for x in lines if x.strip().endswith("}")]
    return max(steps, default=-1)


def _healed(out: Path) -> bool:
    try:
        return '"kind": "healed"' in (out / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return False


def _wait(what: str, condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchft: Linux")
@pytest.mark.timeout(300)
def test_supervisors_restart_a_killed_replica_which_is_healed(tmp_path: Path) -> None:
    from lowcomm.elastic import Lighthouse

    (tmp_path / "job.toml").write_text(JOB)
    bin_dir = os.path.dirname(sys.executable)  # where this environment's `lowcomm` is
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["RUST_LOG"] = "warn"
    # a sync needs both replicas (as across machines, docs): the survivor waits at its next
    # sync for the one restarted, which is healed from it
    with Lighthouse(min_replicas=2, heartbeat_timeout_s=1.0, join_timeout_s=2.0) as lighthouse:
        loop_env = {**env, "LIGHTHOUSE": lighthouse.address, "REPLICA": "replica_0"}
        loop_env.update(OUT=str(tmp_path / "runs" / "replica_0"), RESTART_DELAY="0.2")
        loop = subprocess.Popen(
            ["bash", str(SUPERVISE / "replica.sh"), "--config", "job.toml"],
            cwd=tmp_path,
            env=loop_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        unit = _Unit(
            SUPERVISE / "lowcomm-replica@.service",
            "1",
            {
                "/srv/lowcomm/.venv/bin/lowcomm": os.path.join(bin_dir, "lowcomm"),
                "http://10.0.0.1:29510": lighthouse.address,
            },
            tmp_path,
        )
        unit.start(delay_scale=0.04)
        r0, r1 = tmp_path / "runs" / "replica_0", tmp_path / "runs" / "replica_1"
        try:
            # replica_0 is killed mid-run; its loop starts it again
            _wait("replica_0 trains", lambda: _last_step(r0) >= 8, 120)
            (child,) = _children(loop.pid)
            os.kill(child, signal.SIGKILL)
            _wait("replica_0 is back", lambda: (r0 / "attempts" / "0").is_dir(), 60)
            _wait("replica_0 is healed", lambda: _healed(r0), 60)
            # then replica_1; its unit starts it again
            first = unit.proc
            assert first is not None
            first.kill()
            _wait("replica_1 is restarted", lambda: unit.starts == 2, 60)
            code = loop.wait(timeout=180)
            unit.join(timeout=180)
            stderr = loop.stderr.read().decode() if loop.stderr else ""
        finally:
            unit.stop()
            if loop.poll() is None:
                loop.send_signal(signal.SIGTERM)
                loop.wait(timeout=30)
    assert code == 0, stderr
    assert "replica replica_0 exited with 137; starting it again" in stderr, stderr
    assert unit.result == 0 and unit.starts == 2
    summaries = [json.loads((r / "summary.json").read_text()) for r in (r0, r1)]
    assert [s["status"] for s in summaries] == ["finished", "finished"]
    # each continued in its folder as its second start, the first start's files kept
    for run, summary in zip((r0, r1), summaries):
        assert (run / "attempts" / "0" / "metrics.jsonl").is_file()
        assert (run / "attempts" / "0" / "config.json").is_file()
        assert summary["elastic"]["attempt"] == 1
    # the second start of each was healed from the other, and both ended with one model
    assert all(s["elastic"]["heal_times"] for s in summaries), [s["elastic"] for s in summaries]
    # replica_0's second start waited at a sync for replica_1 to come back (its restart: a
    # fresh interpreter, then its heal): counted as the quorum's wait, apart from the time
    # blocked in collectives
    waits = [(s["comm_mean"]["quorum_wait_s"], s["comm_mean"]["blocked_s"]) for s in summaries]
    assert waits[0][0] > 1.0 and waits[0][0] > waits[0][1], waits
    checksums = {s["comm_per_worker"][0]["params_checksum"] for s in summaries}
    assert len(checksums) == 1
