"""LocalSGD: every H inner steps, replace each worker's parameters by the mean over workers.

Paper: Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020
(https://arxiv.org/abs/1808.07217); Stich, "Local SGD Converges Fast and Communicates Little"
(https://arxiv.org/abs/1805.09767).

Blocking: the round waits for its all-reduce. Buffers are not averaged. ``finish()`` averages
once more if steps were taken since the last round.

Numeric guard: LocalSGD keeps no anchor to fall back on. When the average holds NaN or Inf
(``nan_policy="skip"``), the round is averaged again over the ranks whose own parameters are
finite (one more all-reduce, only then), every rank takes that average, and the ranks that
diverged zero the non-finite values of their inner-optimizer state. With no finite rank left
the run stops with :class:`~lowcomm.guard.NonFiniteError` whatever the policy.

Example::

    algo = lowcomm.LocalSGD(model, inner, sync_every=8)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        algo.step()
    algo.finish()
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB, Communicator
from lowcomm.guard import NonFiniteError
from lowcomm.outer.base import OuterAlgorithm

__all__ = ["LocalSGD"]

logger = logging.getLogger(__name__)


class LocalSGD(OuterAlgorithm):
    """θᵢ ← mean(θ) every ``sync_every`` (H) inner steps.

    Args:
        model_or_params: an ``nn.Module`` or an iterable of parameters.
        inner_optimizer: the optimizer whose ``step()`` drives the rounds.
        sync_every: H, inner steps per round.
        process_group: the group to average over; ``None`` is WORLD.
        bucket_cap_mb: size cap of one flat fp32 bucket (one collective each).
        nan_policy, check_consistency: the guards every algorithm has (see
            :class:`~lowcomm.outer.base.OuterAlgorithm`).
    """

    name = "localsgd"

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        nan_policy: str = "skip",
        check_consistency: bool = True,
    ) -> None:
        self.validate(sync_every=sync_every, bucket_cap_mb=bucket_cap_mb)
        if sync_every == 1:
            warnings.warn(
                "LocalSGD with sync_every=1 averages parameters after every step; "
                "DistributedDataParallel does the same with less work",
                stacklevel=2,
            )
        super().__init__(
            model_or_params,
            inner_optimizer,
            sync_every=sync_every,
            process_group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            nan_policy=nan_policy,
            check_consistency=check_consistency,
        )
        self._buf = self._new_buckets()
        self._last_sync = 0

    def _end_round(self) -> None:
        with record_function(f"{self._profile_tag}::average"):
            self._buf.copy_from(self.params)
            own_ok = self._check_own(self._buf.buffers)
            self.comm.all_reduce_mean(self._buf.buffers)
            if not self._guard(self._buf.buffers, f"round {self.rounds + 1}"):
                self._average_finite_ranks(own_ok)
            self._buf.copy_to(self.params)
        self._last_sync = self.local_step

    def _average_finite_ranks(self, own_ok: bool) -> None:
        """Replace the buffer by the mean of the ranks whose parameters are finite."""
        self._buf.copy_from(self.params)
        if not own_ok:
            for b in self._buf.buffers:
                b.zero_()
        count = torch.tensor([1.0 if own_ok else 0.0], device=self._buf.device)
        self.comm.all_reduce_mean([*self._buf.buffers, count])
        finite = round(float(count) * self.world_size)
        if finite == 0:
            raise NonFiniteError(
                "LocalSGD: every rank's parameters hold NaN or Inf; nothing finite is left to "
                "average (lower the learning rate, check the data)"
            )
        torch._foreach_mul_(self._buf.buffers, self.world_size / finite)
        logger.warning(
            "LocalSGD: round %d averaged over the %d of %d ranks whose parameters are finite",
            self.rounds + 1,
            finite,
            self.world_size,
        )

    _discards_partial_round = False

    def _finish(self) -> None:
        # Average once more if steps were taken since the last round, so that every rank holds
        # the same parameters and no local work is lost.
        if self.local_step != self._last_sync:
            self._end_round()

    def _extra_state(self) -> dict[str, Any]:
        return {"last_sync": self._last_sync}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._last_sync = int(state.get("last_sync", self.local_step))
