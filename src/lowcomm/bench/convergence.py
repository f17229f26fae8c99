"""``lowcomm bench --convergence``: how soon each algorithm reaches DDP's loss, per token and per
second, over several seeds.

Users buy time to a loss, which takes two measurements (../DESIGN "Convergence"):

* **loss at equal tokens**: every (algorithm, worker count, seed) trains the same job for the
  same steps with no link emulation (an emulated link changes when things happen, never what is
  computed: the schedules are by step), and the harness reads its validation curve;
* **step time on each link**: every (algorithm, worker count, link) trains a short job of
  ``timing_steps`` on the emulated link and the harness divides its training time (evaluations
  excluded) by its steps; it also reads how long a round's syncs were in flight against a
  round's compute (:func:`sync_to_round`: above 1, no schedule can hide them).

From those, per cell: the final validation loss (mean and spread over seeds) and its gap to
DDP's, the steps and tokens at which the seed-mean curve first reaches DDP's final mean loss
(linear between evaluations), and the wall time to it on every link, steps × that cell's own
step time on the link. ``lengths`` runs the job at several multiples of its steps (``--long``:
1× and 4×), which says whether a gap closes or grows with training. The assembled results and
goals are :mod:`lowcomm.bench.convergence_report`.

An entry is the job as ``lowcomm train`` runs it: where its algorithm is one the job tunes to
its link and the entry gives no ``tune_link``, it is one cell per link (``co2@10mbit``), whose
first loss job chooses the settings for that link (as the job on it would) and whose other loss
jobs and timing job run with that choice; ``co2/tune_link=off`` is the untuned job, one set of
settings on every link, and ``co2/tune_link=10mbit`` the job tuned for 10mbit on every link.
The report sets each tuned cell beside its untuned entry: its loss per token against the
untuned job's, the time it takes on its link to the untuned job's final loss, and the step
times the tuner predicted beside those run. The timing job makes its own prediction: its tuner
runs at start-up with every tuned setting given, so it keeps the cell's choice and predicts
from the compute it measures itself.

An algorithm may carry job settings after slashes, so variants sit side by side::

    spec = ConvergenceSpec(algos=["ddp", "co2", "co2/outer_lr=0.3/outer_momentum=0.0"])
    results = run_convergence(spec)      # writes spec.out/results.json, convergence.md, plots
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from lowcomm.bench.convergence_spec import ConvergenceSpec, label_for
from lowcomm.bench.variants import algo_fields
from lowcomm.registry import REGISTRY

__all__ = ["ConvergenceSpec", "algo_fields", "run_convergence", "sync_to_round"]

logger = logging.getLogger(__name__)


def _evals(out: str) -> list[dict[str, Any]]:
    """The evaluation records of a finished job."""
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]


def _read_curve(out: str) -> list[list[float]]:
    """``[tokens, step, val_loss]`` of every evaluation of a finished job."""
    return [[r["tokens"], r["step"], r["val_loss"]] for r in _evals(out)]


def _step_times(cfg: Any, summary: dict[str, Any]) -> dict[str, float]:
    """A timing job's training time per step (evaluations excluded): ``step_time_s``, and with
    a warm start ``warm_step_time_s`` over its first ``sync_warmup`` steps."""
    k = cfg.sync_warmup_steps()
    if not k:
        return {"step_time_s": summary["train_time_s"] / cfg.steps}
    at_k = next(r["train_s"] for r in _evals(cfg.out) if r["step"] == k)
    local = (summary["train_time_s"] - at_k) / (cfg.steps - k)
    return {"step_time_s": local, "warm_step_time_s": at_k / k}


def sync_to_round(cfg: Any) -> float | None:
    """How long a round's syncs were in flight over how long the round's compute took, in a
    finished timing job after its warm start (rank 0's counters): above 1, a round's bytes take
    longer on the link than a round of compute, so no schedule hides them. The compute of a
    step is its training time less the time blocked in collectives; a round is ``sync_every``
    steps (one step for ddp); ``None`` when nothing was in flight."""
    records = _evals(cfg.out)
    k = cfg.sync_warmup_steps() if REGISTRY[cfg.algo].is_outer else 0
    start = next((r for r in records if r["step"] == k), None)
    end = next((r for r in reversed(records) if r["step"] == cfg.steps), None)
    if start is None or end is None or end["step"] <= start["step"]:
        return None
    steps = end["step"] - start["step"]
    rounds = end.get("rounds", 0) - start.get("rounds", 0)
    in_flight = end.get("in_flight_s", 0.0) - start.get("in_flight_s", 0.0)
    blocked = end.get("blocked_s", 0.0) - start.get("blocked_s", 0.0)
    compute = (end["train_s"] - start["train_s"] - blocked) / steps
    if in_flight <= 0 or compute <= 0:
        return None
    per_round = in_flight / rounds if rounds > 0 else in_flight / steps
    steps_per_round = steps / rounds if rounds > 0 else 1
    return float(per_round / (steps_per_round * compute))


def _names_link(algo: str) -> bool:
    """Whether the entry ``algo`` names the link its settings are chosen for
    (``co2/tune_link=10mbit``)."""
    return str(algo_fields(algo).get("tune_link", "off")) not in ("off", "auto")


def _job(cfg: Any, reuse: bool) -> tuple[dict[str, Any], bool]:
    """Run one job (or reuse its finished summary when ``reuse`` and the settings match)."""
    from lowcomm.train.launcher import launch

    summary_path = os.path.join(cfg.out, "summary.json")
    if reuse and os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
        # the job's name carries its algorithm, settings, workers, length and seed
        # (and a timing job that predicts its steps holds that prediction)
        predicts = cfg.link is not None and cfg.tune_link != "off"
        same = (summary.get("steps"), summary.get("workers")) == (cfg.steps, cfg.workers)
        if same and (summary.get("link_tuning") is not None or not predicts):
            return summary, True
    summary = launch(cfg)
    assert summary is not None
    return summary, False


def run_convergence(
    spec: ConvergenceSpec,
    *,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every loss job and timing job of ``spec``; write the report to ``spec.out``; return
    the results (:func:`lowcomm.bench.convergence_report.assemble`).

    Raises:
        ValueError: a bad setting.
        lowcomm.train.launcher.WorkerFailed: a job's worker failed.
    """
    from lowcomm.bench.convergence_report import assemble, write_report

    spec.validate()
    note = progress or (lambda text: logger.info("%s", text))
    os.makedirs(spec.out, exist_ok=True)
    t_start = time.perf_counter()
    # (entry, the link it is tuned for or None): an entry tuned per link is a cell per link
    cells = [
        (algo, link)
        for algo in spec.algos
        for link in (spec.links if spec.tuned_per_link(algo) else [None])
    ]
    jobs: list[tuple[str, str | None, int, int, int, str | None]] = [
        (algo, tuned_for, w, seed, length, None)
        for length in spec.lengths
        for w in spec.workers
        for algo, tuned_for in cells
        for seed in spec.seeds
    ]
    jobs += [
        (algo, tuned_for, w, spec.seeds[0], 1, link)
        for w in spec.workers
        for algo, tuned_for in cells
        for link in ([tuned_for] if tuned_for is not None else spec.links)
    ]
    runs: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    chosen: dict[tuple[str, str | None, int], dict[str, Any]] = {}
    for i, (algo, tuned_for, w, seed, length, link) in enumerate(jobs, 1):
        label = algo if tuned_for is None else label_for(algo, tuned_for)
        # a cell tuned per link, or an entry that names its link: its first loss job chooses
        # the settings for the link, and every other job of it takes that choice
        chooses, key = tuned_for is not None or _names_link(algo), (algo, tuned_for, w)
        settings = chosen[key].get("settings") if key in chosen else None
        cfg = spec.train_config(algo, w, seed, length, link, tuned_for=tuned_for, settings=settings)
        t0 = time.perf_counter()
        summary, reused = _job(cfg, spec.reuse)
        took = "reused" if reused else f"{time.perf_counter() - t0:.0f} s"
        if chooses and key not in chosen:
            chosen[key] = summary.get("link_tuning") or {"settings": {}}
        row = {"algo": label, "base": cfg.algo, "workers": w, "steps": cfg.steps}
        if tuned_for is not None:
            record = chosen[key]
            row.update(entry=algo, tuned_for=tuned_for, chosen=record.get("settings", {}))
            row["predicted"] = {
                k: record.get(k) for k in ("step_s", "warm_step_s", "cost", "evidence")
            }
        if link is None:
            row.update(seed=seed, length=length, curve=_read_curve(cfg.out))
            row["warm_steps"] = cfg.sync_warmup_steps()
            row.update(val_loss_final=summary["val_loss_final"], tokens=summary["tokens"])
            wire = (summary.get("comm_mean") or {}).get("wire_bytes")
            if wire is not None:  # a worker's bytes on the wire over the whole job
                row["wire_bytes"] = wire
            runs.append(row)
            what = f"seed {seed}, {length}x: val {row['val_loss_final']:.3f}"
        else:
            own = summary.get("link_tuning") if tuned_for is not None else None
            if own is not None:  # the timing job's own prediction (its compute, its link)
                row["predicted"].update(step_s=own["step_s"], warm_step_s=own["warm_step_s"])
            row.update(link=link, **_step_times(cfg, summary), sync_to_round=sync_to_round(cfg))
            timings.append(row)
            what = f"{link}: {row['step_time_s'] * 1e3:.1f} ms/step"
            if "warm_step_time_s" in row:
                what += f" ({row['warm_step_time_s'] * 1e3:.1f} warm)"
        note(f"[{i}/{len(jobs)}] {label} x{w} {what} ({took})")
    results = assemble(spec, runs, timings)
    results["command"] = command
    results["elapsed_s"] = time.perf_counter() - t_start
    write_report(results, spec.out)
    return results
