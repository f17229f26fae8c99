"""Reports of ``lowcomm simulate``: the projection, paper and calibration tables as Markdown, the
JSON record and the plot, and :func:`run_simulate`, which computes them all and writes them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lowcomm.bench.simulate.calibration import CalibrationRow, calibrate
from lowcomm.bench.simulate.model import Projection, Scenario, project
from lowcomm.bench.simulate.paper import PaperComparison, compare_with_paper, paper_implications
from lowcomm.schedules import FRAGMENTS, ONE_ROUND_STALE

__all__ = [
    "SimulateReport",
    "format_calibration_table",
    "format_markdown",
    "format_paper_table",
    "format_projection_table",
    "run_simulate",
]

logger = logging.getLogger(__name__)


@dataclass
class SimulateReport:
    """What :func:`run_simulate` computed and wrote."""

    scenario: Scenario
    projections: list[Projection]
    paper: list[PaperComparison] = field(default_factory=list)
    implications: list[str] = field(default_factory=list)
    calibration: list[CalibrationRow] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        s = self.scenario
        return {
            "version": 1,
            "kind": "projection (lowcomm simulate), not a measurement",
            "scenario": {
                "name": s.name,
                "unit": s.unit,
                "workload": {**asdict(s.workload), "payload": s.workload.payload},
                "network": asdict(s.network),
                "algorithms": [{**asdict(a), "label": a.label} for a in s.algorithms],
                "workers": list(s.workers),
                "scalability_base": s.scalability_base,
                "notes": list(s.notes),
                "sources": list(s.sources),
            },
            "projections": [asdict(r) for r in self.projections],
            "paper": [asdict(r) for r in self.paper],
            "paper_implications": list(self.implications),
            "calibration": [asdict(r) for r in self.calibration],
        }


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_projection_table(report: SimulateReport) -> str:
    s = report.scenario
    base = s.scalability_base
    header = [
        "algorithm", "N", "nodes", "step (s)", "compute (s)", "comm/step (s)",
        "exposed/step (s)", "hidden", f"{s.unit}/s", f"{s.unit}/s per worker",
        "scaling eff.",
    ]  # fmt: skip
    if base is not None:
        header.append(f"scal. ratio vs N={base}")
    rows = []
    for r in report.projections:
        row = [
            r.algo, str(r.workers), str(r.nodes), _num(r.step_time_s, 4), _num(r.compute_s, 4),
            _num(r.comm_per_step_s, 4), _num(r.exposed_per_step_s, 4),
            "-" if r.hidden_fraction is None else f"{r.hidden_fraction:.2f}",
            _num(r.tokens_per_s), _num(r.tokens_per_s_per_worker, 4),
            f"{r.scaling_efficiency:.3f}",
        ]  # fmt: skip
        if base is not None:
            row.append("-" if r.scalability_ratio is None else f"{r.scalability_ratio:.3f}")
        rows.append(row)
    return _table(header, rows)


def format_paper_table(report: SimulateReport) -> str:
    unit = report.scenario.unit
    names = {"tokens_per_s": f"{unit}/s", "scalability_ratio": "scalability ratio"}
    rows = []
    for c in report.paper:
        ratio_metric = c.metric == "scalability_ratio"

        def fmt(x: float, ratio_metric: bool = ratio_metric) -> str:
            return f"{x:.2f}" if ratio_metric else _num(x)

        rows.append(
            [
                c.algo,
                str(c.workers),
                names.get(c.metric, c.metric),
                fmt(c.paper),
                "-" if c.ours is None else fmt(c.ours),
                "-" if c.ratio is None else f"{c.ratio:.3f}",
                c.note,
            ]
        )
    return _table(["setting", "N", "metric", "paper", "ours", "ours/paper", "note"], rows)


def format_calibration_table(report: SimulateReport) -> str:
    rows = []
    for c in report.calibration:
        hidden = f"{_num(c.measured_hidden_fraction, 2)} / {_num(c.predicted_hidden_fraction, 2)}"
        rows.append(
            [
                c.algo, str(c.workers), c.link or "-", _num(c.compute_s, 4),
                _num(c.measured_step_s, 4), _num(c.predicted_step_s, 4),
                _num(c.measured_tokens_per_s), _num(c.predicted_tokens_per_s),
                f"{c.ratio:.3f}", hidden, c.note,
            ]
        )  # fmt: skip
    header = [
        "cell", "N", "link", "t_c (s)", "step measured (s)", "step predicted (s)",
        "tokens/s measured", "tokens/s predicted", "predicted/measured",
        "hidden measured / predicted", "note",
    ]  # fmt: skip
    return _table(header, rows)


def format_link_choices(s: Scenario) -> str:
    """A table of what :func:`lowcomm.tune.choose.choose_sync_settings` chooses for each tunable
    outer algorithm of ``s`` on its (slow) link, at its fewest workers above one (for a model of at
    least 4 transformer blocks: CO2's staggered rungs apply); ``""`` when none is tunable."""
    from lowcomm.tune.choose import LinkProfile, choose_sync_settings

    n = min((w for w in s.workers if w > 1), default=2)
    net = s.network
    link = LinkProfile(net.bandwidth_bps, net.latency_s, "given", net.cost == "emulated")
    rows = []
    for algo in s.algorithms:
        current: dict[str, Any] = {"compression": None, "overlap": algo.overlap or None}
        if algo.schedule is ONE_ROUND_STALE:
            current["overlap"] = algo.overlap or 1  # lowcomm train's CO2: one step stale
        if algo.schedule is FRAGMENTS:
            current["num_fragments"] = algo.num_fragments
        try:
            choice = choose_sync_settings(
                algo.name,
                link=link,
                workers=n,
                step_time_s=s.workload.step_time_s,
                shapes=[(int(s.workload.parameters),)],
                sync_every=algo.sync_every,
                current=current,
                max_fragments=4,  # a model of at least 4 transformer blocks
            )
        except ValueError:
            continue
        if "not tuned" in choice.reason:
            continue
        chosen = ", ".join(f"{k} {v}" for k, v in choice.settings.items()) or "the defaults"
        rows.append(
            [
                algo.label,
                chosen,
                f"{choice.sync_s:.3g}",
                f"{choice.compute_s / choice.step_s:.0%}",
                "yes" if choice.hidden else "no",
            ]
        )
    if not rows:
        return ""
    header = ["algorithm", f"chosen ({n} workers)", "round's syncs (s)", "of compute", "hidden"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def format_markdown(report: SimulateReport) -> str:
    """The report as Markdown: assumptions, projection, paper comparison, calibration."""
    s = report.scenario
    parts = [f"# lowcomm simulate: {s.name} (projection)", ""]
    parts += [f"- {n}" for n in s.notes]
    if s.sources:
        parts.append(f"- Sources: {', '.join(s.sources)}")
    parts += ["", "## Projection", "", format_projection_table(report), ""]
    choices = format_link_choices(s)
    if choices:
        parts += [
            "## Settings from the link",
            "",
            "What `lowcomm train --tune-link` would choose on this link (lowcomm.tune.choose), "
            "for the algorithms' settings not given:",
            "",
            choices,
            "",
        ]
    if report.paper:
        parts += ["## Paper vs ours", "", format_paper_table(report), ""]
    if report.implications:
        parts += ["### What the paper's figures imply", ""]
        parts += [f"- {line}" for line in report.implications]
        parts.append("")
    if report.calibration:
        parts += [
            "## Calibration on this machine",
            "",
            "Predicted (model, emulated link cost, measured compute time) against measured "
            "(lowcomm bench) per cell.",
            "",
            format_calibration_table(report),
            "",
        ]
    return "\n".join(parts)


def _plot(report: SimulateReport, path: str) -> None:
    # A bare Figure renders with Agg and leaves pyplot's global backend alone.
    from matplotlib.figure import Figure

    s = report.scenario
    fig = Figure(figsize=(12, 4.8))
    ax1, ax2 = fig.subplots(1, 2)
    styles = ("-", "--", ":", "-.")
    colors: dict[str, Any] = {}
    for i, label in enumerate(dict.fromkeys(r.algo for r in report.projections)):
        rows = [r for r in report.projections if r.algo == label]
        ns = [r.workers for r in rows]
        style = styles[i % len(styles)]
        (line,) = ax1.plot(ns, [r.tokens_per_s for r in rows], style, marker="o", ms=3, label=label)
        colors[label] = line.get_color()
        ax2.plot(
            ns, [r.scaling_efficiency for r in rows], style, marker="o", ms=3, color=colors[label]
        )
    seen: set[bool] = set()
    for f in s.paper:
        if f.metric != "tokens_per_s":
            continue
        name = "paper (reported)" if f.reported else "paper (implied)"
        ax1.scatter(
            [f.workers], [f.value], marker="x" if f.reported else "+", s=70,
            color=colors.get(f.algo, "black"), label=None if f.reported in seen else name,
            zorder=5,
        )  # fmt: skip
        seen.add(f.reported)
    n0 = min(r.workers for r in report.projections)
    for ax, ylabel, title in (
        (ax1, f"{s.unit}/s (all workers)", "throughput (projected)"),
        (ax2, f"scaling efficiency vs N={n0}", "scaling efficiency (projected)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers N")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.set_ylim(0, 1.05)
    fig.suptitle(f"lowcomm simulate: {s.name} (projection, not a measurement)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_simulate(
    scenario: Scenario,
    *,
    out: str,
    results: Mapping[str, Any] | None = None,
    results_source: str = "results",
) -> SimulateReport:
    """Project ``scenario``, compare with its paper figures and a bench results file, and write
    ``simulate.json``, ``simulate.md`` and ``simulate.png`` to ``out``."""
    rows = project(
        scenario.workload,
        scenario.network,
        scenario.algorithms,
        scenario.workers,
        scalability_base=scenario.scalability_base,
    )
    report = SimulateReport(scenario=scenario, projections=rows)
    if scenario.paper:
        report.paper = compare_with_paper(rows, scenario.paper)
        report.implications = paper_implications(scenario, rows)
    if results is not None:
        report.calibration = calibrate(results, source=results_source)
    os.makedirs(out, exist_ok=True)
    paths = {
        "json": os.path.join(out, "simulate.json"),
        "markdown": os.path.join(out, "simulate.md"),
        "plot": os.path.join(out, "simulate.png"),
    }
    report.paths = paths
    with open(paths["json"], "w", encoding="utf-8") as fh:
        json.dump(report.as_dict(), fh, indent=2, allow_nan=False)
        fh.write("\n")
    with open(paths["markdown"], "w", encoding="utf-8") as fh:
        fh.write(format_markdown(report))
    _plot(report, paths["plot"])
    logger.debug("lowcomm simulate: wrote %s", ", ".join(paths.values()))
    return report
