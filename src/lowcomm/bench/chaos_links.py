"""Goodput over slow links (``lowcomm bench --chaos --links``): the elastic job with the settings
chosen for each link, fault-free and under an MTBF loop, against the same job as a fixed group
that recovers by checkpoint-restart, all against the no-sync ceiling (:func:`run_link_chaos`)."""

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
import threading
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from lowcomm.bench.chaos import (
    JOB,
    ChaosSpec,
    MtbfLoop,
    run_elastic,
    survived,
    train_config,
    versus,
)
from lowcomm.train.elastic import read_replica_records
from lowcomm.train.faults import LOST_STATE_ENV, mark_lost

__all__ = ["format_link_chaos", "run_link_chaos"]

logger = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class _WorkerKiller:
    """The MTBF loop of a fixed group (the checkpoint-restart runs): once the job has trained
    ``ready_steps`` steps (the warm start and two rounds, where the elastic loop starts),
    SIGKILL one worker of the latest attempt, chosen at random (seeded), every ``period_s``
    seconds; the launcher then restarts the whole group from the last checkpoint. With
    ``lost`` (a :data:`~lowcomm.train.faults.LOST_STATE_ENV` folder) each kill loses the
    worker's machine: the next attempt's worker of that rank fetches its checkpoint over the
    link. A thread, stopped by :meth:`stop`."""

    def __init__(
        self,
        out: str,
        pids: str,
        period_s: float,
        seed: int,
        ready_steps: int,
        deadline: float,
        *,
        lost: str | None = None,
    ) -> None:
        self.out, self.pids, self.period_s, self.lost = out, pids, period_s, lost
        self.rng = random.Random(seed)
        self.ready_steps, self.deadline = ready_steps, deadline
        self.kills: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._t0 = time.time()
        self._thread.start()

    def _trained(self) -> int:
        steps = [
            int(r.get("step", 0))
            for r in read_replica_records(self.out)
            if r.get("kind") in ("step", "eval")
        ]
        return max(steps, default=0)

    def _latest(self) -> tuple[int, dict[int, int]]:
        """The latest attempt, and rank -> pid of its workers that run."""
        found: dict[int, dict[int, int]] = {}
        for name in os.listdir(self.pids):
            rank, attempt = name.removeprefix("rank").split(".attempt")
            with open(os.path.join(self.pids, name), encoding="utf-8") as f:
                found.setdefault(int(attempt), {})[int(rank)] = int(f.read().strip() or 0)
        if not found:
            return 0, {}
        latest = max(found)
        return latest, {r: pid for r, pid in found[latest].items() if pid > 0 and _alive(pid)}

    def _loop(self) -> None:
        last = None
        while not self._stop.wait(0.5) and time.time() < self.deadline:
            if last is None:
                if self._trained() < self.ready_steps:
                    continue
                last = time.time()
            if time.time() - last < self.period_s:
                continue
            attempt, workers = self._latest()
            if not workers:  # between two attempts: the next kill when the group runs again
                continue
            last = time.time()
            rank = self.rng.choice(sorted(workers))
            with contextlib.suppress(ProcessLookupError):
                os.kill(workers[rank], signal.SIGKILL)
                self.kills.append({"time_s": last - self._t0, "rank": rank, "attempt": attempt})
                logger.info("chaos: SIGKILL to rank %d at %.1f s", rank, last - self._t0)
                if self.lost is not None:
                    mark_lost(self.lost, rank, attempt)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _run_fixed(
    spec: ChaosSpec,
    algo: str,
    kind: str,
    *,
    progress: Callable[[str], None],
    kill: bool = False,
    ready_steps: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One run of the job as a fixed group (no fault tolerance): the ceiling (``algo`` none),
    or the checkpoint-restart run (``kill``: a worker SIGKILLed every ``mtbf`` seconds once
    ``ready_steps`` are trained (default: the warm start and two rounds of ``cfg``), the whole
    group restarted from its last checkpoint, as a job without --fault-tolerance recovers)."""
    import tempfile

    from lowcomm.train.errors import WorkerFailed
    from lowcomm.train.launcher import launch
    from lowcomm.train.preflight import check_environment, prepare_output
    from lowcomm.train.worker import PID_DIR_ENV

    out = os.path.join(spec.out, "runs", f"{algo}-{kind}")
    if os.path.isdir(out):
        shutil.rmtree(out)
    cfg = train_config(spec, algo, spec.steps, out, fault_tolerance=False, **extra)
    if kill:
        cfg = cfg.replace(checkpoint_every=cfg.sync_every, max_restarts=1000)
    progress(f"chaos: {algo} {kind} ({spec.workers} workers, {spec.steps} steps)")
    check_environment(cfg)
    prepare_output(cfg)
    summary: dict[str, Any] | None = None
    error = None
    killer = None
    t0 = time.time()
    fetched: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        pids = stack.enter_context(tempfile.TemporaryDirectory(prefix="lowcomm-pids-"))
        # a kill loses the worker's machine: its replacement's checkpoint crosses the link
        lost = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="lowcomm-lost-"))
            if kill and spec.lost_state == "link" and cfg.link is not None
            else None
        )
        env = {PID_DIR_ENV: pids, **({LOST_STATE_ENV: lost} if lost is not None else {})}
        stack.enter_context(mock.patch.dict(os.environ, env))  # (restored on the way out)
        try:
            if kill:
                # the first kill where the elastic MTBF loop's comes: every replica two
                # syncs past the warm start
                ready = ready_steps
                if ready is None:
                    ready = cfg.sync_warmup_steps() + 2 * cfg.sync_every
                killer = _WorkerKiller(
                    out, pids, spec.mtbf, spec.seed, ready, t0 + spec.run_timeout_s, lost=lost
                )
            summary = launch(cfg)
        except WorkerFailed as e:
            error = str(e)
        finally:
            if killer is not None:
                killer.stop()
            if lost is not None:
                fetched = _fetched(lost)
    wall = time.time() - t0
    tokens = (summary or {}).get("tokens")
    return {
        "algo": algo,
        "kind": kind,
        "steps": spec.steps,
        "status": "finished" if summary is not None else "failed",
        "error": error,
        "wall_s": wall,
        "tokens_trained": tokens,
        "goodput": tokens / wall if tokens else None,
        "val_loss_final": (summary or {}).get("val_loss_final"),
        "faults": len(killer.kills) if killer is not None else 0,
        "chaos": killer.kills if killer is not None else [],
        "checkpoint_every": cfg.checkpoint_every,
        "lost_state": ("link" if lost is not None else "local") if kill else None,
        "heal_bytes": [f["bytes"] for f in fetched],
        "heal_transfer_s": [f["waited_s"] for f in fetched],
        "settings": _tuned_settings(out),  # (what it chose from its link, if it chose)
    }


def _fetched(folder: str) -> list[dict[str, Any]]:
    """What the checkpoint-restart run's replacements fetched over the link, attempt by attempt
    (:func:`lowcomm.train.faults.fetch_lost_state`'s notes)."""
    notes = []
    for name in os.listdir(folder):
        if name.endswith(".json"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                note = json.load(f)
            note["attempt"] = int(name.split(".")[0].removeprefix("attempt"))
            notes.append(note)
    return sorted(notes, key=lambda n: (n["attempt"], n["rank"]))


def run_link_chaos(
    spec: ChaosSpec, *, command: str = "", progress: Callable[[str], None] = logger.info
) -> dict[str, Any]:
    """Goodput over slow links (``--links``): the no-sync ceiling (``--algo none``, the same
    workers and steps; run first and last, the faster kept); between them, for every link and
    algorithm, the elastic job with the settings chosen for that link, fault-free and with a
    replica SIGKILLed every ``mtbf`` seconds (a process spinning on a killed replica's core
    until it is back: on a shared machine the others would otherwise run faster without it),
    and the same job as a fixed group with the same settings, recovering by checkpoint-restart
    (a checkpoint every round; a worker SIGKILLed every ``mtbf`` seconds, its machine lost with
    it where ``spec.lost_state`` is ``link``: its replacement reads its checkpoint file across
    the link). Goodput: tokens that
    reached the model over the run's wall time (start-up and recovery included), against the
    ceiling."""
    from lowcomm.runfiles import write_json, write_text

    assert spec.links is not None
    os.makedirs(spec.out, exist_ok=True)
    ceiling = _run_fixed(spec, "none", "ceiling", progress=progress)
    runs: list[dict[str, Any]] = []
    for link in spec.links:
        tag = link.replace(":", "-")
        for algo in spec.algos:
            ref = run_elastic(
                spec, algo, f"{tag}-fault-free", spec.steps, progress=progress, link=link
            )
            mtbf = run_elastic(
                spec,
                algo,
                f"{tag}-mtbf",
                spec.steps,
                chaos=MtbfLoop(spec.workers, spec.mtbf, spec.seed, spin=True),
                progress=progress,
                max_restarts=1000,
                link=link,
            )
            folder = os.path.join(spec.out, "runs", f"{algo}-{tag}-fault-free")
            tuned = _tuned_settings(folder)
            # the default job without --fault-tolerance: as a user would run it, its settings
            # chosen from the link by itself; an algorithm: the elastic job's settings, given
            given = {} if algo == JOB else {"tune_link": "off", **tuned}
            ckpt = _run_fixed(
                spec,
                algo,
                f"{tag}-checkpoint-restart",
                progress=progress,
                kill=True,
                ready_steps=_kills_from(folder),
                link=link,
                **given,
            )
            for run in (ref, mtbf, ckpt):
                run["link"] = link
                if run.get("goodput") is None and run.get("tokens_trained"):
                    run["goodput"] = run["tokens_trained"] / run["wall_s"]
            ref["settings"] = mtbf["settings"] = tuned
            if algo != JOB:
                ckpt["settings"] = tuned
            runs += [ref, versus(mtbf, ref), versus(ckpt, ref)]
    # the ceiling again, at the end: the faster of the two (the machine is shared)
    again = _run_fixed(spec, "none", "ceiling-end", progress=progress)
    if (again.get("goodput") or 0) > (ceiling.get("goodput") or 0):
        again["kind"] = "ceiling"
        ceiling = again
    runs.insert(0, ceiling)
    results = {"command": command, "spec": dataclasses.asdict(spec), "runs": runs}
    write_json(os.path.join(spec.out, "results.json"), results)
    write_text(os.path.join(spec.out, "chaos.md"), format_link_chaos(results) + "\n")
    return results


def _kills_from(out: str) -> int | None:
    """The step from which the elastic run in ``out`` was under kills: its warm start and two
    syncs (the elastic MTBF loop's start), read from its first replica's summary (the settings
    it ran with, after the link's); ``None`` where it has none."""
    try:
        path = os.path.join(out, "replicas", "replica_0", "summary.json")
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    warm = (summary.get("sync_warmup") or {}).get("steps") or 0
    early = summary.get("early_rounds") or {}
    every = early.get("sync_every") or summary.get("sync_every")
    return None if not every else int(warm) + 2 * int(every)


def _tuned_settings(out: str) -> dict[str, Any]:
    """The settings an elastic run took from its link (its summary's ``link_tuning``)."""
    try:
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            record = json.load(f).get("link_tuning") or {}
    except (OSError, ValueError):
        return {}
    return dict(record.get("settings") or {})


def format_link_chaos(results: dict[str, Any]) -> str:
    """The Markdown table of ``--links``: goodput against the ceiling per link and algorithm."""

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    runs = results["runs"]
    ceiling: dict[str, Any] = next((r for r in runs if r["kind"] == "ceiling"), {})
    top = ceiling.get("goodput")
    lines = [
        f"No-sync ceiling (`--algo none`): {num(top, ',.0f')} tokens/s.",
        "",
        "| link | algorithm | run | survived | goodput (tokens/s) | of the ceiling | of "
        "fault-free | val loss | vs fault-free | faults | kill to healed (s) | state over the "
        "link (MB) | its transfer (s) | settings |",
        "|" + " --- |" * 14,
    ]
    for run in runs:
        if run["kind"] == "ceiling":
            continue
        kind = run["kind"].removeprefix(run["link"].replace(":", "-") + "-")
        heals = run.get("fault_to_healed_s") or []
        heal_mb = [b / 1e6 for b in run.get("heal_bytes") or [] if b]
        moved = [t for t in run.get("heal_transfer_s") or [] if t is not None]
        verdict = (
            survived(run)
            if "anchors_identical" in run
            else ("yes" if run["status"] == "finished" else "**no**")
        )
        settings = ", ".join(f"{k} {v}" for k, v in (run.get("settings") or {}).items())
        goodput = run.get("goodput")
        ref_share = run.get("goodput_vs_fault_free")
        lines.append(
            f"| {run['link']} | {run['algo']} | {kind} | {verdict} | {num(goodput, ',.0f')} | "
            f"{num(goodput / top if goodput and top else None, '.2f')} | "
            f"{num(ref_share, '.0%')} | {num(run['val_loss_final'], '.3f')} | "
            f"{num(run.get('val_loss_vs_fault_free'), '+.1%')} | {run['faults']} | "
            f"{f'{min(heals):.1f}-{max(heals):.1f}' if heals else '-'} | "
            f"{f'{statistics.mean(heal_mb):.1f}' if heal_mb else '-'} | "
            f"{f'{min(moved):.1f}-{max(moved):.1f}' if moved else '-'} | "
            f"{settings or 'the defaults'} |"
        )
    lines.append("")
    lines += _versus_restart(runs)
    return "\n".join(lines)


def _versus_restart(runs: list[dict[str, Any]]) -> list[str]:
    """One line per link and algorithm: the elastic job's goodput under the kills over the
    checkpoint-restart run's, and where that run's killed workers got their state back."""
    lines = []
    for ckpt in runs:
        if not ckpt["kind"].endswith("-checkpoint-restart") or not ckpt.get("goodput"):
            continue
        tag = ckpt["kind"].removesuffix("-checkpoint-restart")
        mtbf = next(
            (r for r in runs if r["kind"] == f"{tag}-mtbf" and r["algo"] == ckpt["algo"]), None
        )
        if mtbf is None or not mtbf.get("goodput"):
            continue
        where = {
            "link": "each killed worker's machine lost, its checkpoint read across the link",
            "local": "each killed worker restarted on its own disk",
        }.get(ckpt.get("lost_state") or "", "")
        lines.append(
            f"{ckpt['link']}, {ckpt['algo']}: under the kills the elastic job has "
            f"{mtbf['goodput'] / ckpt['goodput']:.2f} times the goodput of checkpoint-restart"
            + (f" ({where})." if where else ".")
        )
    return lines
