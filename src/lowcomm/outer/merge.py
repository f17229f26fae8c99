"""The merge that keeps the progress made while a sync was in flight: a snapshot θ_s of each
fragment's parameters at its launch, and at its sync point θ ← Â + (θ − θ_s), Â the updated
anchor (the delay-corrected merge of CO2 and SparseLoCo); with λ₀ > 0 CoCoDC's delay
compensation (:func:`~lowcomm.outer.functional.delay_compensation_`). Without it the reset
θ ← Â drops the steps taken since the launch. One more copy of the parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from lowcomm.buckets import FlatBuckets
from lowcomm.outer.functional import delay_compensation_
from lowcomm.params import load_tensors

__all__ = ["MERGES", "KeepProgress"]

MERGES = ("reset", "delay_corrected")
"""The ``merge`` settings: θ ← Â, or θ ← Â + (θ − θ_s)."""


class _Fragment(Protocol):
    @property
    def anchor(self) -> FlatBuckets: ...

    @property
    def params(self) -> list[torch.Tensor]: ...


class KeepProgress:
    """θ_s of every fragment at its launch, and the merge that keeps θ − θ_s."""

    def __init__(self, fragments: Sequence[_Fragment], *, lambda0: float = 0.0) -> None:
        self.fragments = list(fragments)
        self.lambda0 = float(lambda0)
        self.snapshots = [f.anchor.like() for f in self.fragments]

    def launched(self, f: int) -> None:
        """Fragment ``f`` is launched: θ_s ← θ."""
        self.snapshots[f].copy_from(self.fragments[f].params)

    def merge(self, f: int) -> None:
        """θ ← Â + (θ − θ_s) (with λ₀: compensated) for fragment ``f``."""
        frag = self.fragments[f]
        snapshot = self.snapshots[f].views
        delay_compensation_(frag.params, frag.anchor.views, snapshot, lambda0=self.lambda0)

    def state_dict(self) -> list[list[torch.Tensor]]:
        return [[v.clone() for v in s.views] for s in self.snapshots]

    def load_state_dict(self, saved: Any) -> None:
        for i, snap in enumerate(self.snapshots):
            load_tensors({"s": saved[i]}, "s", snap.views)
