"""What a ``lowcomm train`` job reports: rank 0's progress while it runs (``metrics.jsonl``
records and the progress bar, :class:`Progress`), the files that describe the run
(``config.json``: :func:`resolved_config`; ``summary.json``: :func:`run_summary`), and the final
table the command prints from ``summary.json`` (:func:`format_summary`).

The progress is :mod:`lowcomm.train.progress`'s and the files :mod:`lowcomm.train.summary`'s
(both importable from here too); this module holds the tables: a finished run's, an elastic job's
(:func:`format_elastic_summary`), and the line of what a failed run had measured
(:func:`format_failed`)."""

from __future__ import annotations

import math
from typing import Any

from lowcomm.train.progress import EXPLODED, LossWatch, Progress, divergence
from lowcomm.train.summary import failed_summary, resolved_config, run_summary

__all__ = [
    "LossWatch",
    "Progress",
    "divergence",
    "describe_choice",
    "divergence_text",
    "failed_summary",
    "format_elastic_summary",
    "format_failed",
    "format_summary",
    "resolved_config",
    "run_summary",
]


def _work_rows(work: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Rows for workers of unequal speed (``speeds``) or dynamic local steps."""
    if work is None or (work["speeds"] is None and work["local_steps"] == "fixed"):
        return []
    per_round = "/".join("-" if n is None else f"{n:.1f}" for n in work["steps_per_round"])
    blocked = "/".join(f"{b or 0.0:.2f}" for b in work["blocked_s"])
    rows = [("steps / round", f"{per_round} per worker ({work['local_steps']} local steps)")]
    if work["speeds"] is not None:
        rows.append(("speeds", f"{work['speeds']} (emulated)"))
    rows.append(("blocked", f"{blocked} s per worker"))
    return rows


def format_failed(summary: dict[str, Any], path: str | None) -> str:
    """One line of what a failed or interrupted run had measured (:func:`failed_summary`)."""
    parts = [f"step {summary['steps_done']:,} of {summary['steps']:,} done"]
    if summary.get("train_loss_last") is not None:
        parts.append(f"training loss {summary['train_loss_last']:.3f}")
    if summary.get("val_loss_last") is not None:
        parts.append(
            f"val loss {_loss(summary['val_loss_initial'])} -> "
            f"{_loss(summary['val_loss_last'])} at step {summary['val_step_last']:,}"
        )
    if summary.get("tokens_per_s"):
        parts.append(f"{summary['tokens_per_s']:,.0f} tokens/s")
    checkpoint = summary.get("checkpoint")
    parts.append(
        f"last complete checkpoint {checkpoint} (--resume continues from it)"
        if checkpoint
        else "no complete checkpoint to resume from (--checkpoint-every N writes them)"
    )
    kept = f"kept in {path}" if path else "summary.json could not be written"
    status = summary.get("status") or "failed"
    return f"lowcomm train: {summary.get('name')} {status}; measured before ({kept}): " + ", ".join(
        parts
    )


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


def _resume_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    resumed_at = summary.get("resumed_at")
    if not resumed_at:
        return []
    text = ", ".join(f"step {s:,}" for s in resumed_at)
    lost = summary.get("lost_to_restarts_s")
    if lost:
        text += f" ({lost:.1f} s lost to restarts: redone work and start-up, in tokens/s)"
    return [("resumed at", text)]


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


def _memory_rows(peaks: list[int | None] | None) -> list[tuple[str, str]]:
    """The device memory high-water mark of each worker (``None`` on the CPU: no row)."""
    if not peaks or all(b is None for b in peaks):
        return []
    each = " / ".join("-" if b is None else f"{b / 2**20:.0f} MiB" for b in peaks)
    return [("peak GPU memory", f"{each} (per worker)" if len(peaks) > 1 else each)]


def _loss(value: float | None) -> str:
    return "NaN/Inf" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _sync_text(summary: dict[str, Any]) -> str:
    h = summary.get("sync_every")
    if h is None:
        return "never: the no-sync ceiling"
    text = "every step" if h == 1 else f"every {h} steps"
    early = summary.get("early_rounds")
    if early:
        text += f"; every {early['sync_every']} for the first {early['steps']:,}"
    tau = summary.get("overlap") or 0
    if tau:
        text += f"; {tau} step{'s' if tau > 1 else ''} in flight"
    return text


def _warm_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    warm = summary.get("sync_warmup")
    if not warm:
        return []
    codec = warm.get("compression") or "fp32"
    return [("warm start", f"first {warm['steps']:,} steps synchronous (DDP's mean, {codec})")]


def divergence_text(nonfinite: dict[str, Any]) -> str:
    """What went wrong in a diverged run (``summary["nonfinite"]``), for the terminal."""
    first = nonfinite.get("first_step")
    if first:
        rank = nonfinite["first_rank"]
        text = f"the training loss became NaN or Inf at step {first:,} (rank {rank})"
        last = nonfinite.get("last_step")
        return text + (f" and still was at step {last:,}" if last and last != first else "")
    if nonfinite.get("val_loss_exploded"):
        return f"the validation loss ended above {EXPLODED:g} times its initial value"
    return "the final validation loss is NaN or Inf"


def _nonfinite_rows(nonfinite: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not nonfinite:
        return []
    if not nonfinite["diverged"]:
        where = f"at step {nonfinite['first_step']:,} (rank {nonfinite['first_rank']})"
        return [("non-finite loss", f"{where}, recovered: its updates were skipped")]
    return [("diverged", f"{divergence_text(nonfinite)}; lower --lr")]


def describe_choice(record: dict[str, Any]) -> str:
    """The choice of a ``link_tuning`` record in one line: the settings, the predicted step
    times, and what the settings are expected to cost per token with where that was
    measured."""
    chosen = ", ".join(f"{k} {'none' if v is None else v}" for k, v in record["settings"].items())
    predicted = f"predicted {record['step_s'] * 1e3:.0f} ms a step"
    warm = record.get("warm_step_s")
    if warm is not None and record.get("warm_steps"):
        predicted += f", {warm * 1e3:.0f} ms a warm step"
    predicted += f", against {record['compute_s'] * 1e3:.0f} ms of compute"
    expected = ""
    if record.get("cost") is not None:
        studies = sorted(
            {line.rsplit(", ", 1)[-1].rstrip(")") for line in record.get("evidence", [])}
        )
        where = f", measured in {' and '.join(studies)}" if studies else ""
        against = "DDP's" if record.get("replaced") else "the untuned job"
        expected = f"; expected loss per token {record['cost']:+.1%} against {against}{where}"
    text = f"{chosen or 'the defaults'} ({predicted}{expected})"
    if record.get("as_given"):  # only the heal chosen: say why the rest is not
        text += f"; the other settings as given ({record['as_given']})"
    replaced = record.get("replaced")
    if replaced:  # the default job's algorithm gave way: say why
        text += f"; in place of {replaced['algo']}: {record['reason']}"
    return text


def _tuning_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The settings chosen from the link (``--tune-link``), if any were looked for, and the
    step times predicted for them beside those the run measured."""
    tuning = summary.get("link_tuning")
    if not tuning:
        return []
    rows = [("tuned to link", f"{tuning['link']}: {describe_choice(tuning)}")]
    measured = summary.get("step_times") or {}
    parts = []
    if measured.get("step_s") is not None:
        parts.append(f"{tuning['step_s'] * 1e3:.0f} / {measured['step_s'] * 1e3:.0f} ms a step")
    if measured.get("warm_step_s") is not None and tuning.get("warm_step_s") is not None:
        predicted, run = tuning["warm_step_s"] * 1e3, measured["warm_step_s"] * 1e3
        parts.append(f"{predicted:.0f} / {run:.0f} ms a warm step")
    if parts:
        rows.append(("predicted / run", ", ".join(parts)))
    return rows


def format_summary(summary: dict[str, Any], *, command_s: float | None = None) -> str:
    """A small two-column table of a run's ``summary.json``; its first line says whether the
    run finished or diverged.

    Args:
        summary: the parsed ``summary.json``.
        command_s: wall time of the whole command including start-up, if known.
    """
    comm = summary.get("comm_mean") or {}
    algo = summary["algo"]
    hidden = comm.get("hidden_fraction")
    tps = summary.get("tokens_per_s")
    wall = f"{summary['wall_time_s']:.1f} s training loop"
    this_run = summary.get("attempt_wall_time_s")
    if summary.get("resumed_at") and this_run is not None:
        # the loop's time continues the stopped run's; the command's is this run's alone
        wall += f" from step 0 over every run, {this_run:.1f} s of it in this one"
        if command_s is not None:
            wall += f" ({command_s:.1f} s with start-up)"
    elif command_s is not None:
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
    compression = summary.get("compression") or "none (fp32)"
    if summary.get("sync_every") is None:
        compression = "none (nothing is sent)"
    rows = [
        ("algorithm", f"{algo} (sync {_sync_text(summary)})"),
        *_warm_rows(summary),
        ("workers", _workers(summary)),
        *_layout_rows(layout or None),
        ("link", link),
        ("compression", compression),
        *_tuning_rows(summary),
        ("steps", f"{summary['steps']:,} ({summary['tokens']:,} tokens)"),
        *_work_rows(summary.get("work")),
        *_resume_rows(summary),
        ("tokens/s", "-" if tps is None else f"{tps:,.0f}"),
        *_ceiling_rows(summary.get("ceiling")),
        ("val loss", f"{_loss(summary['val_loss_initial'])} -> {_loss(summary['val_loss_final'])}"),
        *_nonfinite_rows(summary.get("nonfinite")),
        *(
            [("skipped updates", f"{summary['skipped_updates']} (NaN/Inf in the average)")]
            if summary.get("skipped_updates")
            else []
        ),
        (f"{across}payload / worker", _mb(comm.get("payload_bytes"))),
        (f"{across}wire / worker", _mb(comm.get("wire_bytes"))),
        (f"{across}blocked / worker", f"{comm.get('blocked_s') or 0.0:.2f} s"),
        *(
            [("quorum wait / worker", f"{comm['quorum_wait_s']:.2f} s (waiting for a quorum)")]
            if comm.get("quorum_wait_s") is not None
            else []
        ),
        ("hidden fraction", "-" if hidden is None else f"{hidden:.1%} (mean of the workers)"),
        *(
            [("intra-node wire / worker", f"{_mb(intra['wire_bytes'])} (DDP, every step)")]
            if intra
            else []
        ),
        *_memory_rows(summary.get("peak_gpu_memory_bytes")),
        ("wall time", wall),
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"lowcomm train: {summary.get('name')} {summary.get('status', 'finished')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def format_elastic_summary(summary: dict[str, Any], *, command_s: float | None = None) -> str:
    """The table ``lowcomm train --fault-tolerance`` prints."""

    def loss(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    faults = summary.get("faults") or []
    healed = [f["fault_to_healed_s"] for f in faults if f.get("fault_to_healed_s") is not None]
    moved = [f for f in faults if f.get("heal_transfer_s") is not None]
    transfer = ""
    if moved:
        took = [f["heal_transfer_s"] for f in moved]
        size = sum(f.get("heal_bytes") or 0 for f in moved) / len(moved) / 1e6
        transfer = f", heal transfer {min(took):.1f}-{max(took):.1f} s ({size:.2f} MB each)"
    participants = summary.get("participants_per_sync") or []
    rows = [
        ("algorithm", f"{summary['algo']} (sync {_sync_text(summary)}, elastic)"),
        (
            "replicas",
            f"{summary['replicas']} (at least {summary['min_replicas']} per sync)"
            + (
                f", each {summary['procs_per_replica']} processes with DDP inside"
                if summary.get("procs_per_replica", 1) > 1
                else ""
            ),
        ),
        *([("link", summary["link"])] if summary.get("link") else []),
        *_tuning_rows({"link_tuning": summary.get("link_tuning")}),
        ("steps", f"{summary['steps']:,}"),
        (
            "tokens trained",
            f"{summary['tokens_trained']:,} ({summary['tokens_not_trained']:,} "
            "not trained while replicas were away)",
        ),
        (
            "tokens/s",
            "-"
            if summary.get("tokens_per_s") is None
            else f"{summary['tokens_per_s']:,.0f} (every replica, start-up and faults included)",
        ),
        (
            "val loss",
            f"{loss(summary.get('val_loss_initial'))} -> {loss(summary.get('val_loss_final'))}",
        ),
        (
            "faults",
            f"{len(faults)}; healed {len(healed)}"
            + (f", fault to healed {min(healed):.1f}-{max(healed):.1f} s" if healed else "")
            + transfer,
        ),
        (
            "participants",
            "-"
            if not participants
            else f"{min(participants)}-{max(participants)} per sync over {len(participants)} syncs",
        ),
        ("replicas identical", "yes" if summary.get("replicas_identical") else "no"),
        (
            "wall time",
            f"{summary['wall_time_s']:.1f} s (the replicas' start-up included)"
            + (
                f", {command_s:.1f} s the whole command"
                if command_s is not None and command_s - summary["wall_time_s"] >= 0.1
                else ""
            ),
        ),
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"lowcomm train: {summary.get('name')} {summary.get('status')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
