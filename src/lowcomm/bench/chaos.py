"""The chaos benchmark (``lowcomm bench --chaos``): elastic jobs (``lowcomm train
--fault-tolerance``) on this machine while replicas are killed, stalled and kept away, against the
same job fault-free in the same run.

For every algorithm of the spec (``job``: the default job, no ``--algo``, whose algorithm and
settings are chosen from its link as ``lowcomm train`` without ``--algo`` chooses them):

* **fault-free** — the job with no fault: the reference;
* **mtbf** — the same job while one random running replica is SIGKILLed every ``mtbf`` seconds
  (restarted alone each time, healed from a live one);
* **sync** — a shorter job (``targeted_steps``) whose replica 1 SIGKILLs itself right after it
  joined the quorum of the sync launched at the middle step, before its collective: a sync in
  flight.

Once (the first algorithm), on the shorter job:

* **donor** — replica 1 is killed; the first replica that sends it its state dies half-way
  through the transfer; the joiner heals from another;
* **stall** — replica 2 is SIGSTOPped for three heartbeat timeouts, then SIGCONTed;
* **below-min** — ``min_replicas`` is one less than the replicas, and two are killed at once: the
  survivors wait for a quorum until the two are back;
* **never-returns** — one replica is killed and not restarted: the job finishes with the others.

Every run is checked, not only timed: it finished; every sync's anchor is the same on every
replica that committed it (a checksum per sync, :meth:`ElasticReplica.synced`); the finished
replicas hold the same model; every fault of a replica that came back was healed; the time from a
restarted replica's start-up to its heal, in rounds of the fault-free run.

Every loop is bounded: a run is stopped after ``run_timeout_s``; every stopped replica is
continued and every process ends with its run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from lowcomm.registry import ELASTIC
from lowcomm.train.elastic import HEARTBEAT_TIMEOUT_S, RunningReplica, read_replica_records

__all__ = [
    "CHAOS_KINDS",
    "JOB",
    "ChaosSpec",
    "MtbfLoop",
    "Spinners",
    "format_chaos",
    "run_chaos",
]

logger = logging.getLogger(__name__)

JOB = "job"
"""The default job in ``algos``: ``lowcomm train`` without ``--algo`` (CO2, or the algorithm its
link makes faster to DDP's loss, with the settings chosen for that link)."""

CHAOS_KINDS = ("sync", "donor", "stall", "below-min", "never-returns")
"""The targeted faults (module docstring)."""

SOAK_MAX_MINUTES = 24 * 60.0
"""The longest soak (``--soak``: :mod:`lowcomm.bench.soak`)."""


@dataclasses.dataclass
class ChaosSpec:
    """What ``lowcomm bench --chaos`` runs (module docstring)."""

    algos: list[str] = dataclasses.field(default_factory=lambda: ["co2", "diloco", "streaming"])
    workers: int = 4
    """Replicas of every job."""
    steps: int = 960
    """Inner steps of the fault-free and MTBF jobs (the default job's)."""
    targeted_steps: int = 240
    """Inner steps of the jobs with one targeted fault."""
    mtbf: float = 30.0
    """Seconds between two kills of the MTBF loop."""
    faults: list[str] = dataclasses.field(default_factory=lambda: list(CHAOS_KINDS))
    """Which targeted faults to run."""
    seed: int = 0
    out: str = "runs/chaos"
    data: str | None = None
    collective_timeout: float = 30.0
    """Bound on one sync's collective (a stalled replica's peers wait this long at most)."""
    run_timeout_s: float = 1800.0
    """A run still going after this long is stopped and reported as such."""
    links: list[str] | None = None
    """Goodput over slow links instead of the targeted faults
    (:func:`lowcomm.bench.chaos_links.run_link_chaos`): per link and algorithm, the fault-free,
    MTBF and checkpoint-restart runs of the job chosen for it."""
    lost_state: str = "link"
    """Where the checkpoint-restart runs of ``links`` get a killed worker's state back:
    ``link`` (a kill loses the worker's machine and its disk, as a killed elastic replica
    loses its state: the replacement reads its checkpoint file across the emulated link, and
    the group waits for it) or ``local`` (its own disk, as a process restarted in place)."""
    soak: float | None = None
    """Minutes of the soak instead (:func:`lowcomm.bench.soak.run_soak`); its link: the first
    of ``links`` (default 100mbit)."""

    def __post_init__(self) -> None:
        unknown = [a for a in self.algos if a not in ELASTIC and a != JOB]
        if not self.algos or unknown:
            raise ValueError(
                f"--algos: {unknown[0] if unknown else '(none)'!r} does not run elastic; use "
                f"some of {', '.join(ELASTIC)}, or {JOB} (the default job, its algorithm "
                "chosen from its link)"
            )
        wrong = [k for k in self.faults if k not in CHAOS_KINDS]
        if wrong:
            raise ValueError(
                f"--faults: unknown {wrong[0]!r}; use some of {', '.join(CHAOS_KINDS)}"
            )
        if not isinstance(self.workers, int) or self.workers < 3:
            raise ValueError(
                f"--workers must be at least 3 for --chaos (two killed at once must leave a "
                f"survivor beside one more), got {self.workers}"
            )
        for name in ("steps", "targeted_steps"):
            if getattr(self, name) < 24:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 24 for --chaos")
        if not self.mtbf > 0:
            raise ValueError(f"--mtbf must be > 0 seconds, got {self.mtbf}")
        if self.links is not None:
            from lowcomm.link import EmulatedLink

            if not self.links:
                raise ValueError("--links: give at least one link (e.g. 100mbit,10mbit)")
            for link in self.links:
                EmulatedLink.parse(link)  # (a bad one names itself)
        if self.lost_state not in ("link", "local"):
            raise ValueError(f"--lost-state must be link or local, got {self.lost_state!r}")
        if self.soak is not None and not 0 < self.soak <= SOAK_MAX_MINUTES:
            raise ValueError(
                f"--soak must be more than 0 and at most {SOAK_MAX_MINUTES:g} minutes, got "
                f"{self.soak}"
            )


# --- faults the parent makes (chaos= of launch_replicas) ---------------------------------------


def syncs_done(folder: str) -> int:
    """Sync records in a replica's ``metrics.jsonl`` so far."""
    return sum(r.get("kind") == "sync" for r in read_replica_records(folder))


class ChaosSchedule:
    """A fault schedule: waits until every replica has committed ``warm_syncs`` syncs, then
    :meth:`act` s on every poll (at most every half second). Records what it did."""

    warm_syncs = 2

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.ready_at: float | None = None
        self.actions: list[dict[str, Any]] = []
        self.stopped: list[int] = []
        self._polled = -1.0

    def __call__(self, now: float, running: list[RunningReplica], done: bool) -> None:
        """One poll of the launcher; after the job is ``done``, only stopped replicas are
        continued."""
        if done:
            for r in running:
                if r.process.pid in self.stopped:
                    self.signal(now, r, signal.SIGCONT)
            return
        if now - self._polled < 0.5:
            return
        self._polled = now
        if self.ready_at is None:
            if len(running) == self.workers and all(
                syncs_done(r.folder) >= self.warm_syncs for r in running
            ):
                self.ready_at = now
            return
        self.act(now, running)

    def act(self, now: float, running: list[RunningReplica]) -> None:  # pragma: no cover
        raise NotImplementedError

    def signal(self, now: float, r: RunningReplica, sig: signal.Signals) -> None:
        if r.process.poll() is not None:
            return
        os.kill(r.process.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.append(r.process.pid)
        elif sig == signal.SIGCONT and r.process.pid in self.stopped:
            self.stopped.remove(r.process.pid)
        self.actions.append({"time_s": now, "replica": r.replica_id, "signal": sig.name})
        logger.info("chaos: %s to %s at %.1f s", sig.name, r.replica_id, now)

    def release(self) -> None:
        """Continue every process this schedule stopped (the run ended meanwhile)."""
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()


class Spinners:
    """The fairness correction of a run with replicas away on a machine they share: while a
    killed replica is away (until its next start is healed), a process spins on the core it
    would have used, so that the others do not run faster for its absence."""

    def __init__(self) -> None:
        self.away: dict[str, subprocess.Popen[bytes]] = {}
        self.spun_s = 0.0
        self._since: dict[str, float] = {}

    def start(self, replica_id: str) -> None:
        if replica_id in self.away:
            return
        self.away[replica_id] = subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._since[replica_id] = time.monotonic()

    def back(self, running: list[RunningReplica]) -> None:
        """Stop the spinner of every replica whose new start has been healed."""
        for r in running:
            if r.replica_id in self.away and r.attempt > 0 and healed(r.folder):
                self._stop(r.replica_id)

    def _stop(self, replica_id: str) -> None:
        proc = self.away.pop(replica_id)
        proc.kill()
        proc.wait(timeout=30)
        self.spun_s += time.monotonic() - self._since.pop(replica_id)

    def release(self) -> None:
        for replica_id in list(self.away):
            self._stop(replica_id)


def healed(folder: str) -> bool:
    return any(r.get("kind") == "healed" for r in read_replica_records(folder))


class MtbfLoop(ChaosSchedule):
    """SIGKILL one running replica, chosen at random (seeded), every ``period_s`` seconds; with
    ``spin``, a :class:`Spinners` process holds each killed replica's core until it is back."""

    def __init__(self, workers: int, period_s: float, seed: int, *, spin: bool = False) -> None:
        super().__init__(workers)
        self.period_s = period_s
        self.rng = random.Random(seed)
        self.last: float | None = None
        self.spinners = Spinners() if spin else None

    def act(self, now: float, running: list[RunningReplica]) -> None:
        assert self.ready_at is not None
        if self.spinners is not None:
            self.spinners.back(running)
        last = self.ready_at if self.last is None else self.last
        if now - last < self.period_s or not running:
            return
        self.last = now
        victim = self.rng.choice(sorted(running, key=lambda r: r.replica_id))
        self.signal(now, victim, signal.SIGKILL)
        if self.spinners is not None:
            self.spinners.start(victim.replica_id)

    def release(self) -> None:
        super().release()
        if self.spinners is not None:
            self.spinners.release()


class Targeted(ChaosSchedule):
    """One targeted fault, ``after_s`` seconds after every replica committed its warm syncs:
    ``kill`` (SIGKILL the replicas named) or ``stall`` (SIGSTOP them, SIGCONT ``stall_s``
    later)."""

    def __init__(
        self,
        workers: int,
        replicas: list[str],
        *,
        stall_s: float | None = None,
        after_s: float = 1.0,
    ) -> None:
        super().__init__(workers)
        self.replicas = replicas
        self.stall_s = stall_s
        self.after_s = after_s
        self.fired_at: float | None = None
        self.continued = False

    def act(self, now: float, running: list[RunningReplica]) -> None:
        assert self.ready_at is not None
        targets = [r for r in running if r.replica_id in self.replicas]
        if self.fired_at is None and now - self.ready_at >= self.after_s:
            self.fired_at = now
            sig = signal.SIGKILL if self.stall_s is None else signal.SIGSTOP
            for r in targets:
                self.signal(now, r, sig)
        elif (
            self.stall_s is not None
            and self.fired_at is not None
            and not self.continued
            and now - self.fired_at >= self.stall_s
        ):
            self.continued = True
            for r in targets:
                self.signal(now, r, signal.SIGCONT)


# --- one run ----------------------------------------------------------------------------------


def train_config(spec: ChaosSpec, algo: str, steps: int, out: str, **extra: Any) -> Any:
    """The resolved ``TrainConfig`` of the chaos run of ``algo`` (:data:`JOB`: no algorithm
    given) in ``out``, elastic unless ``extra`` says otherwise."""
    from lowcomm.train.config import config_from_dict

    values: dict[str, Any] = {
        **({} if algo == JOB else {"algo": algo}),  # (the default job: none given)
        "fault_tolerance": True,
        "workers": spec.workers,
        "steps": steps,
        "seed": spec.seed,
        "collective_timeout": spec.collective_timeout,
        "name": os.path.basename(out),
        "out": out,
        "overwrite": True,
        "quiet": True,
        **({"data": spec.data} if spec.data is not None else {}),
        **extra,
    }
    return config_from_dict(values, source="bench --chaos").with_paths()


def replica_folders(out: str) -> list[str]:
    root = os.path.join(out, "replicas")
    if not os.path.isdir(root):
        return []
    return sorted(
        os.path.join(root, n) for n in os.listdir(root) if os.path.isdir(os.path.join(root, n))
    )


def check_run(out: str, summary: dict[str, Any] | None) -> dict[str, Any]:
    """What a run's replicas wrote, checked: anchors identical at every sync, finished models
    identical, faults healed, round length and heal waits."""
    anchors: dict[int, set[str]] = {}
    times: list[float] = []
    ready: dict[str, float] = {}
    returned = returned_healed = 0
    for folder in replica_folders(out):
        syncs = [r for r in read_replica_records(folder) if r.get("kind") == "sync"]
        for r in syncs:
            if r.get("committed", True) and not r.get("catching_up"):
                digest = f"{r['anchor']}/{r.get('outer_state', '')}"
                anchors.setdefault(int(r["sync"]), set()).add(digest)
        if os.path.basename(folder) == "replica_0":
            times = [float(r["time"]) for r in syncs if "time" in r]
        try:
            with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
                own = json.load(f).get("elastic") or {}
            if own.get("ready_at") is not None:
                ready[os.path.basename(folder)] = float(own["ready_at"])
            if own.get("attempt", 0) > 0:  # a restarted replica that finished the job
                returned += 1
                returned_healed += bool(own.get("heals"))
        except (OSError, ValueError):
            pass
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "syncs_checked": len(anchors),
        "anchors_identical": bool(anchors) and all(len(a) == 1 for a in anchors.values()),
        "round_s": statistics.median(gaps) if gaps else None,
        "ready_at": ready,
        "returned": returned,
        "returned_healed": returned_healed,
    }


def run_elastic(
    spec: ChaosSpec,
    algo: str,
    kind: str,
    steps: int,
    *,
    chaos: ChaosSchedule | None = None,
    env: dict[str, str] | None = None,
    progress: Callable[[str], None],
    **extra: Any,
) -> dict[str, Any]:
    from lowcomm.train.elastic import launch_replicas
    from lowcomm.train.errors import WorkerFailed

    out = os.path.join(spec.out, "runs", f"{algo}-{kind}")
    if os.path.isdir(out):
        shutil.rmtree(out)
    cfg = train_config(spec, algo, steps, out, **extra)
    progress(f"chaos: {algo} {kind} ({spec.workers} replicas, {steps} steps)")
    summary: dict[str, Any] | None
    error = None
    t0 = time.time()
    deadline = t0 + spec.run_timeout_s

    def bounded(now: float, running: list[RunningReplica], done: bool) -> None:
        if time.time() > deadline:
            raise TimeoutError(f"stopped after {spec.run_timeout_s:.0f} s")
        if chaos is not None:
            chaos(now, running, done)

    try:
        summary = launch_replicas(cfg, env=env, chaos=bounded)
    except (WorkerFailed, TimeoutError) as e:
        summary, error = None, str(e)
    finally:
        if chaos is not None:
            chaos.release()
    if summary is None:
        try:
            with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
        except (OSError, ValueError):
            summary = None
    checks = check_run(out, summary)
    faults = (summary or {}).get("faults") or []
    heal_waits = []
    for f in faults:
        if f.get("healed_at_s") is None:
            continue
        # the replica's start after this fault: its first attempt after the fault time
        back = [
            e
            for e in (summary or {}).get("events", [])
            if e["event"] == "restart" and e["replica"] == f["replica"] and e["time_s"] >= f["at_s"]
        ]
        name = f"{f['replica']}.{back[0]['attempt']}" if back else None
        ready_abs = checks["ready_at"].get(name) if name else None
        if ready_abs is not None and summary is not None:
            started = summary.get("started_at", 0.0)
            heal_waits.append(f["healed_at_s"] - (ready_abs - started))
    return {
        "algo": algo,
        "kind": kind,
        "steps": steps,
        "status": (summary or {}).get("status", "failed") if error is None else "failed",
        "error": error,
        "wall_s": time.time() - t0,
        "tokens_per_s": (summary or {}).get("tokens_per_s"),
        "tokens_trained": (summary or {}).get("tokens_trained"),
        "tokens_not_trained": (summary or {}).get("tokens_not_trained"),
        "val_loss_final": (summary or {}).get("val_loss_final"),
        "replicas_identical": bool((summary or {}).get("replicas_identical")),
        "finished_replicas": len((summary or {}).get("finished_replicas") or []),
        "faults": len(faults),
        "healed": sum(f.get("healed_at_s") is not None for f in faults),
        "heals": (summary or {}).get("heals", 0),
        "fault_to_healed_s": [f["fault_to_healed_s"] for f in faults if f.get("fault_to_healed_s")],
        "heal_bytes": [f.get("heal_bytes") for f in faults if f.get("healed_at_s") is not None],
        "heal_transfer_s": [
            f.get("heal_transfer_s") for f in faults if f.get("healed_at_s") is not None
        ],
        "goodput": (
            (summary or {}).get("tokens_trained", 0) / (time.time() - t0)
            if (summary or {}).get("tokens_trained")
            else None
        ),
        "spun_s": (
            chaos.spinners.spun_s
            if isinstance(chaos, MtbfLoop) and chaos.spinners is not None
            else None
        ),
        "startup_to_healed_s": heal_waits,
        "participants": (summary or {}).get("participants_per_sync") or [],
        "chaos": [] if chaos is None else chaos.actions,
        **checks,
    }


# --- the benchmark ----------------------------------------------------------------------------


def run_chaos(
    spec: ChaosSpec, *, command: str = "", progress: Callable[[str], None] = logger.info
) -> dict[str, Any]:
    """Run the chaos benchmark (module docstring); writes ``results.json`` and ``chaos.md`` to
    ``spec.out`` and returns the results."""
    from lowcomm.runfiles import write_json, write_text

    os.makedirs(spec.out, exist_ok=True)
    runs: list[dict[str, Any]] = []
    mid = spec.targeted_steps // 2
    w = spec.workers
    for algo in spec.algos:
        ref = run_elastic(spec, algo, "fault-free", spec.steps, progress=progress)
        runs.append(ref)
        mtbf = run_elastic(
            spec,
            algo,
            "mtbf",
            spec.steps,
            chaos=MtbfLoop(w, spec.mtbf, spec.seed),
            progress=progress,
            max_restarts=1000,
        )
        runs.append(versus(mtbf, ref))
        if "sync" in spec.faults:
            runs.append(
                run_elastic(
                    spec,
                    algo,
                    "sync",
                    spec.targeted_steps,
                    env={"LOWCOMM_FAULT_INJECT": f"1:{mid}:sync"},
                    progress=progress,
                    max_restarts=1,
                )
            )
    first = spec.algos[0]
    if "donor" in spec.faults:
        runs.append(
            run_elastic(
                spec,
                first,
                "donor",
                spec.targeted_steps,
                chaos=Targeted(w, ["replica_1"]),
                env={"LOWCOMM_FAULT_INJECT": "*:0:donor"},
                progress=progress,
                max_restarts=1,
            )
        )
    if "stall" in spec.faults:
        runs.append(
            run_elastic(
                spec,
                first,
                "stall",
                spec.targeted_steps,
                chaos=Targeted(w, ["replica_2"], stall_s=3 * HEARTBEAT_TIMEOUT_S),
                progress=progress,
                max_restarts=1,
            )
        )
    if "below-min" in spec.faults:
        runs.append(
            run_elastic(
                spec,
                first,
                "below-min",
                spec.targeted_steps,
                chaos=Targeted(w, ["replica_1", "replica_2"]),
                progress=progress,
                max_restarts=1,
                min_replicas=w - 1,
            )
        )
    if "never-returns" in spec.faults:
        runs.append(
            run_elastic(
                spec,
                first,
                "never-returns",
                spec.targeted_steps,
                chaos=Targeted(w, [f"replica_{w - 1}"]),
                progress=progress,
                max_restarts=0,
            )
        )
    results = {"command": command, "spec": dataclasses.asdict(spec), "runs": runs}
    write_json(os.path.join(spec.out, "results.json"), results)
    write_text(os.path.join(spec.out, "chaos.md"), format_chaos(results) + "\n")
    return results


def versus(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``run`` with its throughput and final loss as shares of ``ref``'s."""
    tps, ref_tps = run.get("tokens_per_s"), ref.get("tokens_per_s")
    loss, ref_loss = run.get("val_loss_final"), ref.get("val_loss_final")
    run["tokens_per_s_vs_fault_free"] = tps / ref_tps if tps and ref_tps else None
    good, ref_good = run.get("goodput"), ref.get("goodput")
    run["goodput_vs_fault_free"] = good / ref_good if good and ref_good else None
    run["val_loss_vs_fault_free"] = loss / ref_loss - 1 if loss and ref_loss else None
    run["round_s_fault_free"] = ref.get("round_s")
    return run


def survived(run: dict[str, Any]) -> str:
    """Survived: finished, anchors identical at every sync, the finished replicas' models
    identical, every restarted replica that finished the job healed first."""
    ok = (
        run["status"] == "finished"
        and run["anchors_identical"]
        and run["replicas_identical"]
        and run["returned_healed"] == run["returned"]
    )
    return "yes" if ok else "**no**"


def format_chaos(results: dict[str, Any]) -> str:
    """The Markdown table of a chaos benchmark."""

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| algorithm | run | steps | survived | tokens/s | vs fault-free | val loss | vs "
        "fault-free | faults / healed / heals | fault to healed (s) | start-up to healed "
        "(rounds) | syncs checked | participants |",
        "|" + " --- |" * 13,
    ]
    for run in results["runs"]:
        round_s = run.get("round_s_fault_free") or run.get("round_s")
        waits = run["startup_to_healed_s"]
        heals = run["fault_to_healed_s"]
        parts = run["participants"]
        lines.append(
            f"| {run['algo']} | {run['kind']} | {run['steps']} | {survived(run)} | "
            f"{num(run['tokens_per_s'], ',.0f')} | "
            f"{num(run.get('tokens_per_s_vs_fault_free'), '.0%')} | "
            f"{num(run['val_loss_final'], '.3f')} | "
            f"{num(run.get('val_loss_vs_fault_free'), '+.1%')} | "
            f"{run['faults']} / {run['healed']} / {run['heals']} | "
            f"{f'{min(heals):.1f}-{max(heals):.1f}' if heals else '-'} | "
            f"{f'{max(waits) / round_s:.1f}' if waits and round_s else '-'} | "
            f"{run['syncs_checked']} | "
            f"{f'{min(parts)}-{max(parts)}' if parts else '-'} |"
        )
    return "\n".join(lines)
