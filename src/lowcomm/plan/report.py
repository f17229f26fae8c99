"""Tables, JSON and the throughput-against-memory plot of ``lowcomm plan``."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from lowcomm.plan.search import Candidate, PlanResult, rank_of
from lowcomm.runfiles import write_text

__all__ = [
    "format_candidates",
    "format_layout",
    "format_frontier",
    "format_megatron",
    "format_published",
    "format_memory",
    "plot_candidates",
    "result_json",
    "write_json",
]


def format_candidates(result: PlanResult, top: int = 10) -> str:
    """The ``top`` candidates as a markdown table with their memory and time breakdowns."""
    m, c = result.model, result.cluster
    lines = [
        f"{m.name}: {m.parameters() / 1e9:.2f}B parameters, L={m.layers} h={m.hidden} "
        f"a={m.heads} V={m.vocab} s={m.seq}; {c.name}: {c.devices} devices; global batch "
        f"{result.global_batch}; {result.precision.name}",
        "",
        "| # | layout | tokens/s | TFLOP/s/dev | % peak | MFU % | iter s | compute | "
        "elementwise | TP | PP | bubble | DP | outer | memory GB | weights+grads+opt | "
        "activations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, cand in enumerate(result.candidates[:top], start=1):
        t, mem = cand.time, cand.memory
        state = mem.weights + mem.gradients + mem.optimizer + mem.working + mem.outer
        lines.append(
            f"| {i} | {cand.layout.label()} | {t.tokens_per_s:,.0f} | {t.tflops_per_device:.1f} | "
            f"{t.percent_of_peak:.1f} | {100 * t.mfu:.1f} | {t.iteration_s:.3g} | "
            f"{t.compute_s:.3g} | {t.elementwise_s:.3g} | {t.tp_s:.3g} | {t.pp_s:.3g} | "
            f"{t.bubble_s:.3g} | {t.dp_s:.3g} | {t.outer_s:.3g} | {mem.total / 1e9:.1f} | "
            f"{state / 1e9:.1f} | {mem.activations / 1e9:.1f} |"
        )
    if not result.candidates:
        lines.append("| - | no feasible layout | | | | | | | | | | | | | | | |")
    rejected = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejected.items()))
    lines += ["", f"{len(result.candidates)} feasible layouts; rejected: {rejected or 'none'}"]
    lines.append("Predictions of the model (lowcomm.plan), not measurements.")
    return "\n".join(lines)


def format_layout(result: PlanResult, full: PlanResult | None, given: str, top: int = 10) -> str:
    """``lowcomm plan --layout``: the layouts that keep the given fields, best first, the best
    one's whole breakdown and its rank in the unrestricted search (``full``); or, when none is
    feasible, every rule each matching layout breaks."""
    lines = [format_candidates(result, top), "", f"Layout asked for: {given}"]
    if result.candidates:
        best = result.candidates[0]
        rank = rank_of(full, best.layout) if full is not None else None
        where = (
            f"rank {rank} of {len(full.candidates)} feasible layouts of the full search"
            if full is not None and rank is not None
            else "not among the full search's layouts"
        )
        lines += [f"Best that keeps it: {best.layout.label()} ({where})", ""]
        lines += _breakdown(best)
        return "\n".join(lines)
    lines += ["No feasible layout keeps it; each that does breaks these rules:", ""]
    seen: set[tuple[str, ...]] = set()
    for cand in result.infeasible:
        if cand.reasons in seen:
            continue
        seen.add(cand.reasons)
        lines.append(f"- {cand.layout.label()}: " + "; ".join(cand.reasons))
        if len(seen) == top:
            break
    if not result.infeasible:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(result.rejected.items()))
        lines.append(f"- (no layout could be built: {rejected or 'none'})")
    return "\n".join(lines)


def _breakdown(cand: Candidate) -> list[str]:
    """One candidate's memory and time, part by part."""
    t, mem = cand.time, cand.memory
    gb = 1e9
    return [
        "| part | predicted |",
        "|---|---|",
        f"| tokens/s | {t.tokens_per_s:,.0f} |",
        f"| TFLOP/s per device (% of peak, MFU) | {t.tflops_per_device:.1f} "
        f"({t.percent_of_peak:.1f}%, {100 * t.mfu:.1f}%) |",
        f"| iteration | {t.iteration_s:.4g} s |",
        f"| compute | {t.compute_s:.4g} s |",
        f"| elementwise | {t.elementwise_s:.4g} s |",
        f"| tensor parallel | {t.tp_s:.4g} s |",
        f"| pipeline sends | {t.pp_s:.4g} s |",
        f"| pipeline bubble | {t.bubble_s:.4g} s |",
        f"| data parallel (exposed) | {t.dp_s:.4g} s |",
        f"| outer algorithm (exposed) | {t.outer_s:.4g} s |",
        f"| optimizer step | {t.optimizer_s:.4g} s |",
        f"| memory ({mem.stage} stage, at {mem.phase}) | {mem.total / gb:.1f} GB |",
        f"| weights / gradients / optimizer | {mem.weights / gb:.1f} / "
        f"{mem.gradients / gb:.1f} / {mem.optimizer / gb:.1f} GB |",
        f"| working / outer state | {mem.working / gb:.1f} / {mem.outer / gb:.1f} GB |",
        f"| activations | {mem.activations / gb:.1f} GB |",
    ]


def result_json(result: PlanResult, top: int | None = None) -> dict[str, Any]:
    m, c = result.model, result.cluster
    cands = result.candidates if top is None else result.candidates[:top]
    return {
        "model": {**m.__dict__, "parameters": m.parameters()},
        "cluster": {
            "name": c.name,
            "devices": c.devices,
            "device_memory_bytes": c.device_memory_bytes,
            "peak_flops": c.peak_flops,
            "gemm_efficiency": c.gemm_efficiency,
            "memory_bandwidth_Bps": c.memory_bandwidth_Bps,
            "tiers": [t.__dict__ for t in c.tiers],
            "note": c.note,
        },
        "precision": result.precision.__dict__,
        "global_batch": result.global_batch,
        "feasible": len(result.candidates),
        "rejected": result.rejected,
        "candidates": [cand.as_dict() for cand in cands],
    }


def write_json(data: Any, path: str) -> str:
    """Write ``data`` to ``path`` through a temporary file (a failed write leaves no half)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text(path, json.dumps(data, indent=2))
    return path


def plot_candidates(result: PlanResult, path: str, top: int = 10) -> str:
    """Predicted tokens/s against peak memory per device for every feasible candidate, the
    ``top`` marked, the device's memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cands = result.candidates
    ax.scatter(
        [c.memory.total / 1e9 for c in cands],
        [c.time.tokens_per_s for c in cands],
        s=8,
        alpha=0.4,
        label=f"feasible layouts ({len(cands)})",
    )
    best = cands[:top]
    ax.scatter(
        [c.memory.total / 1e9 for c in best],
        [c.time.tokens_per_s for c in best],
        s=30,
        color="C3",
        label=f"top {len(best)}",
    )
    if best:
        ax.annotate(
            best[0].layout.label(),
            (best[0].memory.total / 1e9, best[0].time.tokens_per_s),
            fontsize=8,
            xytext=(5, 5),
            textcoords="offset points",
        )
    ax.axvline(result.cluster.device_memory_bytes / 1e9, color="gray", ls="--", lw=1)
    ax.set_xlabel("peak memory per device (GB, predicted)")
    ax.set_ylabel("tokens/s (predicted)")
    ax.set_title(f"{result.model.name} on {result.cluster.name}: lowcomm plan (a model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_megatron(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | layout | GPUs | batch | predicted TFLOP/s/GPU | published | ratio | "
        "predicted memory GB | rank / feasible | planner's best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rank = "-" if r["rank"] is None else r["rank"]
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['global_batch']} | "
            f"{r['predicted_tflops']:.1f} | {r['published_tflops']:.0f} | {r['ratio']:.3f} | "
            f"{r['memory_gb']:.1f} | {rank} / {r['candidates']} | {r['best_layout']} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    lines.append(f"\nLargest deviation: {100 * worst:.1f}% (Narayanan et al. 2021, Table 1).")
    return "\n".join(lines)


def format_frontier(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | GCDs | batch | authors' layout | predicted % of peak | published | ratio | "
        "rank / feasible | planner's best | its % of peak | best MFU % / authors' | "
        "predicted speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rank = "-" if r["rank"] is None else r["rank"]
        lines.append(
            f"| {r['model']} | {r['gcds']} | {r['global_batch']} | {r['authors_layout']} | "
            f"{r['predicted_percent']:.2f} | {r['published_percent']:.2f} | {r['ratio']:.3f} | "
            f"{rank} / {r['candidates']} | {r['best_layout']} | {r['best_percent']:.2f} | "
            f"{r['best_mfu_percent']:.1f} / {r['authors_mfu_percent']:.1f} | "
            f"{r['best_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def format_published(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| source | model | devices | batch | layout (published fields + the planner's best "
        "for the rest) | predicted TFLOP/s/device | published | ratio | memory GB | rank / "
        "feasible | planner's best |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rank = "-" if r["rank"] is None else r["rank"]
        source = r["table"] + (" (calibrated)" if r["calibrated"] else " (held out)")
        memory = f"{r['memory_gb']:.1f}" + ("" if r["fits"] else " (over)")
        lines.append(
            f"| {source} | {r['model']} | {r['devices']} | {r['global_batch']} | "
            f"{r['layout']} | {r['predicted_tflops']:.1f} ({r['counted']}) | "
            f"{r['published_tflops']:.1f} | {r['ratio']:.3f} | {memory} | "
            f"{rank} / {r['candidates']} | {r['best_layout']} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    held = [abs(r["ratio"] - 1) for r in rows if not r["calibrated"]]
    lines.append(
        f"\nLargest deviation: {100 * worst:.1f}%"
        + (f"; on held-out runs {100 * max(held):.1f}%." if held else ".")
    )
    return "\n".join(lines)


def format_memory(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| model | mode | attention | recompute | micro-batch | ranks | measured MB | "
        "predicted MB | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('arch', 'gpt')} | {r['mode']} | {r['attention']} | {r['recompute']} | "
            f"{r['micro_batch']} | "
            f"{r['world']} | "
            f"{r['measured_bytes'] / 1e6:.1f} | {r['predicted_bytes'] / 1e6:.1f} | "
            f"{r['ratio']:.3f} |"
        )
    worst = max(abs(r["ratio"] - 1) for r in rows)
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in rows)
    lines.append(f"\n{within} of {len(rows)} within 10%; largest deviation {100 * worst:.1f}%.")
    return "\n".join(lines)
