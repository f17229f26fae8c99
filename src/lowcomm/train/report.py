"""The final summary table ``lowcomm train`` prints, built from ``summary.json``."""

from __future__ import annotations

from typing import Any

__all__ = ["format_summary"]


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f} MB"


def _ceiling_rows(ceiling: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not ceiling:
        return []
    text = (
        f"{ceiling['tokens_per_s']:,.0f} tokens/s without sync "
        f"({ceiling['steps']} steps in the same processes)"
    )
    ratio = ceiling.get("ratio")
    return [("ceiling", text), ("of ceiling", "-" if ratio is None else f"{ratio:.1%}")]


def _resume_rows(resumed_at: list[int] | None) -> list[tuple[str, str]]:
    if not resumed_at:
        return []
    return [("resumed at", ", ".join(f"step {s:,}" for s in resumed_at))]


def _workers(summary: dict[str, Any]) -> str:
    layout = summary.get("layout")
    if not layout or layout["nodes"] == 1:
        return str(summary["workers"])
    return f"{summary['workers']} ({layout['nodes']} nodes x {layout['procs_per_node']})"


def _layout_rows(layout: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not layout:
        return []
    rows = []
    if layout["nodes"] > 1 and layout["across_nodes"] != "ddp":
        rows.append(("layout", f"DDP inside each node, {layout['across_nodes']} across nodes"))
    if layout["node_sharding"] == "zero":
        where = "of a node" if layout["nodes"] > 1 else "(one node)"
        text = f"zero (AdamW state across the {layout['procs_per_node']} processes {where})"
        rows.append(("node sharding", text))
    return rows


def format_summary(summary: dict[str, Any], *, command_s: float | None = None) -> str:
    """A small two-column table of a run's ``summary.json``.

    Args:
        summary: the parsed ``summary.json``.
        command_s: wall time of the whole command including start-up, if known.
    """
    comm = summary.get("comm_mean") or {}
    algo = summary["algo"]
    sync = {"ddp": "every step", "none": "never: the no-sync ceiling"}.get(
        algo, f"every {summary.get('sync_every')} steps"
    )
    hidden = comm.get("hidden_fraction")
    tps = summary.get("tokens_per_s")
    wall = f"{summary['wall_time_s']:.1f} s training loop"
    if command_s is not None:
        wall += f", {command_s:.1f} s with start-up"
    layout = summary.get("layout") or {}
    hierarchical = layout.get("nodes", 1) > 1 and algo != "ddp"
    # with node groups, the algorithm's counters are those of its cross-node group
    across = "cross-node " if hierarchical else ""
    intra = layout.get("intra_node")
    link = summary.get("link") or "real network"
    if hierarchical and summary.get("link"):
        link += (
            f", across nodes only; a node's {layout['procs_per_node']} processes share it: "
            f"{layout['link_per_process']} each"
        )
    rows = [
        ("algorithm", f"{algo} (sync {sync})"),
        ("workers", _workers(summary)),
        *_layout_rows(layout or None),
        ("link", link),
        ("compression", summary.get("compression") or "none (fp32)"),
        ("steps", f"{summary['steps']:,} ({summary['tokens']:,} tokens)"),
        *_resume_rows(summary.get("resumed_at")),
        ("tokens/s", "-" if tps is None else f"{tps:,.0f}"),
        *_ceiling_rows(summary.get("ceiling")),
        (
            "val loss",
            f"{summary['val_loss_initial']:.3f} -> {summary['val_loss_final']:.3f}",
        ),
        *(
            [("skipped updates", f"{summary['skipped_updates']} (NaN/Inf in the average)")]
            if summary.get("skipped_updates")
            else []
        ),
        (f"{across}payload / worker", _mb(comm.get("payload_bytes"))),
        (f"{across}wire / worker", _mb(comm.get("wire_bytes"))),
        (f"{across}blocked / worker", f"{comm.get('blocked_s') or 0.0:.2f} s"),
        ("hidden fraction", "-" if hidden is None else f"{hidden:.1%}"),
        *(
            [("intra-node wire / worker", f"{_mb(intra['wire_bytes'])} (DDP, every step)")]
            if intra
            else []
        ),
        ("wall time", wall),
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"lowcomm train: {summary.get('name')} finished"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
