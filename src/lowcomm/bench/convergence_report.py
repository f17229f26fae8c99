"""The results of ``lowcomm bench --convergence``: per (length, worker count, algorithm) the
final validation loss over seeds and its gap to DDP's, the steps, tokens and wall time on each
link to DDP's final mean loss, the goals each run is checked against; ``convergence.md``,
``loss_vs_tokens.png`` and ``loss_vs_time.png``.

Example::

    results = assemble(spec, runs, timings)
    [(g["goal"], g["met"]) for g in results["goals"]]
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lowcomm.bench.report import fmt, pyplot, table
from lowcomm.bench.results import interpolate_time_to_target
from lowcomm.registry import REGISTRY
from lowcomm.runfiles import json_safe, write_text
from lowcomm.schedules import BLOCKING

if TYPE_CHECKING:
    from lowcomm.bench.convergence_spec import ConvergenceSpec

__all__ = ["assemble", "equal_time", "format_markdown", "steps_within", "wall_time", "write_report"]

GAP_GOALS = {"diloco": 0.02, "streaming": 0.02, "cocodc": 0.02, "co2": 0.03}
"""Largest gap to DDP's validation loss at equal tokens each algorithm's defaults must meet."""


def _mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """``[tokens, step, mean val_loss]`` at the evaluations every seed has."""
    steps = set.intersection(*({int(p[1]) for p in c} for c in curves))
    out = []
    for step in sorted(steps):
        points = [next(p for p in c if int(p[1]) == step) for c in curves]
        out.append([points[0][0], step, statistics.fmean(p[2] for p in points)])
    return out


def wall_time(cell: dict[str, Any], link: str, steps: float) -> float:
    """Training time of ``steps`` steps of ``cell`` on ``link``: its warm-start steps (the
    first ``warm_steps``) at their own measured step time, the rest at the cell's."""
    k = min(float(cell.get("warm_steps", 0)), steps)
    warm = cell.get("warm_step_time_s", {}).get(link, 0.0)
    return k * warm + (steps - k) * cell["step_time_s"][link]


def steps_within(cell: dict[str, Any], link: str, seconds: float) -> float:
    """The steps of ``cell`` trained in ``seconds`` on ``link`` (the inverse of
    :func:`wall_time`), at most the cell's own."""
    k = min(float(cell.get("warm_steps", 0)), float(cell["steps"]))
    warm = cell.get("warm_step_time_s", {}).get(link, 0.0)
    if warm > 0 and k * warm >= seconds:
        return seconds / warm
    steps = k + (seconds - k * warm) / cell["step_time_s"][link]
    return min(steps, float(cell["steps"]))


def _loss_at(curve: Sequence[Sequence[float]], step: float) -> float | None:
    """The validation loss at ``step``, linear between evaluations (``None`` before the first)."""
    previous: Sequence[float] | None = None
    for point in curve:
        if point[1] >= step:
            if previous is None:
                return float(point[2]) if point[1] == step else None
            frac = (step - previous[1]) / (point[1] - previous[1])
            return float(previous[2] + frac * (point[2] - previous[2]))
        previous = point
    return None if previous is None else float(previous[2])


def equal_time(cells: list[dict[str, Any]]) -> None:
    """Sets each cell's ``equal_time``: per link it was timed on, the loss it had reached in
    the time the fastest cell of its length and worker count (timed on that link) took for its
    whole job: ``{link: {"seconds", "steps", "val_loss"}}``. The fastest ends at its final
    loss; a slower one is read off its curve where it stood then."""
    for c in cells:
        c["equal_time"] = {}
        group = [g for g in cells if (g["length"], g["workers"]) == (c["length"], c["workers"])]
        for link in c["step_time_s"]:
            budget = min(wall_time(g, link, g["steps"]) for g in group if link in g["step_time_s"])
            steps = steps_within(c, link, budget)
            c["equal_time"][link] = {
                "seconds": budget,
                "steps": steps,
                "val_loss": _loss_at(c["curve"], steps),
            }


def _cell(
    runs: list[dict[str, Any]], timings: dict[str, float], warm: dict[str, float]
) -> dict[str, Any]:
    finals = [r["val_loss_final"] for r in runs]
    first = runs[0]
    wire = [r["wire_bytes"] for r in runs if r.get("wire_bytes") is not None]
    return {
        "algo": first["algo"],
        "base": first["base"],
        "workers": first["workers"],
        "length": first["length"],
        "steps": first["steps"],
        "tokens": first["tokens"],
        "tokens_per_step": first["tokens"] // first["steps"],
        # a worker's bytes on the wire per token it trained (None: not recorded)
        "wire_bytes_per_token": (
            statistics.fmean(wire) / (first["tokens"] / first["workers"]) if wire else None
        ),
        "seeds": [r["seed"] for r in runs],
        "val_loss_final": finals,
        "val_loss_mean": statistics.fmean(finals),
        "val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "curve": _mean_curve([r["curve"] for r in runs]),
        "step_time_s": dict(timings),
        "warm_steps": first.get("warm_steps", 0),
        "warm_step_time_s": dict(warm),
        # a cell tuned for its link: its entry, the link, what was chosen and predicted
        **{k: first[k] for k in ("entry", "tuned_for", "chosen", "predicted") if k in first},
    }


def assemble(
    spec: ConvergenceSpec, runs: list[dict[str, Any]], timings: list[dict[str, Any]]
) -> dict[str, Any]:
    """``results.json``: the cells (seeds merged), their gaps and times to DDP's final mean
    loss (``target``, per length and worker count), and the goals. ``runs`` are the loss jobs
    (``algo`` as given, ``base`` its ``--algo`` name, ``workers``, ``seed``, ``length``,
    ``steps``, ``tokens``, ``curve``, ``val_loss_final``); ``timings`` the timing jobs
    (``algo``, ``workers``, ``link``, ``step_time_s``)."""
    step_times: dict[tuple[str, int], dict[str, float]] = {}
    warm_times: dict[tuple[str, int], dict[str, float]] = {}
    ratios: dict[tuple[str, int], dict[str, float | None]] = {}
    for t in timings:
        step_times.setdefault((t["algo"], t["workers"]), {})[t["link"]] = t["step_time_s"]
        ratios.setdefault((t["algo"], t["workers"]), {})[t["link"]] = t.get("sync_to_round")
        if "warm_step_time_s" in t:
            warm_times.setdefault((t["algo"], t["workers"]), {})[t["link"]] = t["warm_step_time_s"]
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["length"], r["workers"], r["algo"]), []).append(r)
    cells = [
        _cell(rs, step_times.get((a, w), {}), warm_times.get((a, w), {}))
        for (_, w, a), rs in groups.items()
    ]
    for c in cells:
        c["sync_to_round"] = dict(ratios.get((c["algo"], c["workers"]), {}))
        for t in timings:
            if (t["algo"], t["workers"], t.get("link")) == (
                c["algo"],
                c["workers"],
                c.get("tuned_for"),
            ):
                # the timing job's own prediction, from its start-up (the loss job's is of
                # another process on a machine perhaps busier or quieter)
                c["predicted"] = {**c.get("predicted", {}), **t.get("predicted", {})}
    bases = {r["algo"]: r["base"] for r in runs}
    reference = next((a for a in spec.algos if bases.get(a) == "ddp"), None)
    for c in cells:
        ddp = _find(cells, reference, c["workers"], c["length"]) if reference else None
        c["target"] = None if ddp is None else ddp["val_loss_mean"]
        mine, theirs = (
            c["wire_bytes_per_token"],
            None if ddp is None else ddp["wire_bytes_per_token"],
        )
        c["fewer_bytes_than_ddp"] = None if not (mine and theirs) else theirs / mine
        c["gap"] = None if ddp is None else c["val_loss_mean"] / ddp["val_loss_mean"] - 1
        steps = None
        if c["target"] is not None:
            steps = interpolate_time_to_target(c["curve"], c["target"])
        c["steps_to_target"] = steps
        c["tokens_to_target"] = None if steps is None else steps * c["tokens_per_step"]
        c["time_to_target_s"] = {
            link: None if steps is None else wall_time(c, link, steps) for link in c["step_time_s"]
        }
    equal_time(cells)
    tuned = tuned_against_untuned(cells)
    return {
        "kind": "convergence",
        "reference": reference,
        "tuned": tuned,
        "settings": {
            "algos": spec.algos,
            "workers": spec.workers,
            "seeds": spec.seeds,
            "lengths": spec.lengths,
            "links": spec.links,
            "timing_steps": spec.timing_steps,
            "train_overrides": spec.train_overrides,
        },
        "cells": cells,
        "goals": goals(cells, reference) + tuned_goals(tuned),
    }


TUNED_GAP = 0.02
"""A cell tuned for its link ends within this share of its untuned entry's loss per token (or
below it)."""
PREDICTION_TOLERANCE = 0.15
"""The tuner's predicted step times are within this share of the steps the job then took."""


def _untuned(cells: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, Any] | None:
    """The untuned entry of tuned cell ``c``: its entry's settings with ``tune_link=off``."""
    from lowcomm.bench.variants import algo_fields

    want = {**algo_fields(c["entry"]), "tune_link": "off"}
    for u in cells:
        if "tuned_for" in u or (u["workers"], u["length"]) != (c["workers"], c["length"]):
            continue
        if algo_fields(u["algo"]) == want:
            return u
    return None


def tuned_against_untuned(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell tuned for its link against its untuned entry (where the run has it): the loss
    at equal tokens against the untuned job's (``gap``), the time each takes on the link to
    the untuned job's final mean loss (the untuned job's own first reaching it), and the
    tuner's predicted step times beside those the timing job measured."""
    out = []
    for c in cells:
        link = c.get("tuned_for")
        if link is None:
            continue
        u = _untuned(cells, c)
        row: dict[str, Any] = {
            "cell": c["algo"],
            "entry": c["entry"],
            "link": link,
            "workers": c["workers"],
            "length": c["length"],
            "chosen": c.get("chosen", {}),
            "expected_cost": (c.get("predicted") or {}).get("cost"),
            "untuned": None if u is None else u["algo"],
        }
        predicted = c.get("predicted") or {}
        measured = {
            "step_s": c["step_time_s"].get(link),
            "warm_step_s": c["warm_step_time_s"].get(link),
        }
        row["step_s"] = {"predicted": predicted.get("step_s"), "measured": measured["step_s"]}
        row["warm_step_s"] = {
            "predicted": predicted.get("warm_step_s") if c.get("warm_steps") else None,
            "measured": measured["warm_step_s"],
        }
        if u is not None:
            target = u["val_loss_mean"]
            row["gap"] = c["val_loss_mean"] / target - 1
            steps_c = interpolate_time_to_target(c["curve"], target)
            steps_u = interpolate_time_to_target(u["curve"], target)
            row["time_to_untuned_loss_s"] = (
                None
                if steps_c is None or link not in c["step_time_s"]
                else wall_time(c, link, steps_c)
            )
            row["untuned_time_s"] = (
                None
                if steps_u is None or link not in u["step_time_s"]
                else wall_time(u, link, steps_u)
            )
        out.append(row)
    return out


def _within(predicted: float | None, measured: float | None) -> bool | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return abs(predicted / measured - 1) <= PREDICTION_TOLERANCE


def tuned_goals(tuned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tuned cell: within :data:`TUNED_GAP` of its untuned entry per token and no later to
    the untuned job's final loss; its predicted step times within
    :data:`PREDICTION_TOLERANCE` of the measured ones (warm start included)."""
    out = []
    for t in tuned:
        if t.get("untuned") is not None:
            gap = t.get("gap")
            mine, theirs = t.get("time_to_untuned_loss_s"), t.get("untuned_time_s")
            sooner = None if theirs is None else mine is not None and mine <= theirs
            met = None if gap is None or sooner is None else gap <= TUNED_GAP and sooner
            goal = (
                f"{t['cell']}, {t['workers']} workers: within {TUNED_GAP:.0%} of "
                f"{t['untuned']} per token and at its final loss no later"
            )
            out.append(_goal(goal, gap, "+.1%", met))
        for what in ("step_s", "warm_step_s"):
            pair = t[what]
            ok = _within(pair["predicted"], pair["measured"])
            if ok is None:
                continue
            ratio = pair["predicted"] / pair["measured"]
            name = "step" if what == "step_s" else "warm step"
            goal = (
                f"{t['cell']}, {t['workers']} workers: predicted {name} within "
                f"{PREDICTION_TOLERANCE:.0%} of the measured"
            )
            out.append(_goal(goal, ratio, ".2f", ok))
    return out


def _find(
    cells: list[dict[str, Any]], algo: str, workers: int, length: int = 1, link: str | None = None
) -> dict[str, Any] | None:
    """The cell of entry ``algo``; where the run has the entry tuned per link, its cell for
    ``link`` (a goal on that link), else its untuned entry (``algo/tune_link=off``), else its
    first tuned cell."""

    def named(name: str) -> dict[str, Any] | None:
        wanted = (name, workers, length)
        return next((c for c in cells if (c["algo"], c["workers"], c["length"]) == wanted), None)

    found = named(algo)
    if found is None and link is not None:
        found = named(f"{algo}@{link}")
    if found is None:
        found = named(f"{algo}/tune_link=off")
    if found is None:
        found = next(
            (
                c
                for c in cells
                if c.get("entry") == algo and (c["workers"], c["length"]) == (workers, length)
            ),
            None,
        )
    return found


def _time(cell: dict[str, Any] | None, link: str) -> float | None:
    if cell is None or link not in cell["time_to_target_s"]:
        return None
    t = cell["time_to_target_s"][link]
    return float("inf") if t is None else t


def _goal(goal: str, value: float | None, spec: str, met: bool | None) -> dict[str, Any]:
    return {"goal": goal, "value": value, "format": spec, "met": met}


def goals(cells: list[dict[str, Any]], reference: str | None) -> list[dict[str, Any]]:
    """The convergence goals, each ``met`` True/False (None: not measured in this run)."""
    out: list[dict[str, Any]] = []
    workers = sorted({c["workers"] for c in cells if c["length"] == 1})
    for algo, limit in GAP_GOALS.items():
        for w in workers:
            c = _find(cells, algo, w)
            gap = None if c is None else c["gap"]
            met = None if gap is None else gap <= limit
            goal = f"{algo}, {w} workers: within {limit:.0%} of DDP's loss, equal tokens"
            out.append(_goal(goal, gap, "+.1%", met))
    co2, ddp = _find(cells, "co2", 2, link="100mbit"), _find(cells, reference or "ddp", 2)
    fast, slow_ddp = _time(co2, "100mbit"), _time(ddp, "100mbit")
    speedup = None if fast is None or slow_ddp is None or fast == 0 else slow_ddp / fast
    met = None if speedup is None else speedup >= 3
    out.append(
        _goal(
            "co2, 2 workers, 100mbit: DDP's final loss >= 3x sooner than DDP", speedup, ".2f", met
        )
    )
    blocking: list[float] = []
    for c in cells:
        schedule = REGISTRY[c["base"]].schedule
        t = _time(c, "100mbit")
        if (c["workers"], c["length"]) == (2, 1) and schedule is BLOCKING and t is not None:
            blocking.append(t)
    value = None if fast is None or not blocking else min(blocking) / fast
    met = None if fast is None or not blocking else fast < min(blocking)
    out.append(
        _goal("co2, 2 workers, 100mbit: sooner than every blocking algorithm", value, ".2f", met)
    )
    co2 = _find(cells, "co2", 2, link="1gbit")
    fast, slow_ddp = _time(co2, "1gbit"), _time(ddp, "1gbit")
    ratio = None if fast is None or slow_ddp is None or fast == 0 else slow_ddp / fast
    met = None if ratio is None else ratio >= 1
    out.append(
        _goal("co2, 2 workers, 1gbit: not slower than DDP to DDP's final loss", ratio, ".2f", met)
    )
    return out


def format_markdown(results: dict[str, Any]) -> str:
    """The report: one table per (length, worker count), the goals, the command."""
    cells = results["cells"]
    links = list(results["settings"]["links"])
    lines = ["# Convergence: time to DDP's loss", ""]
    for length, w in sorted({(c["length"], c["workers"]) for c in cells}):
        group = [c for c in cells if (c["length"], c["workers"]) == (length, w)]
        target = group[0]["target"]
        lines += [
            f"## {w} workers, {group[0]['steps']} steps ({length}x), target "
            f"{fmt(target, '.3f')} (DDP's final mean loss)",
            "",
        ]
        header = ["algo", "val loss (mean ± std)", "vs DDP", "bytes/token, × fewer than DDP"]
        header += ["tokens to target"]
        header += [f"time to target, {link} (s)" for link in links]
        header += [f"ms/step, {link}" for link in links]
        header += [f"sync / round, {link}" for link in links]
        rows = []
        for c in group:
            row = [
                c["algo"],
                f"{c['val_loss_mean']:.3f} ± {c['val_loss_std']:.3f}",
                fmt(c["gap"], "+.1%"),
                _bytes(c),
                fmt(c["tokens_to_target"], ",.0f", "not reached"),
            ]
            for link in links:
                t = c["time_to_target_s"].get(link)
                row.append(fmt(t, ".1f", "not reached" if c["step_time_s"].get(link) else "-"))
            for link in links:
                step = c["step_time_s"].get(link)
                ms = fmt(None if step is None else step * 1e3, ".0f")
                warm = c["warm_step_time_s"].get(link)
                row.append(ms if warm is None else f"{ms}; {warm * 1e3:.0f} warm")
            for link in links:
                row.append(fmt(c.get("sync_to_round", {}).get(link), ".2f"))
            rows.append(row)
        lines += [*table(header, rows), ""]
        lines += _equal_time_table(group, links)
    tuned = results.get("tuned") or []
    if tuned:
        lines += ["## Tuned for the link against untuned", ""]
        header = ["cell", "chosen", "expected per token", "vs untuned per token"]
        header += ["time to the untuned loss, tuned / untuned (s)", "ms a step, predicted / run"]
        header += ["ms a warm step, predicted / run"]
        rows = []
        for t in tuned:

            def pair(p: dict[str, Any]) -> str:
                if p["predicted"] is None and p["measured"] is None:
                    return "-"
                return (
                    f"{fmt(None if p['predicted'] is None else p['predicted'] * 1e3, '.0f')} / "
                    f"{fmt(None if p['measured'] is None else p['measured'] * 1e3, '.0f')}"
                )

            chosen = ", ".join(f"{k} {v}" for k, v in t["chosen"].items()) or "the defaults"
            times = "-"
            if t.get("untuned") is not None:
                mine = fmt(t.get("time_to_untuned_loss_s"), ".1f", "not reached")
                times = f"{mine} / {fmt(t.get('untuned_time_s'), '.1f', 'not reached')}"
            rows.append(
                [
                    f"{t['cell']} x{t['workers']}",
                    chosen,
                    fmt(t.get("expected_cost"), "+.1%"),
                    fmt(t.get("gap"), "+.1%"),
                    times,
                    pair(t["step_s"]),
                    pair(t["warm_step_s"]),
                ]
            )
        lines += [*table(header, rows), ""]
    lines += ["## Goals", ""]
    rows = [
        [g["goal"], fmt(g["value"], g["format"]), {True: "met", False: "missed"}.get(g["met"], "-")]
        for g in results["goals"]
    ]
    lines += [*table(["goal", "value", ""], rows), ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    if results.get("elapsed_s") is not None:
        lines += [f"Elapsed: {results['elapsed_s'] / 60:.1f} min", ""]
    return "\n".join(lines)


def _bytes(cell: dict[str, Any]) -> str:
    """A worker's wire bytes per token, and how many times fewer than DDP's."""
    per = cell.get("wire_bytes_per_token")
    if per is None:
        return "-"
    fewer = cell.get("fewer_bytes_than_ddp")
    return fmt(per, ",.1f") + ("" if fewer is None else f", {fewer:,.0f}×")


def _equal_time_table(group: list[dict[str, Any]], links: list[str]) -> list[str]:
    """Each cell's loss at the time the fastest of ``group`` took on each link, and the steps
    it had trained by then."""
    timed = [link for link in links if any(link in c.get("equal_time", {}) for c in group)]
    if not timed:
        return []
    budgets = {}
    for link in timed:
        budgets[link] = next(
            c["equal_time"][link]["seconds"] for c in group if link in c["equal_time"]
        )
    header = ["algo"] + [f"val loss at {budgets[link]:.0f} s, {link} (steps)" for link in timed]
    rows = []
    for c in group:
        row = [c["algo"]]
        for link in timed:
            at = c.get("equal_time", {}).get(link)
            if at is None:
                row.append("-")
                continue
            loss = fmt(at["val_loss"], ".3f", "not evaluated yet")
            row.append(f"{loss} ({at['steps']:.0f})")
        rows.append(row)
    return [
        "Equal time: the loss each had reached when the fastest had finished.",
        "",
        *table(header, rows),
        "",
    ]


def write_report(results: dict[str, Any], out: str) -> list[str]:
    """``results.json``, ``convergence.md`` and the two plots in ``out``; returns their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, n) for n in ("results.json", "convergence.md")]
    write_text(paths[0], json.dumps(json_safe(results), indent=1) + "\n")
    write_text(paths[1], format_markdown(results))
    paths.append(_plot(results, os.path.join(out, "loss_vs_tokens.png"), None))
    paths.append(_plot(results, os.path.join(out, "loss_vs_time.png"), "time"))
    return paths


def _plot(results: dict[str, Any], path: str, x: str | None) -> str:
    """Mean validation loss of the shortest jobs run (1x, unless only longer ones were) against
    tokens per worker, one panel per worker count; or (``x="time"``) against wall time, one
    panel per link, at the fewest workers."""
    plt = pyplot()
    shortest = min((c["length"] for c in results["cells"]), default=1)
    cells = [c for c in results["cells"] if c["length"] == shortest]
    worker_counts = sorted({c["workers"] for c in cells})
    panels: list[Any] = worker_counts if x is None else list(results["settings"]["links"])
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        w = panel if x is None else worker_counts[0]
        for c in (c for c in cells if c["workers"] == w):
            curve = c["curve"]
            if x is None:
                xs = [p[0] / w for p in curve]
            elif panel in c["step_time_s"]:
                xs = [wall_time(c, panel, p[1]) for p in curve]
            else:
                continue
            ax.plot(xs, [p[2] for p in curve], marker=".", label=c["algo"])
        target = next((c["target"] for c in cells if c["workers"] == w), None)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        title = f"{w} workers" if x is None else f"{panel} (emulated), {w} workers"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("tokens per worker" if x is None else "training time (s)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("validation loss (mean over seeds)")
    if axes[0][0].get_legend_handles_labels()[0]:  # a panel with no timed curve has none
        axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
