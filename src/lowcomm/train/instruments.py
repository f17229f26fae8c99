"""The instrumentation of a ``lowcomm train`` job: what it records and shows, made once from the
configuration and the other parts (:meth:`Instruments.create`).

Rank 0 writes ``config.json`` and ``metrics.jsonl`` (:class:`~lowcomm.train.report.Progress`:
the step and evaluation records, an elastic replica's sync and heal records, the progress bar)
and, with ``--tensorboard``, lowcomm's scalars
(:class:`~lowcomm.loggers.MetricsLogger`: once per outer step, or every
``log_every`` steps for ddp and none). Every rank watches its own training loss for non-finite
values (:class:`~lowcomm.train.report.LossWatch`) and, in tests and benchmarks, injects the
fault :data:`~lowcomm.train.faults.FAULT_ENV` names for it.

Times: a run's clock starts when its steps start; a resumed run's continues from the elapsed
time its checkpoint recorded, and a worker group restarted after a failure counts from the
job's first start (the work lost and the restart itself included in its time).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.loggers import EveryStep, MetricsLogger
from lowcomm.runfiles import write_json
from lowcomm.train.config import TrainConfig
from lowcomm.train.failures import attempt
from lowcomm.train.faults import inject_fault
from lowcomm.train.report import LossWatch, Progress, resolved_config
from lowcomm.train.source import DataSource
from lowcomm.train.synchronisation import Synchronisation
from lowcomm.train.topology import Topology

__all__ = ["Instruments"]

logger = logging.getLogger(__name__)


class Instruments:
    """One rank's records, progress, loss watch and injected fault (module docstring)."""

    progress: Progress | None
    """Rank 0's records; ``None`` elsewhere."""
    tensorboard: MetricsLogger | None
    """Rank 0's TensorBoard scalars (``--tensorboard``); ``None`` elsewhere and without it."""
    every_step: EveryStep | None
    """Its source without an outer algorithm or DeMo (ddp, none): every step is a sync."""
    fault: tuple[int, str] | None
    """The step and mode of the fault this rank injects after a step (tests), if any."""
    watch: LossWatch
    started_at: float
    """Wall-clock time the run started (its first attempt's, in a restarted worker group)."""
    t_start: float = 0.0
    """``perf_counter`` time the run's clock counts from (:meth:`start`)."""
    cfg: TrainConfig
    device: torch.device

    @classmethod
    def create(
        cls,
        cfg: TrainConfig,
        topology: Topology,
        sync: Synchronisation,
        data: DataSource,
        *,
        n_params: int,
        start: int,
        state: dict[str, Any] | None,
        device: torch.device,
    ) -> Instruments:
        """Rank 0 writes ``config.json`` and opens ``metrics.jsonl`` (appending when resuming
        from ``state`` at step ``start``); every rank arms its fault, if any."""
        out = cls()
        out.cfg, out.device = cfg, device
        out.progress = out.tensorboard = out.every_step = None
        out.started_at = time.time()
        if topology.is_main:
            assert cfg.out is not None
            config = resolved_config(cfg, topology.world, data.corpus)
            if attempt() > 0:  # a restarted worker group: the run started with attempt 0
                out.started_at = _started_at(cfg.out) or out.started_at
            config["resolved"]["started_at"] = out.started_at
            write_json(os.path.join(cfg.out, "config.json"), config)
            logger.info(
                "lowcomm train: %s, %s (%s), %.2f M parameters, corpus %s (%s), %d steps of %d "
                "tokens per worker",
                cfg.algo,
                topology.describe(),
                dist.get_backend(),
                n_params / 1e6,
                data.corpus.source,
                data.describe(),
                cfg.steps,
                cfg.batch_size * cfg.block_size,
            )
            out.progress = Progress(
                cfg,
                topology.world,
                topology.tokens_per_step,
                sync.stats,
                device,
                append=state is not None,
            )
            out.progress.steps_done = sync.steps_done
            algo = sync.algo
            if algo is not None and algo.pace is not None:
                pace = algo.pace
                out.progress.pace = lambda: pace.report(algo.local_step)["steps_per_round"]
            docs = data.docs
            if docs is not None and docs.refit is not None:
                out.progress.cost_error = lambda: docs.last_error
            if cfg.tensorboard is not None:
                out.tensorboard = out._tensorboard(cfg, sync, start, resumed=state is not None)
        out.fault = topology.fault(sync.algo)
        out.watch = LossWatch(device, state.get("nonfinite") if state is not None else None)
        return out

    def _tensorboard(
        self, cfg: TrainConfig, sync: Synchronisation, start: int, *, resumed: bool
    ) -> MetricsLogger:
        """Rank 0's scalars, once per outer step (every ``log_every`` steps for ddp and none);
        a resumed run hides what the stopped one wrote after the checkpoint."""
        assert cfg.tensorboard is not None
        source: Any = sync.outer_source
        every = 1
        if source is None:
            source = self.every_step = EveryStep(sync.stats)
            source.outer_step = start
            every = cfg.log_every
        purge = int(source.outer_step) + 1 if resumed else None
        return MetricsLogger(source, tensorboard=cfg.tensorboard, every=every, purge_step=purge)

    # --- the clock ----------------------------------------------------------------------------

    def start(self, start: int, state: dict[str, Any] | None, source: str | None) -> float:
        """Start the run's clock before its first step (``start``: the last step done before
        it); returns the ``perf_counter`` time it counts from."""
        progress = self.progress
        elapsed_before = 0.0
        if progress is not None and state is not None:
            elapsed_before = progress.resume(start, state["progress"], source, attempt())
        if progress is not None and attempt() > 0:
            # A restarted group continues the same job: its time runs from the job's start,
            # the work lost since the checkpoint and the restart itself included (a resume
            # the user asks for later does not count the time in between).
            since_start = time.time() - self.started_at
            progress.lost_s += max(0.0, since_start - elapsed_before)
            elapsed_before = max(elapsed_before, since_start)
        self.t_start = time.perf_counter() - elapsed_before
        if progress is not None:
            progress.start(self.t_start)
        return self.t_start

    # --- every step ---------------------------------------------------------------------------

    def step(self, step: int, loss: torch.Tensor | None, lr: float, *, flush: bool) -> None:
        """Record step ``step`` (rank 0: every ``log_every`` steps and when ``flush``;
        ``loss`` ``None``: this rank passed the position, dynamic local steps)."""
        if self.progress is not None:
            self.progress.step(step, loss, lr, flush=flush)
        if self.tensorboard is not None:
            if self.every_step is not None:
                self.every_step.step()
            self.tensorboard.step(loss)

    def trained(self, step: int, loss: torch.Tensor) -> None:
        """This rank's loss of ``step`` (watched for non-finite values)."""
        self.watch.step(step, loss)

    def synced(self, record: dict[str, Any] | None) -> None:
        """An elastic replica's record of the sync it applied."""
        if record is not None and self.progress is not None:
            self.progress.writer.write(record)

    def jumped(self, step: int) -> None:
        """This replica was healed to its donor's ``step``: the records continue there."""
        if self.progress is not None:
            self.progress.jumped(step)

    def inject(self, step: int, rank: int, model: torch.nn.Module) -> None:
        """Inject this rank's fault if ``step`` is its step (tests)."""
        if self.fault is not None and self.fault[0] == step:
            inject_fault(self.fault[1], rank, step, self.cfg.collective_timeout, model=model)

    def paused(self, seconds: float) -> None:
        """``seconds`` of the run were not training (a ceiling segment in its middle)."""
        if seconds and self.progress is not None:
            self.progress.paused(seconds)

    def eval(self, step: int, val_loss: float, rounds: int, eval_s: float) -> None:
        if self.progress is not None:
            self.progress.eval(step, val_loss, rounds, eval_s)
        if self.tensorboard is not None:
            self.tensorboard.eval(val_loss)

    # --- the end ------------------------------------------------------------------------------

    def synced_at_end(self) -> None:
        """The scalars of the syncs ``finish()`` applied."""
        if self.tensorboard is not None:
            self.tensorboard.step()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.progress is not None:
            self.progress.close()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint."""
        return {
            "progress": self.progress.state_dict() if self.progress is not None else None,
            "nonfinite": self.watch.state_dict(),
        }


def _started_at(out: str) -> float | None:
    """When the run in ``out`` started (``config.json``; wall-clock seconds), if recorded."""
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get("resolved", {}).get("started_at")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
