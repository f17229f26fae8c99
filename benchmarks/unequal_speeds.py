"""Workers of unequal speed: today's fixed rounds against dynamic local steps, side by side in one
run on this machine.

For each algorithm (CO2 and DiLoCo with the job's defaults) and each set of speeds (one worker of
four at half speed; two speeds, 1 and 0.5, drawn at random per worker), three ``lowcomm train``
jobs of 4 workers: every worker at full speed (the reference), the speeds emulated with fixed
rounds of H steps (the slowest sets every round's pace), and the same speeds with
``--local-steps dynamic``. A slower worker is emulated by ``--speeds``: each of its inner steps
is followed by computing (a busy loop) for (1/speed - 1) times the step's own time, and every
job waits for its collectives by polling (``--busy-wait``), so that four workers on this
machine's two cores keep their shares of it as four devices would.

The goal: the dynamic job's tokens/s at least 90% of what the workers' speeds allow (the
equal-speed job's tokens/s x sum(speeds) / 4, from the same run), and its final validation loss
(at the tokens of the equal-speed job, or up to one round more) within 2% of the equal-speed
job's.

Reproduce (about 30 minutes on 2 cores; ``--steps`` shortens it)::

    python benchmarks/unequal_speeds.py [--steps 480] [--seed 0]

It prints markdown and writes ``benchmarks/unequal_speeds.md`` (``unequal_speeds_seedN.md`` for
another seed); run folders go to ``benchmarks/results/speeds/`` (``speeds-seedN``; not
committed).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "speeds"
WORKERS = 4


def speed_sets(seed: int) -> dict[str, list[float]]:
    """The speeds measured: one worker at half speed; 1 or 0.5 drawn per worker (seeded; a
    draw of four equal speeds, or of the first set, is drawn again)."""
    rng = random.Random(seed)
    half = [1.0, 1.0, 1.0, 0.5]
    drawn = [1.0] * WORKERS
    while len(set(drawn)) == 1 or drawn == half:
        drawn = [rng.choice([1.0, 0.5]) for _ in range(WORKERS)]
    return {"one at half speed": half, "drawn at random": drawn}


def _out(seed: int) -> Path:
    """Run folders of ``seed`` (seed 0: results/speeds, else results/speeds-seedN)."""
    return OUT if seed == 0 else OUT.with_name(f"speeds-seed{seed}")


def run_job(
    name: str, algo: str, steps: int, seed: int, extra: list[str], *, run: bool = True
) -> dict[str, Any]:
    """``lowcomm train`` of 4 workers into ``results/speeds/NAME`` and its summary (``run``
    False: the summary of the run already there)."""
    out = _out(seed) / name
    cmd = [
        sys.executable, "-m", "lowcomm", "train", "--algo", algo, "--workers", str(WORKERS),
        "--steps", str(steps), "--seed", str(seed), "--busy-wait", "--quiet", "--overwrite",
        "--out", str(out), *extra,
    ]  # fmt: skip
    if run:
        print("$", " ".join(cmd[2:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out / "summary.json", encoding="utf-8") as f:
        summary: dict[str, Any] = json.load(f)
    return summary


def _per_round(summary: dict[str, Any]) -> list[float]:
    """Each worker's mean inner steps per round over the whole job (warm start included)."""
    positions = summary.get("steps_run") or summary["steps"]
    h = summary["sync_every"]
    return [n * h / positions for n in summary["work"]["inner_steps"]]


def over_seeds(seeds: list[int]) -> str:
    """A markdown table of the dynamic and fixed rows of every seed's ``results.json``, side by
    side, with their mean (the speeds drawn at random differ per seed)."""
    runs = {seed: json.loads((_out(seed) / "results.json").read_text()) for seed in seeds}
    groups: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for seed, results in runs.items():
        for r in results["rows"]:
            if r["speeds"] == "1,1,1,1":
                continue
            kind = "one at half speed" if r["speeds"] == "1,1,1,0.5" else "drawn at random"
            groups.setdefault((r["algo"], kind, r["rounds"]), {})[seed] = r
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| algo | speeds | rounds | of what the speeds allow: {head} | mean | val vs equal "
        f"speeds: {head} | mean |",
        "|---|---|---|" + "---|" * (2 * len(seeds) + 2),
    ]
    for (algo, kind, rounds), by_seed in groups.items():
        rows = [by_seed[s] for s in seeds if s in by_seed]
        allowed = [f"{r['of_allowed']:.1%}" for r in rows]
        val = [f"{r['val_vs_equal']:+.1%}" for r in rows]
        mean_a = sum(r["of_allowed"] for r in rows) / len(rows)
        mean_v = sum(r["val_vs_equal"] for r in rows) / len(rows)
        lines.append(
            f"| {algo} | {kind} | {rounds} | {' | '.join(allowed)} | {mean_a:.1%} | "
            f"{' | '.join(val)} | {mean_v:+.1%} |"
        )
    drawn = ", ".join(
        f"seed {s}: " + ",".join(f"{v:g}" for v in speed_sets(s)["drawn at random"]) for s in seeds
    )
    return "\n".join(lines) + f"\n\nSpeeds drawn at random: {drawn}.\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algos", default="co2,diloco")
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild the table from the run folders"
    )
    parser.add_argument(
        "--over-seeds",
        metavar="S,S",
        help="print the table of these seeds' runs side by side (after running each)",
    )
    args = parser.parse_args(argv)
    if args.over_seeds:
        text = over_seeds([int(v) for v in args.over_seeds.split(",")])
        print(text)
        (HERE / "unequal_speeds_seeds.md").write_text(text)
        return 0
    run = not args.report_only
    _out(args.seed).mkdir(parents=True, exist_ok=True)
    rows = []
    results: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "runs": {}}
    for algo in args.algos.split(","):
        equal = run_job(f"{algo}-equal", algo, args.steps, args.seed, [], run=run)
        results["runs"][f"{algo}-equal"] = equal
        for label, speeds in speed_sets(args.seed).items():
            flag = ["--speeds", ",".join(f"{s:g}" for s in speeds)]
            tag = "half" if label.startswith("one") else "random"
            fixed = run_job(f"{algo}-{tag}-fixed", algo, args.steps, args.seed, flag, run=run)
            dynamic = run_job(
                f"{algo}-{tag}-dynamic",
                algo,
                args.steps,
                args.seed,
                [*flag, "--local-steps", "dynamic"],
                run=run,
            )
            results["runs"][f"{algo}-{tag}-fixed"] = fixed
            results["runs"][f"{algo}-{tag}-dynamic"] = dynamic
            allowed = equal["tokens_per_s"] * sum(speeds) / WORKERS
            for mode, s in (("fixed", fixed), ("dynamic", dynamic)):
                work = s["work"]
                rows.append(
                    {
                        "algo": algo,
                        "speeds": ",".join(f"{v:g}" for v in speeds),
                        "rounds": mode,
                        "tokens_per_s": s["tokens_per_s"],
                        "of_allowed": s["tokens_per_s"] / allowed,
                        "tokens": s["tokens"],
                        "val": s["val_loss_final"],
                        "val_vs_equal": s["val_loss_final"] / equal["val_loss_final"] - 1,
                        "steps_per_round": _per_round(s),
                        "blocked_s": work["blocked_s"],
                    }
                )
        rows.append(
            {
                "algo": algo,
                "speeds": "1,1,1,1",
                "rounds": "fixed",
                "tokens_per_s": equal["tokens_per_s"],
                "of_allowed": 1.0,
                "tokens": equal["tokens"],
                "val": equal["val_loss_final"],
                "val_vs_equal": 0.0,
                "steps_per_round": _per_round(equal),
                "blocked_s": equal["work"]["blocked_s"],
            }
        )
    results["rows"] = rows
    (_out(args.seed) / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [
        f"4 workers, {args.steps} steps each at equal speeds (the dynamic jobs run until the "
        f"workers together took as many tokens), seed {args.seed}, `--busy-wait`, this "
        "machine (2 cores); `python benchmarks/unequal_speeds.py`",
        "",
        "| algo | speeds | rounds | tokens/s | of what the speeds allow | val loss | vs equal "
        "speeds | steps / round per worker | blocked s per worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_round = "/".join("-" if n is None else f"{n:.1f}" for n in r["steps_per_round"])
        blocked = "/".join(f"{b:.0f}" for b in r["blocked_s"])
        lines.append(
            f"| {r['algo']} | {r['speeds']} | {r['rounds']} | {r['tokens_per_s']:,.0f} | "
            f"{r['of_allowed']:.1%} | {r['val']:.3f} | {r['val_vs_equal']:+.1%} | "
            f"{per_round} | {blocked} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = "" if args.seed == 0 else f"_seed{args.seed}"
    (HERE / f"unequal_speeds{suffix}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
