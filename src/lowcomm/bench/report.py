"""Write a ``lowcomm bench`` run's results: ``results.json`` (everything, see
:func:`lowcomm.bench.run_bench`), ``results.md`` (the tables) and two plots,
``throughput.png`` (tokens/s against link bandwidth, the ceiling as a line) and
``loss_vs_time.png`` (validation loss against training time, a panel per link)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

from lowcomm.train.metrics import json_safe, write_text

__all__ = ["fmt", "format_markdown", "pyplot", "table", "write_report"]

_FILES = ("results.json", "results.md", "throughput.png", "loss_vs_time.png")


def write_report(results: dict[str, Any], out: str) -> list[str]:
    """Write the four files to ``out`` (atomically each: a temporary file, then a rename);
    return their paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    path = os.path.join(out, "results.json")
    write_text(path, json.dumps(json_safe(results), indent=1) + "\n")
    paths.append(path)
    path = os.path.join(out, "results.md")
    write_text(path, format_markdown(results))
    paths.append(path)
    paths.append(plot_throughput(results, os.path.join(out, "throughput.png")))
    paths.append(plot_loss_vs_time(results, os.path.join(out, "loss_vs_time.png")))
    return paths


def fmt(value: Any, spec: str, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def _mb(value: Any) -> str:
    return fmt(None if value is None else value / 1e6, ".3f")


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _link_label(row: dict[str, Any]) -> str:
    return f"{row['link']} ({row['shaping']})"


def format_markdown(results: dict[str, Any]) -> str:
    """The report as Markdown: settings, ceiling and noise, the matrix table, the emulator
    validation pairs, the overhead micro-benchmark and the goals."""
    s = results["settings"]
    lines = ["# lowcomm bench" + (" --quick" if results.get("quick") else ""), ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    m = results["machine"]
    lines += [
        f"Run {results['created']} on {m['cpu_count']} CPU cores, torch {m['torch']}; "
        f"{fmt(results.get('elapsed_s'), '.0f')} s in all.",
        "",
        f"Every cell: GPT {s['n_layer']}x{s['n_embd']} "
        f"({fmt(results['model']['parameters'], ',')} parameters), {s['steps']} steps per "
        f"worker of {s['batch_size']}x{s['block_size']} tokens, seed {s['seed']}, "
        f"H = {s['sync_every']} (DDP: every step), data: {s['data']}. "
        "Tokens/s count training time only (evaluations excluded). "
        "Links are emulated unless marked real.",
        "",
    ]
    lines += [
        "**Ceiling**: every cell also times "
        f"{s['ceiling_steps']} inner steps with no synchronisation at all in the same worker "
        "processes, on a private copy of the model, in segments of a few steps interleaved with "
        "its training (the first before it, the last after it, the others spread over the run, "
        "each rank on its own; the slowest rank's time counts, as it does for the training); "
        "`x ceiling` divides the cell's tokens/s by its own ceiling, so the ratio holds even "
        "when the machine's speed drifts during a cell or between cells."
    ]
    for c in results["ceilings"]:
        lines.append(
            f"Median ceiling with {c['workers']} workers: {c['tokens_per_s']:,.0f} tokens/s over "
            f"{c['cells']} cells (they spread by {c['drift']:.0%} across the run)."
        )
    noise = results.get("noise")
    if noise is not None:
        lines += [
            "",
            f"**Noise**: a cell's ceiling, timed in short segments interleaved with its training, "
            f"is known to {noise:.1%} (the standard error of its mean over the segments; median "
            f"over cells, at most {results['noise_max']:.1%}); ratios are good to about that much.",
        ]
    target = results.get("target_loss")
    lines += [
        "",
        "## Throughput, traffic and loss",
        "",
        f"Time to target: training time until the validation loss first reaches "
        f"{fmt(target, '.3f')} (linear between evaluations).",
        "",
    ]
    header = [
        "algorithm",
        "workers",
        "link",
        "tokens/s",
        "x ceiling",
        "hidden",
        "blocked s (mean / most)",
        "MB/worker/step (payload)",
        "MB/worker/step (wire)",
        "val loss",
        "time to target (s)",
    ]
    rows = []
    for r in results["cells"]:
        if r["role"] != "matrix":
            continue
        rows.append(
            [
                r["algo"],
                str(r["workers"]),
                _link_label(r),
                fmt(r["tokens_per_s"], ",.0f"),
                fmt(r["ratio_to_ceiling"], ".1%"),
                fmt(r["hidden_fraction"], ".1%"),
                f"{fmt(r.get('blocked_s_per_worker'), '.1f')} / "
                f"{fmt(r.get('blocked_s_most'), '.1f')}",
                _mb(r["payload_bytes_per_worker_step"]),
                _mb(r["wire_bytes_per_worker_step"]),
                fmt(r["val_loss_final"], ".3f"),
                fmt(r["time_to_target_s"], ".1f", "not reached"),
            ]
        )
    lines += table(header, rows)
    lines += ["", f"Validation loss after {s['steps']} steps per worker (equal tokens)."]

    real = results.get("real_links") or {}
    lines += ["", "## Emulated against real links", ""]
    validation = [r for r in results["cells"] if r["role"] == "validation"]
    if real.get("skipped"):
        lines.append(f"Real tc-shaped links: skipped ({real['skipped']}).")
    elif validation:
        described = next((r.get("real_link") for r in validation if r.get("real_link")), "")
        lines += [
            f"Real: {described}. Emulated twin: lowcomm's link model at the same bandwidth and "
            "latency. Same workload, one after the other.",
            "",
        ]
        pairs = []
        for r in validation:
            if r["shaping"] != "real":
                continue
            twin = next(
                (
                    t
                    for t in validation
                    if t["shaping"] == "emulated"
                    and t["algo"] == r["algo"]
                    and t["workers"] == r["workers"]
                    and t["link_bandwidth_bps"] == r["link_bandwidth_bps"]
                ),
                None,
            )
            emu = None if twin is None else twin["tokens_per_s"]
            pairs.append(
                [
                    r["algo"],
                    str(r["workers"]),
                    r["link"],
                    fmt(r["tokens_per_s"], ",.0f"),
                    fmt(emu, ",.0f"),
                    fmt(None if not emu else emu / r["tokens_per_s"], ".2f"),
                    fmt(r["ratio_to_ceiling"], ".1%"),
                    fmt(None if twin is None else twin["ratio_to_ceiling"], ".1%"),
                    fmt(r["hidden_fraction"], ".1%"),
                    fmt(None if twin is None else twin["hidden_fraction"], ".1%"),
                ]
            )
        lines += table(
            [
                "algorithm",
                "workers",
                "bandwidth",
                "real tokens/s",
                "emulated tokens/s",
                "emulated / real",
                "x ceiling (real)",
                "x ceiling (emulated)",
                "hidden (real)",
                "hidden (emulated)",
            ],
            pairs,
        )

    overhead = results.get("overhead")
    if overhead:
        lines += [
            "",
            "## Overhead of the hook",
            "",
            "One process with a worker's share of the cores "
            f"({overhead['threads']} threads), single-rank gloo group, "
            f"{overhead['steps_per_algorithm']} step pairs per algorithm (bare and hooked "
            "alternating); medians.",
            "",
        ]
        rows = [
            [
                a["algo"],
                fmt(a["bare_step_s"] * 1e3, ".1f"),
                fmt(None if a["hook_s"] is None else a["hook_s"] * 1e6, ".1f"),
                fmt(a["hook_fraction"], ".3%"),
                fmt(a["ab_overhead"], "+.1%"),
                fmt(None if a["outer_step_s"] is None else a["outer_step_s"] * 1e3, ".1f"),
                fmt(a["outer_over_inner"], ".2f"),
            ]
            for a in overhead["algorithms"]
        ]
        lines += table(
            [
                "algorithm",
                "bare step (ms)",
                "hook per inner step (µs)",
                "hook / bare step",
                "hooked vs bare step (A/B)",
                "outer step (ms)",
                "outer / inner step",
            ],
            rows,
        )

    memory = results.get("memory")
    if memory:
        lines += [
            "",
            "## Memory per rank",
            "",
            "Bytes each rank holds for the algorithm beyond the model and inner optimizer, from "
            "tensor storage after two rounds on the default GPT: state (anchor, outer optimizer "
            "or momentum, statistics) and communication buffers; x model = ÷ the model's fp32 "
            "parameter bytes.",
            "",
        ]
        rows = [
            [
                r["algo"],
                "sharded" if r["sharded"] else "-",
                str(r["workers"]),
                fmt(r["state_bytes"] / 1e6, ".2f"),
                fmt(r["state_over_model"], ".2f"),
                fmt(r.get("state_vs_unsharded"), ".3f"),
                fmt(r["buffer_bytes"] / 1e6, ".2f"),
                fmt(r["buffers_over_model"], ".2f"),
            ]
            for r in memory["rows"]
        ]
        lines += table(
            [
                "algorithm",
                "outer state",
                "N",
                "state (MB)",
                "state x model",
                "sharded / unsharded",
                "buffers (MB)",
                "buffers x model",
            ],
            rows,
        )

    lines += ["", "## Goals", ""]
    goal_rows = []
    for g in results.get("goals", []):
        value, noise = g["value"], g.get("noise")
        measured = fmt(value, g["format"])
        if value is None:
            verdict = "not measured"
        else:
            if noise is not None:
                measured += f" ± {fmt(noise, g['format'])}"
            gap = value - g["limit"] if g["kind"] == "max" else g["limit"] - value
            verdict = "met" if g["met"] else f"**missed** by {fmt(gap, g['format'])}"
            if noise is not None and abs(gap) < noise:
                verdict += " (within the ceiling's noise)"
        goal_rows.append([g["goal"], measured, verdict])
    lines += table(["goal", "measured", "verdict"], goal_rows)
    lines.append("")
    return "\n".join(lines)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(results: dict[str, Any], path: str) -> str:
    """Tokens/s against link bandwidth per algorithm and worker count; ceilings dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    matrix = [r for r in results["cells"] if r["role"] == "matrix"]
    keys = sorted({(r["algo"], r["workers"]) for r in matrix}, key=lambda k: (k[1], k[0]))
    many_worker_counts = len({w for _, w in keys}) > 1
    for algo, workers in keys:
        pts = sorted(
            (r["link_bandwidth_bps"], r["tokens_per_s"])
            for r in matrix
            if r["algo"] == algo and r["workers"] == workers
        )
        label = f"{algo} x{workers}" if many_worker_counts else algo
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for c in results["ceilings"]:
        label = f"ceiling x{c['workers']}" if many_worker_counts else "ceiling (no sync)"
        ax.axhline(c["tokens_per_s"], color="grey", linestyle="--", linewidth=1, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth (bit/s, emulated)")
    ax.set_ylabel("tokens/s (training time)")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput against link bandwidth")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss_vs_time(results: dict[str, Any], path: str) -> str:
    """Validation loss against training time, one panel per link (lowest worker count)."""
    plt = pyplot()
    matrix = [r for r in results["cells"] if r["role"] == "matrix"]
    workers = min((r["workers"] for r in matrix), default=0)
    links = sorted(
        {r["link"] for r in matrix if r["workers"] == workers},
        key=lambda link: -next(r["link_bandwidth_bps"] for r in matrix if r["link"] == link),
    )
    n = max(1, len(links))
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.6), sharey=True, squeeze=False)
    for ax, link in zip(axes[0], links):
        for r in matrix:
            if r["link"] != link or r["workers"] != workers:
                continue
            curve = r["curve"]
            ax.plot([p[1] for p in curve], [p[2] for p in curve], marker=".", label=r["algo"])
        if results.get("target_loss") is not None:
            ax.axhline(results["target_loss"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{link} (emulated), {workers} workers", fontsize=9)
        ax.set_xlabel("training time (s)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
