"""What a ``lowcomm train`` job reports: rank 0's progress while it runs (``metrics.jsonl``
records and the progress bar, :class:`Progress`), the files that describe the run
(``config.json``: :func:`resolved_config`; ``summary.json``: :func:`run_summary`), and the final
table the command prints from ``summary.json`` (:func:`format_summary`)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.link import EmulatedLink
from lowcomm.registry import REGISTRY
from lowcomm.train.config import TrainConfig
from lowcomm.train.metrics import MetricsWriter
from lowcomm.train.nodes import describe_layout, node_link

__all__ = ["Progress", "format_summary", "resolved_config", "run_summary"]

logger = logging.getLogger(__name__)


class Progress:
    """Rank 0's reporting: ``metrics.jsonl`` records, and a tqdm bar on a terminal (a log line
    per evaluation otherwise, so logs stay readable).

    Each step's loss is added to a running sum on the device; the sum is read back, written as
    one ``step`` record (the mean) and the bar moved on only every ``log_every`` steps and when
    the loop asks (before an evaluation, at the last step).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        world: int,
        tokens_per_step: int,
        stats: Any,
        device: torch.device,
        *,
        append: bool = False,
    ) -> None:
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.stats = stats
        path = os.path.join(cfg.out or ".", "metrics.jsonl")
        self.writer = MetricsWriter(path, append=append)
        self.t_start = time.perf_counter()
        self.eval_s = 0.0
        self.loss = float("nan")
        self.val = float("nan")
        self.val_start = float("nan")
        self.resumed_at: list[int] = []
        self._loss_sum = torch.zeros((), device=device)
        self._last_step = 0  # the step of the last record
        self.bar = None
        if sys.stderr.isatty() and not cfg.quiet:
            from tqdm.auto import tqdm

            layout = f"x{world}" if cfg.nodes == 1 else f"{cfg.nodes}x{cfg.procs_per_node}"
            self.bar = tqdm(
                total=cfg.steps, desc=f"{cfg.algo} {layout}", unit="step", dynamic_ncols=True
            )

    def start(self, t_start: float) -> None:
        self.t_start = t_start

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the records exactly (checkpoint ``progress``)."""
        return {
            "loss_sum": self._loss_sum.detach().cpu().clone(),
            "last_step": self._last_step,
            "elapsed_s": time.perf_counter() - self.t_start,
            "eval_s": self.eval_s,
            "loss": self.loss,
            "val": self.val,
            "val_start": self.val_start,
            "resumed_at": list(self.resumed_at),
        }

    def resume(self, step: int, state: dict[str, Any], source: str | None, restart: int) -> float:
        """Continue from a checkpoint's :meth:`state_dict` at ``step``; write a ``resume``
        record. Returns the elapsed time the stopped run had reached (the new start is that much
        earlier, so times continue)."""
        self._loss_sum.copy_(state["loss_sum"])
        self._last_step = int(state["last_step"])
        self.eval_s = float(state["eval_s"])
        self.loss, self.val = float(state["loss"]), float(state["val"])
        self.val_start = float(state["val_start"])
        self.resumed_at = [*state.get("resumed_at", []), step]
        self.writer.write(
            {"kind": "resume", "step": step, "checkpoint": source, "restart": restart}
        )
        if self.bar is not None:
            self.bar.update(step)
        return float(state["elapsed_s"])

    def _tokens_per_s(self, step: int) -> float:
        train_s = time.perf_counter() - self.t_start - self.eval_s
        return step * self.tokens_per_step / max(train_s, 1e-9)

    def _postfix(self, step: int) -> dict[str, str]:
        hidden = self.stats.hidden_fraction
        return {
            "loss": f"{self.loss:.3f}",
            "val": f"{self.val:.3f}",
            "tok/s": f"{self._tokens_per_s(step):,.0f}",
            "hidden": "-" if hidden is None else f"{hidden:.0%}",
        }

    def step(self, step: int, loss: torch.Tensor, lr: float, *, flush: bool = False) -> None:
        """Add step ``step``'s loss; record the mean since the last record every ``log_every``
        steps, or now when ``flush``."""
        self._loss_sum.add_(loss.detach())
        if not flush and step % self.cfg.log_every:
            return
        n = step - self._last_step
        self.loss = float(self._loss_sum) / n  # the one device sync per record
        self._loss_sum.zero_()
        self._last_step = step
        self.writer.write(
            {
                "kind": "step",
                "step": step,
                "steps": n,
                "loss": self.loss,
                "lr": lr,
                "tokens": step * self.tokens_per_step,
                "elapsed_s": time.perf_counter() - self.t_start,
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(step), refresh=False)
            self.bar.update(n)

    def eval(self, step: int, val_loss: float, rounds: int, eval_s: float) -> None:
        now = time.perf_counter()
        if step == 0:
            self.val_start = val_loss
        # Training time up to this evaluation: wall time less every evaluation so far.
        train_s = now - eval_s - self.t_start - self.eval_s
        self.eval_s += eval_s
        self.val = val_loss
        self.writer.write(
            {
                "kind": "eval",
                "step": step,
                "val_loss": val_loss,
                "tokens": step * self.tokens_per_step,
                "elapsed_s": now - self.t_start,
                "train_s": train_s,
                "rounds": rounds,
                **self.stats.as_dict(),
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(max(step, 1)), refresh=False)
        elif step > 0:
            p = self._postfix(step)
            logger.info(
                "step %d/%d  loss %s  val %s  tok/s %s  hidden %s",
                step,
                self.cfg.steps,
                p["loss"],
                p["val"],
                p["tok/s"],
                p["hidden"],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


def resolved_config(cfg: TrainConfig, world: int, corpus: Any) -> dict[str, Any]:
    out = cfg.to_dict()
    out["resolved"] = {
        "world_size": world,
        "layout": describe_layout(cfg, world),
        "backend": dist.get_backend(),
        "eval_interval": cfg.eval_interval,
        "algorithm_kwargs": cfg.algorithm_kwargs(),
        "corpus": str(corpus.source),
        "vocab_size": int(corpus.vocab_size),
        "torch": torch.__version__,
    }
    return out


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def run_summary(
    cfg: TrainConfig,
    *,
    world: int,
    tokens: int,
    wall_s: float,
    train_s: float,
    eval_s: float,
    val_start: float,
    val_end: float,
    per_rank: list[dict[str, Any]],
    n_params: int,
    ceiling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    workers = []
    for r in sorted(per_rank, key=lambda d: d["rank"]):
        workers.append(
            {
                **r,
                "payload_bytes_per_step": r["payload_bytes"] / cfg.steps,
                "wire_bytes_per_step": r["wire_bytes"] / cfg.steps,
            }
        )
    keys = (
        "collectives",
        "payload_bytes",
        "wire_bytes",
        "payload_bytes_per_step",
        "wire_bytes_per_step",
        "blocked_s",
        "in_flight_s",
        "hidden_fraction",
        "rounds",
    )
    skipped = max((int(w.get("skipped_updates", 0)) for w in workers), default=0)
    mean = {k: _mean([w[k] for w in workers]) for k in keys}
    checksums = {w.get("params_checksum") for w in workers}
    tokens_per_s = tokens / train_s if train_s > 0 else None
    entry = REGISTRY[cfg.algo]
    if ceiling is not None and tokens_per_s is not None:
        ceiling["ratio"] = tokens_per_s / ceiling["tokens_per_s"]
    return {
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "workers": world,
        "steps": cfg.steps,
        "sync_every": {"every-step": 1, "every-step-gather": 1, "never": None}.get(
            entry.schedule, cfg.sync_every
        ),
        "link": None if cfg.link is None else f"{cfg.link} (emulated)",
        "compression": cfg.compression if entry.compressible else None,
        "parameters": n_params,
        "tokens": tokens,
        "wall_time_s": wall_s,
        "train_time_s": train_s,
        "eval_time_s": eval_s,
        "tokens_per_s": tokens_per_s,
        "ceiling": ceiling,
        "val_loss_initial": val_start,
        "val_loss_final": val_end,
        "skipped_updates": skipped,
        "replicas_identical": len(checksums) == 1,
        "layout": _layout_summary(cfg, world, workers, mean),
        "comm_mean": mean,
        "comm_per_worker": workers,
    }


def _layout_summary(
    cfg: TrainConfig, world: int, workers: list[dict[str, Any]], mean: dict[str, Any]
) -> dict[str, Any] | None:
    """The node layout for ``summary.json`` (``None`` for the flat layout without ZeRO):
    ``comm_mean`` then counts what crosses nodes, ``intra_node`` DDP inside them."""
    if cfg.nodes == 1 and cfg.node_sharding == "none":
        return None
    per_node = cfg.procs_per_node if cfg.nodes > 1 else world
    assert per_node is not None
    intra = [w["intra_node"] for w in workers if w.get("intra_node") is not None]
    intra_mean = None
    if intra:
        keys = ("collectives", "payload_bytes", "wire_bytes", "blocked_s", "in_flight_s")
        intra_mean = {k: _mean([d[k] for d in intra]) for k in keys}
        for key in ("payload_bytes", "wire_bytes"):
            intra_mean[f"{key}_per_step"] = (intra_mean[key] or 0.0) / cfg.steps
    cross_wire = mean.get("wire_bytes")
    return {
        "nodes": cfg.nodes,
        "procs_per_node": per_node,
        "node_sharding": cfg.node_sharding,
        "across_nodes": cfg.algo,
        "link_per_process": (
            node_link(EmulatedLink.parse(cfg.link), cfg).name if cfg.link is not None else None
        ),
        "cross_node_wire_bytes_per_node": (
            per_node * cross_wire if cfg.hierarchical and cross_wire is not None else None
        ),
        "intra_node": intra_mean,
    }


# --- the table ``lowcomm train`` prints -------------------------------------------------------


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
    h = summary.get("sync_every")
    sync = "every step" if h == 1 else f"every {h} steps"
    if h is None:
        sync = "never: the no-sync ceiling"
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
