"""The soak (``lowcomm bench --chaos --soak MINUTES``): an elastic job while replicas die and
are started at random for MINUTES, checked after every committed sync (:func:`run_soak`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

from lowcomm.bench.chaos import (
    ChaosSchedule,
    ChaosSpec,
    check_run,
    healed,
    replica_folders,
    syncs_done,
    train_config,
)
from lowcomm.train.elastic import RunningReplica, read_replica_records

__all__ = ["Soak", "format_soak", "run_soak"]

logger = logging.getLogger(__name__)

SOAK_EVENT_S = 10.0
"""Seconds between two events of the soak."""
SOAK_KILL_P = 0.4
"""Per event: the chance that a replica is killed (else one that is away is started)."""
SOAK_STALL_S = 60.0
"""The soak fails if the job goes longer than this without committing a sync."""
SOAK_WARMUP = 48
"""The soak's warm start (steps): its steps are bounded by time, not by a count whose
quarter would be its warm start."""
SOAK_SETTLE_S = 300.0
"""At the soak's end, how long every replica away is given to come back and be healed."""


class _SoakOver(Exception):
    """Raised from the soak's callback to stop its job."""


class Soak(ChaosSchedule):
    """The soak's events (:func:`run_soak`): every ``event_s`` seconds, with probability
    ``kill_p`` SIGKILL a running replica chosen at random (never one of the last two up to date:
    the job's state lives on), else start one that is away; at ``end_s`` no more events, every
    replica away is started, and once every running replica is healed and has committed a sync
    since, the job is stopped."""

    warm_syncs = 1

    def __init__(self, workers: int, seed: int, end_s: float, event_s: float = SOAK_EVENT_S):
        super().__init__(workers)
        self.rng = random.Random(seed)
        self.end_s, self.event_s = end_s, event_s
        self.away: set[str] = set()
        self.last = 0.0
        self.ending_since: float | None = None
        self.mark: dict[str, int] = {}
        self.final: list[str] = []
        self.unhealed: list[str] = []

    def held(self, replica_id: str) -> bool:
        """Whether ``replica_id``, which left, stays away (``hold`` of the launcher)."""
        return replica_id in self.away

    def __call__(self, now: float, running: list[RunningReplica], done: bool) -> None:
        if not done and now >= self.end_s:
            self.finish(now, running)
            return
        super().__call__(now, running, done)

    def act(self, now: float, running: list[RunningReplica]) -> None:
        if now - self.last < self.event_s:
            return
        self.last = now
        if self.rng.random() < SOAK_KILL_P:
            current = [r for r in running if r.attempt == 0 or healed(r.folder)]
            if len(current) > 2:
                victim = self.rng.choice(sorted(current, key=lambda r: r.replica_id))
                self.away.add(victim.replica_id)
                self.signal(now, victim, signal.SIGKILL)
        elif self.away:
            back = self.rng.choice(sorted(self.away))
            self.away.discard(back)
            self.actions.append({"time_s": now, "replica": back, "signal": "start"})

    def finish(self, now: float, running: list[RunningReplica]) -> None:
        if self.ending_since is None:
            self.ending_since = now
            for r in sorted(self.away):
                self.actions.append({"time_s": now, "replica": r, "signal": "start"})
            self.away.clear()
        ids = sorted(r.replica_id for r in running)
        back = [r for r in running if r.attempt == 0 or healed(r.folder)]
        if len(running) == self.workers and len(back) == self.workers:
            last = {r.replica_id: syncs_done(r.folder) for r in running}
            if not self.mark:
                self.mark = last  # every replica is back: each must commit one more sync
            elif all(last[i] > self.mark.get(i, 0) for i in last):
                self.final = ids
                raise _SoakOver
        if now - self.ending_since > SOAK_SETTLE_S:
            self.final = ids
            current = {r.replica_id for r in back}
            self.unhealed = [f"replica_{i}" for i in range(self.workers)]
            self.unhealed = [r for r in self.unhealed if r not in current]
            raise _SoakOver


def _sync_times(out: str) -> list[tuple[int, float]]:
    """Each committed sync's number and the first time a replica recorded it."""
    first: dict[int, float] = {}
    for folder in replica_folders(out):
        for r in read_replica_records(folder):
            if r.get("kind") == "sync" and r.get("committed", True) and "time" in r:
                k = int(r["sync"])
                first[k] = min(first.get(k, float("inf")), float(r["time"]))
    return sorted(first.items())


def run_soak(
    spec: ChaosSpec, *, command: str = "", progress: Callable[[str], None] = logger.info
) -> dict[str, Any]:
    """The soak (``--soak MINUTES``): the elastic job of the first of ``algos`` over the first
    of ``links`` (default 100mbit) with ``workers`` replicas, while replicas die and are started
    at random (:class:`Soak`: kill with probability 0.4, start 0.6, per event, as PCCL's stress
    test does) for MINUTES; then every replica away is started and the job is stopped once all
    are healed and have committed a sync since. It passes when no two replicas that committed
    a sync hold different digests of the outer state (anchor and outer optimizer), no stretch
    without a committed sync is longer than :data:`SOAK_STALL_S`, and every replica running at
    the end was healed (or never left)."""
    from lowcomm.runfiles import write_json, write_text
    from lowcomm.train.elastic import launch_replicas
    from lowcomm.train.errors import WorkerFailed

    assert spec.soak is not None
    os.makedirs(spec.out, exist_ok=True)
    algo = spec.algos[0]
    link = spec.links[0] if spec.links else "100mbit"
    out = os.path.join(spec.out, "runs", f"{algo}-soak")
    if os.path.isdir(out):
        shutil.rmtree(out)
    minutes = spec.soak
    cfg = train_config(
        spec, algo, 10**6, out, link=link, max_restarts=10**6, sync_warmup=SOAK_WARMUP
    )
    progress(f"chaos: {algo} soak ({spec.workers} replicas over {link}, {minutes:g} minutes)")
    soak = Soak(spec.workers, spec.seed, end_s=60.0 * minutes)
    t0 = time.time()
    deadline = t0 + 60.0 * minutes + SOAK_SETTLE_S + 600.0
    error = None

    def bounded(now: float, running: list[RunningReplica], done: bool) -> None:
        if time.time() > deadline:
            raise TimeoutError("the soak did not end within its bound")
        soak(now, running, done)

    try:
        launch_replicas(cfg, chaos=bounded, hold=soak.held)
        error = "the job finished on its own"
    except _SoakOver:
        pass
    except (WorkerFailed, TimeoutError) as e:
        error = str(e)
    finally:
        soak.release()
    wall = time.time() - t0
    checks = check_run(out, None)
    times = _sync_times(out)
    ready = soak.ready_at
    after = [(k, t) for k, t in times if ready is None or t - t0 >= ready]
    gaps = [b[1] - a[1] for a, b in zip(after, after[1:], strict=False)]
    stall = max(gaps, default=None)
    kills = sum(a["signal"] == "SIGKILL" for a in soak.actions)
    # every start after a kill (a folder replica_N.K; only replicas up to date are killed, so
    # each must have been healed before the end)
    returns = [f for f in replica_folders(out) if "." in os.path.basename(f)]
    returns_healed = sum(healed(f) for f in returns)
    run = {
        "algo": algo,
        "kind": "soak",
        "link": link,
        "minutes": minutes,
        "error": error,
        "wall_s": wall,
        "syncs": len(times),
        "kills": kills,
        "starts": sum(a["signal"] == "start" for a in soak.actions),
        "longest_without_sync_s": stall,
        "stall_bound_s": SOAK_STALL_S,
        "unhealed": soak.unhealed,
        "returns": len(returns),
        "returns_healed": returns_healed,
        "chaos": soak.actions,
        **checks,
    }
    run["passed"] = bool(
        error is None
        and checks["anchors_identical"]
        and stall is not None
        and stall <= SOAK_STALL_S
        and not soak.unhealed
        and returns_healed == len(returns)
        and kills > 0
    )
    results = {"command": command, "spec": dataclasses.asdict(spec), "runs": [run]}
    write_json(os.path.join(spec.out, "results.json"), results)
    write_text(os.path.join(spec.out, "chaos.md"), format_soak(results) + "\n")
    return results


def format_soak(results: dict[str, Any]) -> str:
    """The soak's verdict in a Markdown table."""
    (run,) = results["runs"]
    stall = run["longest_without_sync_s"]
    rows = [
        ("passed", "yes" if run["passed"] else f"**no** ({run['error'] or 'see the checks'})"),
        ("job", f"{run['algo']} over {run['link']}, {run['minutes']:g} minutes"),
        ("kills / starts", f"{run['kills']} / {run['starts']}"),
        ("syncs committed", str(run["syncs"])),
        ("outer state identical at every sync", "yes" if run["anchors_identical"] else "**no**"),
        (
            "longest without a committed sync",
            "-" if stall is None else f"{stall:.1f} s (bound {run['stall_bound_s']:g} s)",
        ),
        (
            "returning replicas healed",
            f"{run['returns_healed']} of {run['returns']} starts after a kill"
            + (f"; unhealed at the end: {', '.join(run['unhealed'])}" if run["unhealed"] else ""),
        ),
    ]
    lines = ["| check | result |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
