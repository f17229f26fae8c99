"""What a ``lowcomm train`` job reports: rank 0's progress while it runs (``metrics.jsonl``
records and the progress bar, :class:`Progress`), the files that describe the run
(``config.json``: :func:`resolved_config`; ``summary.json``: :func:`run_summary`), and the final
table the command prints from ``summary.json`` (:func:`format_summary`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.link import EmulatedLink
from lowcomm.registry import REGISTRY
from lowcomm.train.checkpoint import complete_checkpoints
from lowcomm.train.config import TrainConfig
from lowcomm.train.metrics import MetricsWriter, write_json
from lowcomm.train.nodes import describe_layout, node_link

__all__ = [
    "LossWatch",
    "Progress",
    "divergence",
    "divergence_text",
    "failed_summary",
    "format_failed",
    "format_summary",
    "resolved_config",
    "run_summary",
]

logger = logging.getLogger(__name__)


LONG_ETA_S = 7 * 86400.0
"""A run whose steps left would take longer than this (a week) is told so at its first record."""


def _duration(seconds: float) -> str:
    days = seconds / 86400
    if days >= 365.25:
        return f"{days / 365.25:,.1f} years"
    return f"{days:,.1f} days"


class LossWatch:
    """Every rank's watch on its own training loss: the first and last step at which it was NaN
    or Inf, kept on the device (no sync per step; read once at the end)."""

    def __init__(self, device: torch.device, state: dict[str, int] | None = None) -> None:
        self._steps = torch.zeros(2, dtype=torch.int64, device=device)  # first, last; 0: never
        if state is not None:
            self._steps.copy_(torch.tensor([state["first"], state["last"]]))

    def step(self, step: int, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).reshape(())
        first, last = self._steps[0], self._steps[1]
        first.copy_(torch.where(bad & (first == 0), step, first))
        last.copy_(torch.where(bad, step, last))

    def state_dict(self) -> dict[str, int]:
        first, last = (int(v) for v in self._steps.tolist())
        return {"first": first, "last": last}


EXPLODED = 2.0
"""A run whose final validation loss exceeds this multiple of its initial one diverged (an
untrained model's loss is about ln(vocabulary size); training never ends far above it)."""


def divergence(
    per_rank: list[dict[str, Any]],
    *,
    steps: int,
    tail: int,
    val_start: float,
    val_end: float,
) -> dict[str, Any] | None:
    """What ``summary.json`` says of non-finite or exploding losses (``None``: nothing).

    ``per_rank``: each rank's ``{"rank", "nonfinite": LossWatch.state_dict()}``. The run
    **diverged** when the final validation loss is not finite or above :data:`EXPLODED` times
    the initial one, or some rank's training loss was still NaN or Inf in the last ``tail``
    steps (the final record's); otherwise a non-finite loss earlier was recovered from (its
    update skipped)."""
    seen = [(r["nonfinite"]["first"], r["rank"], r["nonfinite"]["last"]) for r in per_rank]
    seen = [s for s in seen if s[0] > 0]
    exploded = (
        math.isfinite(val_end) and math.isfinite(val_start) and val_end > EXPLODED * val_start
    )
    if not seen and math.isfinite(val_end) and not exploded:
        return None
    first = min(seen) if seen else None
    last = max(s[2] for s in seen) if seen else None
    still = last is not None and last > steps - tail
    return {
        "diverged": still or not math.isfinite(val_end) or exploded,
        "first_step": first[0] if first else None,
        "first_rank": first[1] if first else None,
        "last_step": last,
        "val_loss_finite": math.isfinite(val_end),
        "val_loss_exploded": exploded,
    }


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
        self.lost_s = 0.0
        """Time lost to failures: the work redone after a restart and the restart itself."""
        self._loss_sum = torch.zeros((), device=device)
        self._losses = 0  # the steps whose loss is in the sum (dynamic local steps pass some)
        self.steps_done: Callable[[int], float] = float
        """Inner steps per worker done after a step (the tokens are counted from it): the
        step itself, or with dynamic local steps every worker's steps over their number."""
        self.pace: Callable[[], list[int] | None] = lambda: None
        """Every worker's inner steps in the current round (dynamic local steps)."""
        self.cost_error: Callable[[], float | None] = lambda: None
        """Documents with the online refit: the cost model's RMS relative error over the
        ranks on the last plan unit, before it was refitted with it."""
        self._last_step = 0  # the step of the last record
        self._first_step = 0  # the step this run started after (a resumed run's checkpoint)
        self._segment = (time.perf_counter(), 0.0)  # when this run's steps began, eval_s then
        self._eta_told = False
        self.bar = None
        if sys.stderr.isatty() and not cfg.quiet:
            from tqdm.auto import tqdm

            layout = f"x{world}" if cfg.nodes == 1 else f"{cfg.nodes}x{cfg.procs_per_node}"
            self.bar = tqdm(
                total=cfg.steps, desc=f"{cfg.algo} {layout}", unit="step", dynamic_ncols=True
            )

    def start(self, t_start: float) -> None:
        self.t_start = t_start
        self._segment = (time.perf_counter(), self.eval_s)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the records exactly (checkpoint ``progress``)."""
        return {
            "loss_sum": self._loss_sum.detach().cpu().clone(),
            "losses": self._losses,
            "last_step": self._last_step,
            "elapsed_s": time.perf_counter() - self.t_start,
            "eval_s": self.eval_s,
            "loss": self.loss,
            "val": self.val,
            "val_start": self.val_start,
            "resumed_at": list(self.resumed_at),
            "lost_s": self.lost_s,
        }

    def resume(self, step: int, state: dict[str, Any], source: str | None, restart: int) -> float:
        """Continue from a checkpoint's :meth:`state_dict` at ``step``; write a ``resume``
        record. Returns the elapsed time the stopped run had reached (the new start is that much
        earlier, so times continue)."""
        self._loss_sum.copy_(state["loss_sum"])
        self._last_step = int(state["last_step"])
        self._losses = int(state.get("losses", step - self._last_step))
        self.eval_s = float(state["eval_s"])
        self.loss, self.val = float(state["loss"]), float(state["val"])
        self.val_start = float(state["val_start"])
        self.resumed_at = [*state.get("resumed_at", []), step]
        self.lost_s = float(state.get("lost_s", 0.0))
        self._first_step = step
        self.writer.write(
            {"kind": "resume", "step": step, "checkpoint": source, "restart": restart}
        )
        if self.bar is not None:
            self.bar.update(step)
        return float(state["elapsed_s"])

    def jumped(self, step: int) -> None:
        """This replica was healed to its donor's ``step`` (an elastic job): the loss summed
        since the last record was its own, before the heal, and is dropped; the next record
        covers the steps after ``step``."""
        self._loss_sum.zero_()
        self._losses = 0
        self._last_step = step
        self.writer.write({"kind": "healed", "step": step, "time": time.time()})
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def _tokens(self, step: int) -> int:
        return round(self.steps_done(step) * self.tokens_per_step)

    def _tokens_per_s(self, step: int) -> float:
        train_s = time.perf_counter() - self.t_start - self.eval_s
        return self._tokens(step) / max(train_s, 1e-9)

    def _postfix(self, step: int) -> dict[str, str]:
        hidden = self.stats.hidden_fraction
        out = {
            "loss": f"{self.loss:.3f}",
            "val": f"{self.val:.3f}",
            "tok/s": f"{self._tokens_per_s(step):,.0f}",
            # rank 0's own counters (the summary gives the mean over the workers)
            "hidden r0": "-" if hidden is None else f"{hidden:.0%}",
        }
        plan = self.pace()
        if plan is not None:
            out["steps/round"] = "/".join(str(n) for n in plan)
        error = self.cost_error()
        if error is not None:
            out["cost err"] = f"{error:.0%}"
        return out

    def step(self, step: int, loss: torch.Tensor | None, lr: float, *, flush: bool = False) -> None:
        """Add step ``step``'s loss (``None``: rank 0 passed this position, dynamic local
        steps); record the mean since the last record every ``log_every`` steps, or now when
        ``flush``."""
        if loss is not None:
            self._loss_sum.add_(loss.detach())
            self._losses += 1
        if not flush and step % self.cfg.log_every:
            return
        n = step - self._last_step
        # the one device sync per record
        self.loss = float(self._loss_sum) / self._losses if self._losses else float("nan")
        self._loss_sum.zero_()
        self._losses = 0
        self._last_step = step
        if not self._eta_told:
            self._eta_told = True
            self._tell_long_eta(step)
        self.writer.write(
            {
                "kind": "step",
                "step": step,
                "steps": n,
                "loss": self.loss,
                "lr": lr,
                "tokens": self._tokens(step),
                "elapsed_s": time.perf_counter() - self.t_start,
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(step), refresh=False)
            self.bar.update(n)

    def _tell_long_eta(self, step: int) -> None:
        """Once, at the first record: warn when the steps left would take more than
        :data:`LONG_ETA_S` at the step time measured so far."""
        done = step - self._first_step
        train_s = time.perf_counter() - self._segment[0] - (self.eval_s - self._segment[1])
        if done <= 0 or train_s <= 0:
            return
        eta_s = (self.cfg.steps - step) * train_s / done
        if eta_s > LONG_ETA_S:
            logger.warning(
                "at the measured %.3g s per step, the %s steps left take %s; stop with Ctrl-C "
                "and choose fewer --steps if that is not what you meant",
                train_s / done,
                f"{self.cfg.steps - step:,}",
                _duration(eta_s),
            )

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
                "tokens": self._tokens(step),
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
                "step %d/%d  loss %s  val %s  tok/s %s  hidden %s (rank 0)%s%s",
                step,
                self.cfg.steps,
                p["loss"],
                p["val"],
                p["tok/s"],
                p["hidden r0"],
                f"  steps/round {p['steps/round']}" if "steps/round" in p else "",
                f"  cost model error {p['cost err']}" if "cost err" in p else "",
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
    kwargs = cfg.algorithm_kwargs() if cfg.algo not in ("ddp", "none") else {}
    warm = cfg.sync_warmup_steps()
    return {
        "status": "finished",
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "workers": world,
        "steps": cfg.steps,
        "sync_every": {"every-step": 1, "every-step-gather": 1, "never": None}.get(
            entry.schedule, cfg.sync_every
        ),
        "sync_warmup": (
            {"steps": warm, "compression": kwargs.get("sync_warmup_compression")} if warm else None
        ),
        "link": None if cfg.link is None else f"{cfg.link} (emulated)",
        "compression": _compression_label(cfg, entry.compressible, kwargs),
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
        "work": _work_summary(cfg, workers, kwargs),
    }


def _work_summary(
    cfg: TrainConfig, workers: list[dict[str, Any]], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """What each worker did (outer algorithms): its inner steps, tokens, mean steps per round
    (the warm start's included) and time blocked in collectives (a straggler's wait shows on the
    others), the ``speeds`` emulated and whether rounds were dynamic."""
    if not workers or workers[0].get("inner_steps") is None:
        return None
    steps = [int(w["inner_steps"]) for w in workers]
    return {
        "local_steps": kwargs.get("local_steps", "fixed"),
        "speeds": cfg.speeds,
        "inner_steps": steps,
        "tokens": [n * cfg.batch_size * cfg.block_size for n in steps],
        # over the whole job, warm start included (positions: step() calls, H per round)
        "steps_per_round": [
            n * cfg.sync_every / w["positions"] if w.get("positions") else None
            for n, w in zip(steps, workers)
        ],
        "blocked_s": [w.get("blocked_s") for w in workers],
    }


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


def _compression_label(cfg: TrainConfig, compressible: bool, kwargs: dict[str, Any]) -> str | None:
    """What the summary names as the job's compression: the codec spec; DeMo's own top-k of
    DCT coefficients; ``None`` for fp32 (and for the no-sync ceiling, which sends nothing)."""
    if cfg.algo == "demo":
        from lowcomm.optim.demo import DeMoConfig

        defaults = DeMoConfig()
        k = kwargs.get("compression_topk", defaults.compression_topk)
        chunk = kwargs.get("compression_chunk", defaults.compression_chunk)
        return f"DeMo: top {k} DCT coefficients per chunk (chunk side up to {chunk})"
    return cfg.compression if compressible else None


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


def failed_summary(cfg: TrainConfig, error: str) -> tuple[dict[str, Any] | None, str | None]:
    """What a failed run had measured, from its ``metrics.jsonl``: the last step reached, its
    training and validation losses, tokens/s, and the last complete checkpoint to resume from.
    Written as ``summary.json`` (``"status": "failed"``) where it can be; returns the summary
    and the path written, or ``None`` where it could not be (a full disk). ``(None, None)``
    when the run measured nothing (it failed before its first evaluation)."""
    out = cfg.out or "."
    records = []
    try:
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):  # a line torn by the failure
                    records.append(json.loads(line))
    except OSError:
        pass
    if not records:
        return None, None
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    last = steps[-1] if steps else None
    trained = [r for r in evals if r.get("step", 0) > 0]
    summary: dict[str, Any] = {
        "status": "failed",
        "error": error,
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "steps": cfg.steps,
        "steps_done": last["step"] if last else 0,
        "train_loss_last": last["loss"] if last else None,
        "tokens": last["tokens"] if last else 0,
        "tokens_per_s": (
            last["tokens"] / last["elapsed_s"] if last and last.get("elapsed_s") else None
        ),
        "val_loss_initial": evals[0]["val_loss"] if evals else None,
        "val_loss_last": trained[-1]["val_loss"] if trained else None,
        "val_step_last": trained[-1]["step"] if trained else None,
        "checkpoint": _last_checkpoint(out),
    }
    try:
        path = os.path.join(out, "summary.json")
        write_json(path, summary)
    except OSError:
        return summary, None
    return summary, path


def _last_checkpoint(out: str) -> str | None:
    found = complete_checkpoints(out)
    return found[-1][1] if found else None


def format_failed(summary: dict[str, Any], path: str | None) -> str:
    """One line of what a failed run had measured (:func:`failed_summary`)."""
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
        else "no complete checkpoint"
    )
    kept = f"kept in {path}" if path else "summary.json could not be written"
    return f"lowcomm train: {summary.get('name')} failed; measured before ({kept}): " + ", ".join(
        parts
    )


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


def _loss(value: float | None) -> str:
    return "NaN/Inf" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _sync_text(summary: dict[str, Any]) -> str:
    h = summary.get("sync_every")
    if h is None:
        return "never: the no-sync ceiling"
    return "every step" if h == 1 else f"every {h} steps"


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


def _tuning_rows(tuning: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The settings chosen from the link (``--tune-link``), if any were looked for."""
    if not tuning:
        return []
    chosen = ", ".join(
        f"{k.replace('_', ' ')} {'none' if v is None else v}"
        for k, v in tuning.get("settings", {}).items()
    )
    predicted = (
        f"predicted {tuning['step_s'] * 1e3:.0f} ms a step against {tuning['compute_s'] * 1e3:.0f}"
        " ms of compute"
    )
    return [("tuned to link", f"{tuning['link']}: {chosen or 'the defaults'} ({predicted})")]


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
        *_tuning_rows(summary.get("link_tuning")),
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
        ("hidden fraction", "-" if hidden is None else f"{hidden:.1%} (mean of the workers)"),
        *(
            [("intra-node wire / worker", f"{_mb(intra['wire_bytes'])} (DDP, every step)")]
            if intra
            else []
        ),
        ("wall time", wall),
        ("output", str(summary.get("out"))),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"lowcomm train: {summary.get('name')} {summary.get('status', 'finished')}"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
