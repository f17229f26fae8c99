"""What the trainer integrations share, whatever the trainer: a :class:`Driver` builds the
algorithm over the trainer's model and optimizer, turns off DDP's per-step gradient all-reduce,
steps the algorithm by the trainer's global step, saves and restores every rank's own state, and
feeds the loggers.

Why by the global step: a ``GradScaler`` skips ``optimizer.step()`` on a rank whose gradients
overflowed, and without DDP that is decided per rank. A step post-hook on the optimizer would
then let the ranks' step counts drift apart and their collectives stop matching (a hang); the
global step advances alike on every rank. For the same reason the warm start's gradient mean
(``sync_warmup``) is taken before every optimizer step by the trainer's own hook, not in the
optimizer's step pre-hook (:meth:`~lowcomm.outer.engine.OuterAlgorithm.warm_start_by_caller`).

Every rank's state differs (its parameters inside a round, its inner optimizer's moments), so
each writes its own file into a folder that goes with the trainer's checkpoint,
``<folder>/rank<r>.pt`` (:func:`state_path`), atomically: the model, the inner optimizer, the
learning-rate scheduler, the gradient scaler and the algorithm, with the global step and world
size it was saved at.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lowcomm.loggers import MetricsLogger, merged_metrics
from lowcomm.optim import DeMo
from lowcomm.registry import REGISTRY, outer_names
from lowcomm.runfiles import load_checkpoint, save_checkpoint
from lowcomm.torchtitan import resolve_aliases

__all__ = ["STATE_FOLDER", "Driver", "state_path", "unwrap_optimizer"]

logger = logging.getLogger(__name__)

STATE_FOLDER = "lowcomm"
"""The name of the folder that holds every rank's lowcomm state: ``checkpoint-N/lowcomm/``
(Hugging Face), ``<file>.ckpt.lowcomm/`` (Lightning)."""

FORMAT = 1

_NOT_OURS = "resume from a checkpoint this trainer saved with lowcomm attached, or start afresh"


def state_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` keeps its state in the state folder ``folder``."""
    return os.path.join(folder, f"rank{rank}.pt")


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a trainer's wrapper (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the one whose ``step()`` updates the parameters."""
    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"lowcomm needs the trainer's optimizer to be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    return optimizer


def _choices() -> str:
    return ", ".join([*outer_names(), "demo"])


class Driver:
    """One rank's lowcomm inside a trainer (module docstring). ``algorithm``: a registry name
    (``co2``, ``diloco``, ``streaming``, …, or ``demo``); ``options``: its keywords (those of
    :class:`lowcomm.CO2` and the rest, torchtitan's names accepted); ``tensorboard`` /
    ``jsonl``: where rank 0 writes lowcomm's scalars (:mod:`lowcomm.loggers`)."""

    def __init__(
        self,
        algorithm: str,
        options: Mapping[str, Any],
        *,
        process_group: Any = None,
        tensorboard: str | None = None,
        jsonl: str | None = None,
    ) -> None:
        if algorithm in ("ddp", "none"):
            raise ValueError(
                f"algorithm {algorithm!r} is no lowcomm algorithm: the trainer runs DDP itself "
                f"without lowcomm; choose one of {_choices()}"
            )
        if algorithm not in REGISTRY:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {_choices()}")
        self.entry = REGISTRY[algorithm]
        self.name = algorithm
        self.options = resolve_aliases(options, what=f"lowcomm {algorithm}")
        if self.entry.is_outer:
            assert self.entry.cls is not None
            self.entry.cls.validate(**self.entry.fixed, **self.options)
        elif self.options:
            raise ValueError(
                "demo takes its settings from the lowcomm.DeMo optimizer given to the trainer, "
                f"not as keywords here; got {', '.join(sorted(self.options))}"
            )
        self.process_group = process_group
        self.tensorboard = tensorboard
        self.jsonl = jsonl
        self.algo: Any = None
        """The outer algorithm, or the DeMo optimizer; ``None`` before :meth:`start`."""
        self.log: MetricsLogger | None = None
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        """The trainer's DDP wrapper, its gradient all-reduce turned off."""
        self.seen = 0
        """The trainer's global step the algorithm has been stepped to."""
        self.finished = False
        self._loss: torch.Tensor | float | None = None

    @property
    def sync_every(self) -> int | None:
        """H (``None`` for DeMo, which syncs every step)."""
        return getattr(self.algo, "sync_every", None) or self.options.get("sync_every")

    # -- set-up ---------------------------------------------------------------------------------

    def start(
        self,
        model: nn.Module,
        optimizer: Any,
        *,
        ddp: nn.Module | None,
        global_step: int,
        rank: int,
    ) -> None:
        """Build the algorithm over ``model`` (the unwrapped module) and the torch optimizer in
        ``optimizer``; turn off the gradient all-reduce of ``ddp`` (the trainer's
        ``DistributedDataParallel``, if any). Call before the first step (resumed runs: then
        :meth:`load`); again only after :meth:`finish`, for another training run."""
        if self.algo is not None and not self.finished:
            raise RuntimeError("lowcomm is already running in this trainer")
        self.close()  # a finished earlier run's logger
        self.finished = False
        inner = unwrap_optimizer(optimizer)
        self.ddp = ddp if isinstance(ddp, nn.parallel.DistributedDataParallel) else None
        if self.ddp is not None:
            # lowcomm synchronises instead: no gradient all-reduce in backward (DDP's no_sync
            # context restores this value on exit, so gradient accumulation keeps it off)
            self.ddp.require_backward_grad_sync = False
        if self.entry.is_outer:
            assert self.entry.cls is not None
            kwargs = {**self.entry.fixed, **self.options}
            self.algo = self.entry.cls(model, inner, process_group=self.process_group, **kwargs)
            self.algo.warm_start_by_caller()
        else:
            if not isinstance(inner, DeMo):
                raise ValueError(
                    "algorithm 'demo' needs lowcomm.DeMo as the trainer's optimizer (e.g. "
                    "Trainer(..., optimizers=(lowcomm.DeMo(model.parameters(), lr=1e-3), None))), "
                    f"got {type(inner).__name__}"
                )
            self.algo = inner
        self.seen = global_step
        if rank == 0 and (self.tensorboard is not None or self.jsonl is not None):
            resumed = global_step > 0
            self.log = MetricsLogger(
                self.algo,
                tensorboard=self.tensorboard,
                jsonl=self.jsonl,
                purge_step=int(self.algo.outer_step) + 1 if resumed else None,
                jsonl_append=resumed,
            )

    def warn_mid_round(self, what: str, every: int | None) -> None:
        """Warn when ``what`` (saves, evaluations) every ``every`` steps falls inside rounds."""
        h = self.sync_every
        if h is None or h <= 1 or not every or every % h == 0:
            return
        warnings.warn(
            f"lowcomm {self.name}: {what} every {every} steps is not a multiple of sync_every="
            f"{h}, so some fall inside a round, where every rank's model differs from the "
            f"others' (and from the consensus): use a multiple of {h}",
            stacklevel=3,
        )

    # -- every step -----------------------------------------------------------------------------

    def before_optimizer_step(self) -> None:
        """Before every optimizer step, on every rank: the warm start's gradient mean."""
        if self.entry.is_outer and self.algo is not None:
            self.algo.before_inner_step()

    def add_loss(self, loss: torch.Tensor | float) -> None:
        """A micro-batch's training loss as the trainer accounts it (summed into the step's)."""
        value = loss.detach().float() if isinstance(loss, torch.Tensor) else float(loss)
        self._loss = value if self._loss is None else self._loss + value

    def after_step(self, global_step: int) -> None:
        """After the trainer's optimizer step (skipped or not) that made ``global_step``."""
        assert self.algo is not None, "start() first"
        if self.entry.is_outer:
            while self.seen < global_step:
                self.algo.step()
                self.seen += 1
        self.seen = max(self.seen, global_step)
        loss, self._loss = self._loss, None
        if self.log is not None:
            self.log.step(loss)

    def finish(self) -> None:
        """Drain what is in flight: afterwards every rank holds the same model. Idempotent."""
        if self.algo is None or self.finished:
            return
        self.finished = True
        self.algo.finish()
        if self.log is not None:
            self.log.step()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def metrics(self) -> dict[str, float]:
        """``lowcomm/<name>`` of this rank, to merge into the trainer's logs."""
        return merged_metrics(self.algo) if self.algo is not None else {}

    def evaluated(self, val_loss: float) -> None:
        if self.log is not None:
            self.log.eval(val_loss)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self, model: nn.Module, trainer_parts: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's whole state: ``model``'s parameters, the inner optimizer, the algorithm
        and ``trainer_parts`` (``{"lr_scheduler": ..., "scaler": ...}``: objects with
        ``state_dict()``, or ``None``)."""
        assert self.algo is not None
        inner = self.algo if not self.entry.is_outer else self.algo.inner
        return {
            "format": FORMAT,
            "algorithm": self.name,
            "world_size": _world_size(),
            "global_step": self.seen,
            "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
            "optimizer": inner.state_dict(),
            "outer": self.algo.state_dict() if self.entry.is_outer else None,
            "finished": self.finished,
            **{k: None if v is None else v.state_dict() for k, v in trainer_parts.items()},
        }

    def save(
        self, folder: str, rank: int, model: nn.Module, trainer_parts: Mapping[str, Any]
    ) -> str:
        """Write this rank's state into the state folder ``folder``, atomically."""
        path = state_path(folder, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_checkpoint(path, self.state_dict(model, trainer_parts))
        return path

    def load(
        self,
        folder: str,
        rank: int,
        model: nn.Module,
        trainer_parts: Mapping[str, Any],
        *,
        global_step: int,
    ) -> None:
        """Restore this rank's state from the state folder ``folder``, saved at the trainer's
        ``global_step``, into ``model``, the optimizer, the algorithm and ``trainer_parts``."""
        assert self.algo is not None, "start() first"
        path = state_path(folder, rank)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"the checkpoint holds no lowcomm state for rank {rank} ({path}): it "
                "was saved by a trainer without lowcomm attached, or the save did not finish on "
                "every rank; resume from a checkpoint saved with lowcomm, or start afresh"
            )
        state = load_checkpoint(
            path, what="lowcomm's state of a trainer checkpoint", hint=_NOT_OURS
        )
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{path} is not lowcomm's state of a trainer checkpoint; {_NOT_OURS}")
        problems = []
        if state.get("algorithm") != self.name:
            problems.append(f"algorithm {state.get('algorithm')!r} (now {self.name!r})")
        if state.get("world_size") != _world_size():
            problems.append(f"world size {state.get('world_size')} (now {_world_size()})")
        if state.get("global_step") != global_step:
            problems.append(f"step {state.get('global_step')} (the trainer's is {global_step})")
        if problems:
            raise ValueError(
                f"{path} was saved with {', '.join(problems)}; resume with the settings and "
                "number of processes it was saved with"
            )
        params = dict(model.named_parameters())
        saved = state["params"]
        if set(saved) != set(params):
            missing = sorted(set(params) ^ set(saved))[:3]
            raise ValueError(f"{path} holds another model's parameters (differing: {missing})")
        if self.entry.is_outer:
            self.algo.load_state_dict(state["outer"])  # checked first: refuses other settings
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name].to(p.device))
        inner = self.algo if not self.entry.is_outer else self.algo.inner
        inner.load_state_dict(state["optimizer"])
        for key, part in trainer_parts.items():
            if part is not None and state.get(key) is not None:
                part.load_state_dict(state[key])
        self.seen = global_step
        self.finished = bool(state.get("finished", False))
        logger.info("lowcomm %s: rank %d resumed from %s", self.name, rank, path)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
