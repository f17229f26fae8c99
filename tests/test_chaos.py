"""``lowcomm bench --chaos``: its fault schedules on real processes and signals, the checks it
makes of what the replicas wrote, the rule that stops a replica still behind when the job
finished, and the CLI's errors. (The benchmark itself runs in ``lowcomm bench --chaos``: its
jobs take minutes.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lowcomm.bench.chaos import ChaosSpec, MtbfLoop, Targeted, check_run, format_chaos
from lowcomm.bench.chaos_links import _WorkerKiller
from lowcomm.bench.soak import Soak, _SoakOver
from lowcomm.cli import main
from lowcomm.train.elastic import RunningReplica, _behind, _stop
from lowcomm.train.faults import fault_point


def _state(pid: int, *, stopped: bool) -> bool:
    """Whether process ``pid`` is stopped (``stopped``) or not, waiting up to 10 s for the
    signal to take effect."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            now = f.read().rsplit(")", 1)[1].split()[0] == "T"
        if now == stopped or time.monotonic() > deadline:
            return now == stopped
        time.sleep(0.05)


def _replicas(tmp_path: Path, n: int, syncs: int) -> list[RunningReplica]:
    """``n`` real processes standing in for replicas, each with ``syncs`` sync records."""
    out = []
    for i in range(n):
        folder = tmp_path / f"replica_{i}"
        folder.mkdir()
        lines = [json.dumps({"kind": "sync", "sync": s, "anchor": "a"}) for s in range(syncs)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        process = subprocess.Popen(["sleep", "60"])
        out.append(RunningReplica(f"replica_{i}", 0, str(folder), [process], time.time()))
    return out


def _end(replicas: list[RunningReplica]) -> None:
    for r in replicas:
        if r.process.poll() is None:
            r.process.kill()
        r.process.wait(timeout=10)


def test_the_mtbf_loop_kills_one_replica_every_period_once_all_have_synced(
    tmp_path: Path,
) -> None:
    replicas = _replicas(tmp_path, 3, syncs=2)
    try:
        loop = MtbfLoop(3, period_s=10.0, seed=0)
        loop(0.0, replicas[:2], False)  # not every replica is up yet: nothing
        assert loop.ready_at is None
        loop(1.0, replicas, False)
        assert loop.ready_at == 1.0 and not loop.actions
        loop(10.9, replicas, False)  # not a period since every replica synced
        assert not loop.actions
        loop(11.0, replicas, False)
        loop(11.6, [r for r in replicas if r.process.poll() is None], False)
        assert [a["signal"] for a in loop.actions] == ["SIGKILL"]  # one per period
        victim = next(r for r in replicas if r.replica_id == loop.actions[0]["replica"])
        assert victim.process.wait(timeout=10) == -signal.SIGKILL
        assert sum(r.process.poll() is None for r in replicas) == 2
    finally:
        _end(replicas)


def _running(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("R", "S")


def _write(folder: Path, *records: dict[str, object]) -> None:
    with open(folder / "metrics.jsonl", "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_a_killed_replicas_core_is_held_by_a_spinner_until_its_restart_is_healed(
    tmp_path: Path,
) -> None:
    # the fairness correction of --links: the others must not run faster while it is away
    replicas = _replicas(tmp_path, 3, syncs=2)
    loop = MtbfLoop(3, period_s=10.0, seed=0, spin=True)
    assert loop.spinners is not None
    back = None
    try:
        loop(0.0, replicas, False)
        loop(10.0, replicas, False)
        (kill,) = loop.actions
        victim = next(r for r in replicas if r.replica_id == kill["replica"])
        victim.process.wait(timeout=10)
        spinner = loop.spinners.away[victim.replica_id]
        assert spinner.poll() is None and _running(spinner.pid)
        # its restart, not healed yet: the spinner stays; healed: it goes
        folder = tmp_path / f"{victim.replica_id}.1"
        folder.mkdir()
        _write(folder, {"kind": "step", "step": 1})
        back = RunningReplica(
            victim.replica_id, 1, str(folder), [subprocess.Popen(["sleep", "60"])], time.time()
        )
        alive = [r for r in replicas if r is not victim] + [back]
        loop(10.5, alive, False)
        assert victim.replica_id in loop.spinners.away
        _write(folder, {"kind": "healed", "step": 8})
        loop(11.0, alive, False)
        assert not loop.spinners.away and spinner.wait(timeout=10) == -signal.SIGKILL
        assert loop.spinners.spun_s > 0
    finally:
        loop.release()
        _end(replicas + ([back] if back else []))


def test_the_soak_kills_and_starts_at_random_but_keeps_two_up_to_date_then_ends_healed(
    tmp_path: Path,
) -> None:
    replicas = _replicas(tmp_path, 4, syncs=2)
    soak = Soak(4, seed=3, end_s=100.0, event_s=1.0)
    alive = list(replicas)
    try:
        soak(0.0, alive, False)  # every replica has synced: events start
        now = 0.0
        for _ in range(40):
            now += 1.0
            soak(now, alive, False)
            for r in list(alive):
                if any(a["replica"] == r.replica_id for a in soak.actions):
                    r.process.wait(timeout=10)
                    alive.remove(r)
            assert len(alive) >= 2  # never fewer than two up to date
        kills = [a for a in soak.actions if a["signal"] == "SIGKILL"]
        starts = [a for a in soak.actions if a["signal"] == "start"]
        assert kills and starts  # both kinds of event, drawn 0.4 / 0.6
        assert len(kills) == 2  # the third would leave fewer than two up to date
        away = {r.replica_id for r in replicas if r not in alive}
        assert soak.away <= away and all(soak.held(i) for i in soak.away)
        # the end: everything away starts; the job stops once all 4 are back, healed, and
        # each has committed one more sync
        back = []
        for rid in sorted(away):
            folder = tmp_path / f"{rid}.1"
            folder.mkdir()
            process = subprocess.Popen(["sleep", "60"])
            back.append(RunningReplica(rid, 1, str(folder), [process], time.time()))
        soak(100.0, alive, False)
        assert not soak.away and not any(soak.held(r.replica_id) for r in replicas)
        everyone = alive + back
        soak(101.0, everyone, False)  # the returning ones are not healed yet
        for r in back:
            _write(Path(r.folder), {"kind": "healed", "step": 40})
        soak(102.0, everyone, False)  # all healed: each must commit one more sync
        for r in everyone[:-1]:
            _write(Path(r.folder), {"kind": "sync", "sync": 9, "anchor": "a"})
        soak(103.0, everyone, False)
        _write(Path(everyone[-1].folder), {"kind": "sync", "sync": 9, "anchor": "a"})
        with pytest.raises(_SoakOver):
            soak(104.0, everyone, False)
        assert soak.final == sorted(r.replica_id for r in everyone) and not soak.unhealed
    finally:
        _end(replicas)
        _end(back)


def test_the_checkpoint_restart_loop_kills_one_worker_of_the_latest_attempt_per_period(
    tmp_path: Path,
) -> None:
    pids, out = tmp_path / "pids", tmp_path / "run"
    pids.mkdir()
    out.mkdir()
    old = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    new = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    for attempt, procs in ((0, old), (1, new)):
        for rank, p in enumerate(procs):
            (pids / f"rank{rank}.attempt{attempt}").write_text(str(p.pid))
    lost = tmp_path / "lost"
    lost.mkdir()
    try:
        killer = _WorkerKiller(str(out), str(pids), 1.0, 0, 8, time.time() + 60, lost=str(lost))
        time.sleep(2.0)
        assert not killer.kills  # the job has not trained 8 steps yet
        _write(out, {"kind": "step", "step": 8})
        deadline = time.monotonic() + 20
        while not killer.kills and time.monotonic() < deadline:
            time.sleep(0.1)
        killer.stop()
        (kill,) = killer.kills[:1]
        assert new[kill["rank"]].wait(timeout=10) == -signal.SIGKILL
        assert all(p.poll() is None for p in old)  # never a worker of an earlier attempt
        # the machine is lost with the worker: attempt 2's worker of that rank fetches its state
        assert kill["attempt"] == 1
        assert (lost / "attempt2").read_text().split()[0] == str(kill["rank"])
    finally:
        for p in old + new:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def _victims(tmp_path: Path, seed: int) -> list[str]:
    """The replicas an MTBF loop of ``seed`` kills, period after period, among 5 real
    processes (three kills)."""
    tmp_path.mkdir()
    replicas = _replicas(tmp_path, 5, syncs=2)
    try:
        loop = MtbfLoop(5, period_s=10.0, seed=seed)
        for now in (0.0, 10.0, 20.0, 30.0):
            loop(now, [r for r in replicas if r.process.poll() is None], False)
            for r in replicas:  # the victim is gone before the next period
                if any(a["replica"] == r.replica_id for a in loop.actions):
                    r.process.wait(timeout=10)
        return [a["replica"] for a in loop.actions]
    finally:
        _end(replicas)


def test_the_mtbf_loop_kills_the_same_replicas_for_the_same_seed(tmp_path: Path) -> None:
    runs = {
        (seed, i): _victims(tmp_path / f"s{seed}-{i}", seed) for seed in range(4) for i in (0, 1)
    }
    assert all(len(v) == 3 and len(set(v)) == 3 for v in runs.values())
    assert all(runs[(seed, 0)] == runs[(seed, 1)] for seed in range(4)), runs
    # and the seed decides: 60 orders are possible, four seeds do not all draw one
    assert len({tuple(runs[(seed, 0)]) for seed in range(4)}) > 1, runs


def test_a_stall_stops_a_replica_and_continues_it_even_when_the_job_ends_first(
    tmp_path: Path,
) -> None:
    replicas = _replicas(tmp_path, 3, syncs=2)
    target = replicas[2]
    try:
        stall = Targeted(3, ["replica_2"], stall_s=5.0, after_s=1.0)
        stall(0.0, replicas, False)
        stall(1.0, replicas, False)
        assert _state(target.process.pid, stopped=True) and stall.stopped == [target.process.pid]
        stall(3.0, replicas, False)  # not yet
        assert _state(target.process.pid, stopped=True)
        stall(6.0, replicas, False)
        assert _state(target.process.pid, stopped=False) and not stall.stopped
        # stopped again, then the job ends before the stall does: it is continued at once
        stall = Targeted(3, ["replica_2"], stall_s=60.0, after_s=0.0)
        stall(0.0, replicas, False)
        stall(1.0, replicas, False)
        assert _state(target.process.pid, stopped=True)
        stall(2.0, replicas, True)
        assert _state(target.process.pid, stopped=False)
        assert [a["signal"] for a in stall.actions] == ["SIGSTOP", "SIGCONT"]
    finally:
        _end(replicas)


def test_a_replica_behind_the_finished_job_is_named_to_stop(tmp_path: Path) -> None:
    replicas = _replicas(tmp_path, 3, syncs=0)
    try:
        first, late, stale = replicas
        (Path(first.folder) / "summary.json").write_text(
            json.dumps({"elastic": {"syncs_committed": 8}})
        )
        syncs = [json.dumps({"kind": "sync", "sync": s}) for s in range(1, 8)]
        (Path(late.folder) / "metrics.jsonl").write_text("\n".join(syncs) + "\n")  # at 7
        (Path(stale.folder) / "metrics.jsonl").write_text(syncs[0] + "\n" + '{"kind": "sy')
        # one sync behind is finishing its last round; further behind trains alone: stopped
        assert _behind([late, stale], first) == [stale]
    finally:
        _end(replicas)


def test_stopping_a_replica_whose_processes_end_meanwhile_raises_nothing(tmp_path: Path) -> None:
    # the launcher checks that a process runs, then signals its group: a process that ends in
    # between (on the SIGTERM just sent) leaves no group to signal, and that is stopped, not an
    # error (it failed a job that had finished: ProcessLookupError from os.killpg)
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    process.kill()
    process.wait(timeout=10)  # its group is gone

    class EndedAfterTheCheck:
        pid = process.pid

        def poll(self) -> int | None:
            return None  # as it was when checked

        def wait(self, timeout: float | None = None) -> int:
            return process.wait(timeout)

    replica = RunningReplica("replica_0", 0, str(tmp_path), [EndedAfterTheCheck()], time.time())
    _stop([replica])
    assert process.returncode == -signal.SIGKILL


def test_the_checks_find_an_anchor_that_differs_between_replicas(tmp_path: Path) -> None:
    for name, anchors in (("replica_0", "ab"), ("replica_1", "ab"), ("replica_1.1", "xb")):
        folder = tmp_path / "replicas" / name
        folder.mkdir(parents=True)
        lines = [
            json.dumps({"kind": "sync", "sync": s + 1, "anchor": a, "time": 10.0 + 2 * s})
            for s, a in enumerate(anchors)
        ]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "replicas" / "replica_1.1" / "summary.json").write_text(
        json.dumps({"elastic": {"attempt": 1, "heals": [], "ready_at": 3.0}})
    )
    checks = check_run(str(tmp_path), None)
    assert checks["syncs_checked"] == 2 and not checks["anchors_identical"]
    assert checks["round_s"] == pytest.approx(2.0)
    # a restarted replica that finished without a heal would have trained from its own start
    assert (checks["returned"], checks["returned_healed"]) == (1, 0)


def test_the_table_says_which_runs_survived() -> None:
    base = {
        "algo": "diloco",
        "steps": 96,
        "status": "finished",
        "tokens_per_s": 10_000.0,
        "val_loss_final": 2.5,
        "faults": 1,
        "healed": 1,
        "heals": 1,
        "fault_to_healed_s": [4.0],
        "startup_to_healed_s": [3.0],
        "participants": [3, 2, 3],
        "syncs_checked": 8,
        "anchors_identical": True,
        "replicas_identical": True,
        "returned": 1,
        "returned_healed": 1,
        "round_s": 1.5,
    }
    runs = [
        {**base, "kind": "mtbf", "tokens_per_s_vs_fault_free": 0.9, "round_s_fault_free": 2.0},
        {**base, "kind": "sync", "anchors_identical": False},
    ]
    table = format_chaos({"runs": runs}).splitlines()
    assert "| diloco | mtbf | 96 | yes | 10,000 | 90% |" in table[2]
    assert "| 1 / 1 / 1 | 4.0-4.0 | 1.5 | 8 | 2-3 |" in table[2]  # 3 s / 2 s rounds
    assert "| diloco | sync | 96 | **no** |" in table[3]


def test_the_lighthouse_waits_for_a_heal_over_the_link_before_leaving_a_late_replica_out() -> None:
    # with heals that block, a donor's link carries the heal before its next collectives: the
    # quorum's join timeout covers twice the heal's time on the emulated link (the default
    # model: 0.83 M parameters, five fp32 words each), so a donor is not left out and healed
    # again in turn (heals block by default); a heal in the background delays no one
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.elastic import JOIN_TIMEOUT_S, join_timeout

    def timeout(**values: object) -> float:
        return join_timeout(config_from_dict({"fault_tolerance": True, **values}, source="t"))

    assert timeout() == JOIN_TIMEOUT_S == timeout(link="10mbit", heal="background")
    # (LocalSGD heals blocking whatever its heal says: its anchor is the average itself)
    blocking = timeout(link="10mbit", algo="localsgd")
    assert timeout(link="10mbit", algo="localsgd", heal="background") == blocking > JOIN_TIMEOUT_S
    heal_bytes = 4 * 5 * (12 * 4 * 128**2 + (256 + 64) * 128)  # context 64
    assert timeout(link="10mbit") == pytest.approx(2.0 + 2 * (0.030 + 8 * heal_bytes / 10e6))
    assert timeout(link="100mbit") < timeout(link="10mbit") < 60.0
    assert timeout(link="1mbit") == 60.0


def test_the_link_table_sets_every_run_against_one_ceiling_and_its_fault_free_run() -> None:
    from lowcomm.bench.chaos import versus
    from lowcomm.bench.chaos_links import format_link_chaos

    elastic = {
        "algo": "co2",
        "link": "10mbit",
        "status": "finished",
        "val_loss_final": 1.5,
        "anchors_identical": True,
        "replicas_identical": True,
        "returned": 2,
        "returned_healed": 2,
        "settings": {"compression": "int4"},
    }
    ref = {**elastic, "kind": "10mbit-fault-free", "goodput": 8000.0, "faults": 0}
    mtbf = {
        **elastic,
        "kind": "10mbit-mtbf",
        "goodput": 7200.0,
        "val_loss_final": 1.53,
        "faults": 2,
        "fault_to_healed_s": [5.0, 9.0],
        "heal_bytes": [4.0e6, 4.0e6],
        "heal_transfer_s": [3.5, 3.6],
    }
    ckpt = {
        "algo": "co2",
        "link": "10mbit",
        "kind": "10mbit-checkpoint-restart",
        "status": "finished",
        "goodput": 4000.0,
        "val_loss_final": 1.5,
        "faults": 3,
        "settings": {"compression": "int4"},
        "lost_state": "link",
        "heal_bytes": [9.0e6, 9.0e6, 9.0e6],
        "heal_transfer_s": [7.3, 7.4, 7.3],
    }
    runs = [{"kind": "ceiling", "goodput": 10_000.0}, ref, versus(mtbf, ref), versus(ckpt, ref)]
    table = format_link_chaos({"runs": runs}).splitlines()
    assert table[0] == "No-sync ceiling (`--algo none`): 10,000 tokens/s."
    rows = table[4:]
    assert rows[0].startswith("| 10mbit | co2 | fault-free | yes | 8,000 | 0.80 | - | 1.500 |")
    assert (
        "| mtbf | yes | 7,200 | 0.72 | 90% | 1.530 | +2.0% | 2 | 5.0-9.0 | 4.0 | 3.5-3.6 |"
        in (rows[1])
    )
    assert "| checkpoint-restart | yes | 4,000 | 0.40 | 50% |" in rows[2]
    # the killed workers' checkpoints, read across the link
    assert rows[2].endswith("| 3 | - | 9.0 | 7.3-7.4 | compression int4 |")
    assert table[-1] == (
        "10mbit, co2: under the kills the elastic job has 1.80 times the goodput of "
        "checkpoint-restart (each killed worker's machine lost, its checkpoint read across the "
        "link)."
    )


def test_the_default_job_is_an_entry_of_algos_whose_algorithm_the_link_chooses(
    tmp_path: Path,
) -> None:
    from lowcomm.bench.chaos import JOB, train_config
    from lowcomm.bench.chaos_links import _kills_from

    spec = ChaosSpec(algos=[JOB, "sparseloco"], links=["10mbit"], out=str(tmp_path))
    job = train_config(spec, JOB, 960, str(tmp_path / "job"), link="10mbit")
    given = train_config(spec, "sparseloco", 960, str(tmp_path / "given"), link="10mbit")
    # the default job: no algorithm given, so the link may switch it (as `lowcomm train
    # --fault-tolerance --link 10mbit` does); one given stays
    assert job.algo_from_link and job.fault_tolerance and job.algo == "co2"
    assert not given.algo_from_link and given.algo == "sparseloco"
    fixed = train_config(spec, JOB, 960, str(tmp_path / "fixed"), fault_tolerance=False)
    assert fixed.algo_from_link and not fixed.fault_tolerance
    # the kills of its checkpoint-restart run start where the elastic run's did: after the
    # warm start and two syncs of the settings the elastic job ran with (its first replica's)
    folder = tmp_path / "runs" / "job-10mbit-fault-free"
    assert _kills_from(str(folder)) is None  # (no run there)
    summary = folder / "replicas" / "replica_0" / "summary.json"
    summary.parent.mkdir(parents=True)
    for record, ready in [
        ({"sync_every": 12, "early_rounds": {"steps": 360, "sync_every": 6}}, 12),
        ({"sync_every": 12, "sync_warmup": {"steps": 240, "compression": "int8"}}, 264),
        ({"sync_every": 12, "sync_warmup": None, "early_rounds": None}, 24),
    ]:
        summary.write_text(json.dumps(record))
        assert _kills_from(str(folder)) == ready
    with pytest.raises(ValueError, match="or job"):
        ChaosSpec(algos=["jobs"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chaos", "--algos", "ddp"], "'ddp' does not run elastic"),
        (["--chaos", "--workers", "2"], "--workers must be at least 3"),
        (["--chaos", "--faults", "flood"], "unknown 'flood'"),
        (["--chaos", "--mtbf", "0"], "--mtbf must be > 0"),
        (["--chaos", "--links", "fast"], "fast"),
        (["--chaos", "--soak", "0"], "--soak must be more than 0"),
        (["--soak", "5"], "--soak is a flag of --chaos"),
        (["--chaos", "--quick"], "--chaos is a run of its own"),
        (["--mtbf", "30"], "--mtbf is a flag of --chaos"),
        (["--chaos", "--links", "10mbit", "--lost-state", "cloud"], "link or local, got 'cloud'"),
        (["--chaos", "--lost-state", "local"], "--lost-state is a setting of the checkpoint-"),
    ],
)
def test_bad_chaos_settings_are_refused(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv, "--out", str(tmp_path / "c")]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")


def test_elastic_faults_are_named_by_replica_and_donor_faults_by_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOWCOMM_FAULT_INJECT", "*:0:donor")
    assert fault_point(0, attempt=0) == (0, "donor") == fault_point(3, attempt=0)
    assert fault_point(3, attempt=1) is None  # a restarted replica runs clean
    monkeypatch.setenv("LOWCOMM_FAULT_INJECT", "1:40:sync")
    assert fault_point(1, attempt=0) == (40, "sync") and fault_point(0, attempt=0) is None
    monkeypatch.setenv("LOWCOMM_FAULT_INJECT", "*:40:kill")
    with pytest.raises(ValueError, match="RANK \\* with donor only"):
        fault_point(0, attempt=0)
    assert ChaosSpec().workers == 4


def test_the_progress_line_of_an_elastic_job_reads_what_the_replicas_wrote(
    tmp_path: Path,
) -> None:
    from lowcomm.train.elastic import job_status

    replicas = _replicas(tmp_path, 2, syncs=0)
    try:
        a, b = replicas
        records = [
            {"kind": "step", "step": 10},
            {"kind": "sync", "sync": 2, "step": 12, "participants": 2, "committed": True},
            {"kind": "step", "step": 20},
        ]
        (Path(a.folder) / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in records) + "\n"
        )
        healed = [
            {"kind": "healed", "step": 24, "time": 1.0},
            {"kind": "sync", "sync": 3, "step": 24, "participants": 3, "committed": True},
        ]
        (Path(b.folder) / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in healed) + "\n" + '{"kind": "st'
        )
        b.process.kill()
        b.process.wait(timeout=10)
        events = [{"event": "fault", "replica": "replica_1"}, {"event": "restart"}]
        status = job_status(replicas, events)
        assert status == {
            "step": 24,
            "running": 1,
            "participants": 3,
            "sync": 3,
            "faults": 1,
            "heals": 1,
        }
    finally:
        _end(replicas)


def test_a_syncs_collective_is_bounded_by_the_last_ones() -> None:
    from datetime import timedelta

    from lowcomm.elastic.sync import MIN_TIMEOUT_S, TIMEOUT_FACTOR, FaultTolerance

    def nothing(*_: object, **__: object) -> None:
        return None

    class Manager:  # the scheduling under test needs none of a Manager's work
        start_quorum = should_commit = allreduce = register_state_dict_fn = staticmethod(nothing)
        errored = staticmethod(nothing)
        size = 4

        def num_participants(self) -> int:
            return self.size

    class Group:
        bound: timedelta | None = None
        rendezvous = 1  # (one for every quorum whose members changed)

        def set_collective_timeout(self, timeout: timedelta) -> None:
            self.bound = timeout

    class Replica:
        manager = Manager()
        pg = Group()

    ft = FaultTolerance(Replica())
    ft.before_collective()  # no sync completed yet: the full collective timeout stays
    assert ft.collective_timeout() is None and Replica.pg.bound is None
    ft.collective_s = [0.05, 0.2]
    assert ft.collective_timeout() == MIN_TIMEOUT_S
    ft.collective_s = [0.4, 3.0, 0.9]
    ft.before_collective()
    assert Replica.pg.bound == timedelta(seconds=TIMEOUT_FACTOR * 3.0) > timedelta(seconds=10)
    # a quorum that grew (a replica came back): its collectives wait for the joiner's heal, so
    # they are not bounded by the last syncs' time, and their own time (the heal's) does not
    # stretch the bound of the syncs after it
    ft.quorum()
    assert not ft.new_members and ft.collective_timeout() == TIMEOUT_FACTOR * 3.0
    Replica.manager.size = 3  # one left
    ft.quorum()
    assert not ft.new_members and ft.collective_timeout() == TIMEOUT_FACTOR * 3.0
    Replica.manager.size = 4  # it is back
    ft.quorum()
    assert ft.new_members and ft.collective_timeout() is None
    ft.record_collective(25.0)  # (its heal's time)
    assert ft.collective_s == [0.4, 3.0, 0.9]
    ft.quorum()  # the next sync, the same four: bounded again, by the syncs without a heal
    assert not ft.new_members and ft.collective_timeout() == TIMEOUT_FACTOR * 3.0
    ft.record_collective(1.0)
    assert ft.collective_s == [0.4, 3.0, 0.9, 1.0]
    # as many replicas, but other ones (one died after the last quorum, its restart is in this
    # one): the members changed, the group met again, and a joiner's heal may be in it
    Replica.pg.rendezvous += 1
    ft.quorum()
    assert ft.new_members and ft.collective_timeout() is None
    ft.quorum()
    assert not ft.new_members
    Replica.manager.size = 3  # fewer, and others: a replica left (no joiner)
    Replica.pg.rendezvous += 1
    ft.quorum()
    assert not ft.new_members
