"""Write a ``lowcomm bench`` run's results: ``results.json`` (everything, see
:func:`lowcomm.bench.run_bench`), ``results.md`` (the tables) and two plots,
``throughput.png`` (tokens/s against link bandwidth, the ceiling as a line) and
``loss_vs_time.png`` (validation loss against training time, a panel per link); and a
``lowcomm bench --codec-only`` run's ``results.json`` and ``codec.md``."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable
from typing import Any

from lowcomm.runfiles import json_safe, write_text

__all__ = [
    "fmt",
    "format_codec",
    "format_codec_report",
    "format_markdown",
    "pyplot",
    "table",
    "write_codec_report",
    "write_report",
]

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
    validation pairs, the overhead micro-benchmark, the memory report, the codec row and the
    goals."""
    s = results["settings"]
    lines = _head(results, "# lowcomm bench" + (" --quick" if results.get("quick") else ""))
    lines += [
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

    codec = results.get("codec")
    if codec:
        lines += ["", *format_codec(codec)]
    parity = results.get("ddp_parity")
    if parity:
        from lowcomm.bench.ddp_parity import parity_table

        lines += ["", "## DDP parity", "", parity_table(parity)]

    lines += ["", *_format_goals(results.get("goals", []))]
    lines.append("")
    return "\n".join(lines)


def _format_goals(goals: list[dict[str, Any]]) -> list[str]:
    lines = ["## Goals", ""]
    goal_rows = []
    for g in goals:
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
    return lines + table(["goal", "measured", "verdict"], goal_rows)


def _ms(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    ms = seconds * 1e3
    return format(ms, ".3f" if ms < 1 else ".2f" if ms < 10 else ".1f" if ms < 100 else ",.0f")


def format_codec(codec: dict[str, Any]) -> list[str]:
    """The codec row (:func:`lowcomm.bench.codec.measure_codecs`) as Markdown lines: per codec
    and layout, codec time / clone time and codec time / copy time at each size (the codec's
    own milliseconds beside), and the clone and the copy the entries were timed against
    (medians over the entries)."""
    rows = codec["rows"]
    sizes = list(dict.fromkeys(r["size_m"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    at = {(r["codec"], r["layout"], r["size_m"]): r for r in rows}
    lines = [
        "## The codec's cost against a clone",
        "",
        "Encode + decode + error feedback of one compressed mean (lowcomm's path: "
        "`Compressor` with error feedback through a `Communicator` on a one-rank gloo group, "
        "then the handle's `wait()`), against a `clone()` of the same fp32 buckets "
        f"({fmt(codec['bucket_cap_mb'], 'g')} MB each at most) timed in turn with it; "
        f"{codec['threads']} thread{'s' if codec['threads'] != 1 else ''}, medians of up to "
        f"{codec['max_repeats']} repeats. "
        "Cells: codec time / clone time, codec time / copy time (the codec's milliseconds). "
        "Layouts: `gpt`, whole "
        "transformer blocks (12 tensors each: weights, biases, LayerNorms); `single`, one "
        "matrix of N/1024 x 1024.",
        "",
    ]
    header = ["codec", "layout", *(f"{size:g} M" for size in sizes)]
    body = []
    for layout in layouts:
        for name in codecs:
            cells = []
            for size in sizes:
                r = at.get((name, layout, size))
                cells.append(
                    "-"
                    if r is None
                    else f"{fmt(r['ratio'], '.1f')}x / {fmt(r.get('ratio_to_copy'), '.1f')}x "
                    f"({_ms(r['codec_s'])} ms)"
                )
            body.append([name, layout, *cells])
        for label, key in (("clone (ms)", "clone_s"), ("copy (ms)", "copy_s")):
            cells = []
            for size in sizes:
                times = [r[key] for r in rows if r["layout"] == layout and r["size_m"] == size]
                cells.append(_ms(statistics.median(times)) if times else "-")
            body.append([f"*{label}*", layout, *cells])
    lines += table(header, body)
    lines += [
        "",
        "Copy: `copy_` into buffers allocated once, the memory traffic alone; a clone also "
        "allocates, and an allocation beyond glibc's mmap threshold (at most 32 MB) gets fresh "
        "pages whose faults can cost two more copies.",
    ]
    return lines


def _head(results: dict[str, Any], title: str, *, processor: bool = False) -> list[str]:
    """A report's title, command and run line (when, the machine, torch, how long)."""
    lines = [title, ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    m = results["machine"]
    cores = f"{m['cpu_count']} CPU cores" + (f" ({m['processor']})" if processor else "")
    elapsed = fmt(results.get("elapsed_s"), ".0f")
    return [
        *lines,
        f"Run {results['created']} on {cores}, torch {m['torch']}; {elapsed} s in all.",
        "",
    ]


def format_codec_report(results: dict[str, Any]) -> str:
    """A ``lowcomm bench --codec-only`` run as Markdown: the command, the machine, the codec
    row and its goal."""
    lines = _head(results, "# lowcomm bench --codec-only", processor=True)
    lines += [
        *format_codec(results["codec"]),
        "",
        *_format_goals(results.get("goals", [])),
        "",
    ]
    return "\n".join(lines)


def write_codec_report(results: dict[str, Any], out: str) -> list[str]:
    """Write a ``--codec-only`` run's ``results.json`` and ``codec.md`` to ``out``; return
    their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "results.json"), os.path.join(out, "codec.md")]
    write_text(paths[0], json.dumps(json_safe(results), indent=1) + "\n")
    write_text(paths[1], format_codec_report(results))
    return paths


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
