"""Convergence study: validation loss against inner steps for every outer-loop algorithm.

Every configuration trains the default GPT on the embedded corpus with the same number of
workers, steps, batch and seeds (so equal tokens), through ``lowcomm train``. The study reports
validation loss against steps (mean over seeds, with the spread), the steps each method needs
to reach a common target validation loss (the worst method's final loss, so every method can
reach it), and a plot.

Reproduce (about 30 minutes on 2 CPU cores with the defaults)::

    python benchmarks/convergence.py

which writes ``benchmarks/convergence.md`` and ``benchmarks/convergence.png`` (committed) and
keeps each run's folder under ``benchmarks/results/convergence/`` (not committed). Rerunning
skips runs whose ``summary.json`` exists; ``--fresh`` reruns everything.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Method:
    label: str
    args: tuple[str, ...]


def methods(fragments: int, overlaps: list[int]) -> list[Method]:
    out = [
        Method("DDP", ("--algo", "ddp")),
        Method("DiLoCo", ("--algo", "diloco")),
        Method("CO2", ("--algo", "co2")),
        Method("CO2 eager", ("--algo", "co2-eager")),
    ]
    for tau in overlaps:
        frag = ("--num-fragments", str(fragments), "--overlap", str(tau))
        out.append(Method(f"Streaming DiLoCo τ={tau}", ("--algo", "streaming", *frag)))
        out.append(Method(f"CoCoDC τ={tau}", ("--algo", "cocodc", *frag)))
    return out


def slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("τ=", "tau")


def run(method: Method, seed: int, common: list[str], out: Path, fresh: bool) -> Path:
    folder = out / f"{slug(method.label)}-s{seed}"
    if (folder / "summary.json").exists() and not fresh:
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    cmd = [
        sys.executable,
        "-m",
        "lowcomm",
        "train",
        *method.args,
        *common,
        "--seed",
        str(seed),
        "--out",
        str(folder),
    ]
    print(f"[{time.strftime('%H:%M:%S')}] {method.label}, seed {seed}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return folder


def evals(folder: Path) -> list[tuple[int, float]]:
    points = []
    with open(folder / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "eval" and rec.get("val_loss") is not None:
                points.append((int(rec["step"]), float(rec["val_loss"])))
    return points


def steps_to(points: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, v in points if v <= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=480)
    ap.add_argument("--sync-every", type=int, default=12)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--overlaps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--eval-every", type=int, default=48)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "convergence")
    ap.add_argument("--report", type=Path, default=HERE / "convergence")
    ap.add_argument("--fresh", action="store_true")
    args = ap.parse_args()

    common = [
        "--workers",
        str(args.workers),
        "--steps",
        str(args.steps),
        "--sync-every",
        str(args.sync_every),
        "--eval-every",
        str(args.eval_every),
        "--overwrite",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[list[tuple[int, float]]]] = {}
    for method in methods(args.fragments, args.overlaps):
        results[method.label] = [
            evals(run(method, seed, common, args.out, args.fresh)) for seed in args.seeds
        ]

    def mean_curve(runs: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
        steps = [s for s, _ in runs[0]]
        curve = []
        for i, s in enumerate(steps):
            vals = [r[i][1] for r in runs if i < len(r)]
            curve.append((s, sum(vals) / len(vals), min(vals), max(vals)))
        return curve

    curves = {label: mean_curve(runs) for label, runs in results.items()}
    target = max(c[-1][1] for c in curves.values())
    rows = []
    for label, runs in results.items():
        finals = [r[-1][1] for r in runs]
        reach = [steps_to(r, target) for r in runs]
        mean_final = sum(finals) / len(finals)
        spread = max(finals) - min(finals)
        reached = [s for s in reach if s is not None]
        mean_reach = sum(reached) / len(reached) if len(reached) == len(reach) else math.nan
        rows.append((label, mean_final, spread, mean_reach, reach))

    lines = [
        f"Validation loss of the default GPT on the embedded corpus: {args.workers} workers, "
        f"{args.steps} inner steps each, sync every {args.sync_every} steps "
        f"({args.fragments} fragments for Streaming DiLoCo and CoCoDC), seeds "
        f"{', '.join(map(str, args.seeds))}; mean over seeds, spread = max − min. "
        f"Target for 'steps to target': {target:.3f} (the worst method's mean final loss); "
        "a mean is given only when every seed reached it.",
        "",
        "| method | final val loss | spread | steps to target (mean) | per seed (-: not reached) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, mean_final, spread, mean_reach, reach in sorted(rows, key=lambda r: r[1]):
        per_seed = ", ".join("-" if s is None else str(s) for s in reach)
        reach_txt = "-" if math.isnan(mean_reach) else f"{mean_reach:.0f}"
        lines.append(f"| {label} | {mean_final:.3f} | {spread:.3f} | {reach_txt} | {per_seed} |")
    args.report.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, curve in curves.items():
        steps = [c[0] for c in curve]
        line = ax.plot(steps, [c[1] for c in curve], label=label, linewidth=1.4)[0]
        ax.fill_between(
            steps, [c[2] for c in curve], [c[3] for c in curve], color=line.get_color(), alpha=0.15
        )
    ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("inner step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title(f"{args.workers} workers, equal tokens; band = min–max over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(args.report.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
