"""LocalSGD: every H inner steps, replace each worker's parameters by the mean over workers.

Papers: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020
(https://arxiv.org/abs/1808.07217); Stich, "Local SGD Converges Fast and Communicates Little"
(https://arxiv.org/abs/1805.09767). On the engine: one fragment, no overlap, and the average is
the anchor (no outer update). Buffers are not averaged. ``finish()`` averages once more if steps
were taken since the last round.

Numeric guard: with no anchor to fall back on, a non-finite average (``nan_policy="skip"``) is
taken again over the ranks whose parameters are finite (one more all-reduce, only then) and the
ranks that diverged zero the non-finite values of their inner-optimizer state; with no finite
rank left the run stops with :class:`~lowcomm.guard.NonFiniteError`.

Example::

    algo = lowcomm.LocalSGD(model, inner, sync_every=8)
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.guard import NonFiniteError
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import AnyFragment, Sync
from lowcomm.outer.hparams import OuterConfig

__all__ = ["LocalSGD", "LocalSGDConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig(OuterConfig):
    """LocalSGD's hyperparameters: the engine's own."""


class LocalSGD(OuterAlgorithm):
    """θᵢ ← mean(θ) every ``sync_every`` (H) inner steps."""

    name = "localsgd"
    Config: ClassVar[type[OuterConfig]] = LocalSGDConfig
    _averages_params = True
    _discards_partial_round = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.sync_every == 1:
            message = "LocalSGD with sync_every=1 averages parameters after every step; "
            warnings.warn(
                message + "DistributedDataParallel does the same with less work", stacklevel=2
            )
        self._last_sync = 0

    def _apply(self, k: int) -> None:
        super()._apply(k)
        self._last_sync = self.local_step

    def _after_finish(self, drained: bool) -> None:
        # Average once more if steps were taken since the last round, so that every rank holds
        # the same parameters and no local work is lost.
        if self.local_step > self.warmup and self.local_step != self._last_sync:
            self._quorum()  # (with fault tolerance; every replica finishes at this step)
            self._launch(0)
            self._apply(0)

    def _on_non_finite(self, frag: AnyFragment, sync: Sync) -> None:
        super()._on_non_finite(frag, sync)
        # the anchor is the send buffer: average again over the ranks whose θ is finite
        buf = frag.anchor
        buf.copy_from(self.params)
        if not sync.own_ok:
            torch._foreach_zero_(buf.buffers)
        count = torch.tensor([1.0 if sync.own_ok else 0.0], device=buf.device)
        self.comm.all_reduce_mean([*buf.buffers, count])
        finite = round(float(count) * self.world_size)
        if finite == 0:
            raise NonFiniteError(
                "LocalSGD: every rank's parameters hold NaN or Inf; nothing finite is left to "
                "average (lower the learning rate, check the data)"
            )
        torch._foreach_mul_(buf.buffers, self.world_size / finite)
        message = "LocalSGD: %s averaged over the %d of %d ranks whose parameters are finite"
        logger.warning(message, sync.label, finite, self.world_size)

    def _extra_state(self) -> dict[str, Any]:
        return {"last_sync": self._last_sync}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._last_sync = int(state.get("last_sync", state["local_step"]))
