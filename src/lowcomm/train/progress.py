"""Rank 0's progress while a ``lowcomm train`` job runs: ``metrics.jsonl`` records and the
progress bar (:class:`Progress`), every rank's watch on its own training loss
(:class:`LossWatch`), and what ``summary.json`` says of non-finite or exploding losses
(:func:`divergence`)."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lowcomm.runfiles import MetricsWriter
from lowcomm.train.config import TrainConfig

__all__ = ["EXPLODED", "LONG_ETA_S", "LossWatch", "Progress", "divergence"]

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
        self.paused_s = 0.0
        """Time the no-sync ceiling's segments took in the middle of training (not training)."""
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
        self._segment = (time.perf_counter(), 0.0)  # when this run's steps began, excluded_s then
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
        self._segment = (time.perf_counter(), self.excluded_s)

    @property
    def excluded_s(self) -> float:
        """Time since the start that was not training: evaluations and ceiling segments."""
        return self.eval_s + self.paused_s

    def paused(self, seconds: float) -> None:
        """``seconds`` of the run went to something else than training (a ceiling segment)."""
        self.paused_s += seconds

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the records exactly (checkpoint ``progress``)."""
        return {
            "loss_sum": self._loss_sum.detach().cpu().clone(),
            "losses": self._losses,
            "last_step": self._last_step,
            "elapsed_s": time.perf_counter() - self.t_start,
            "eval_s": self.eval_s,
            "paused_s": self.paused_s,
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
        self.paused_s = float(state.get("paused_s", 0.0))
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
        train_s = time.perf_counter() - self.t_start - self.excluded_s
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
        train_s = time.perf_counter() - self._segment[0] - (self.excluded_s - self._segment[1])
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
        # Training time up to this evaluation: wall time less every evaluation (and ceiling
        # segment) so far.
        train_s = now - eval_s - self.t_start - self.excluded_s
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
