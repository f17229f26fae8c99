"""CoCoDC: Streaming DiLoCo with delay compensation and adaptive transmission.

Paper: Zhu et al., "Cross-region Model Training with Communication-Computation Overlapping and
Delay Compensation". No public implementation exists; this one follows lowcomm's design notes,
and where the paper is silent the choices are listed below.

On top of :class:`~lowcomm.StreamingDiLoCo`'s schedule (a sync point every H/P steps, each
fragment's all-reduce launched τ steps early):

* **Delay compensation.** When fragment p's all-reduce is launched, its parameters θ_s are
  snapshotted. At the sync point, with θ_now the live parameters and Â_p the new global
  fragment: g = θ_s − θ_now, D = Â_p − θ_s, g̃ = g + λ·g⊙g⊙D with a per-tensor
  λ = λ₀·‖g‖/‖g⊙g⊙D‖ (λ₀ = ``lambda0``, default 0.2), and θ_p ← Â_p − g̃
  (:func:`~lowcomm.outer.functional.delay_compensation_`): the progress made during the
  overlap is kept on top of the global update, with a second-order correction, instead of
  being overwritten (Streaming DiLoCo's ``mix = 0``).
* **Adaptive transmission.** At each launch, every rank scores every fragment not in flight by
  its normalised pseudo-gradient norm ‖A_p − θ_p‖ / √numel_p times the sync points since it was
  last launched; the P scores are averaged across ranks (one small all-reduce, counted in the
  stats) so every rank picks the same fragment: the highest score, ties to the lowest index. A
  fragment that has waited ``max_wait`` rounds (``max_wait``·P sync points) is picked first, so
  none starves. ``adaptive=False`` is round-robin.

Choices where the paper is silent: the score uses each rank's current local drift (that is
what differs across ranks and needs the all-reduce); "normalised" is per element (RMS), so big
and small fragments compete fairly; λ is 0 for a tensor whose g⊙g⊙D is zero.

Degenerate form: with ``lambda0=0`` and ``adaptive=False``, CoCoDC is Streaming DiLoCo whose
merge keeps the overlap's local progress: θ_p ← Â_p + (θ_now − θ_s).

Example::

    algo = lowcomm.CoCoDC(model, inner, sync_every=48, num_fragments=4, overlap=4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.outer.fragment import load_tensors
from lowcomm.outer.functional import delay_compensation_
from lowcomm.outer.hparams import (
    OuterConfig,
    check_bool,
    check_number,
    check_positive_int,
    hyper,
)
from lowcomm.outer.streaming import FragmentsConfig, StreamingDiLoCo

__all__ = ["CoCoDC", "CoCoDCConfig"]


@dataclass(frozen=True, kw_only=True)
class CoCoDCConfig(FragmentsConfig):
    """CoCoDC's hyperparameters (no ``mix``: the delay compensation merges)."""

    lambda0: float = hyper(
        0.2,
        doc="delay-compensation strength (0: first order only)",
        symbol="λ₀",
        check=check_number("must be a finite number >= 0, got {value!r}; e.g. 0.2", 0),
    )
    adaptive: bool = hyper(
        True, doc="pick fragments by all-reduced priority, or round-robin", check=check_bool
    )
    max_wait: int = hyper(
        2,
        doc="most rounds a fragment may wait before it is synced",
        symbol="K",
        check=check_positive_int(2),
    )


class CoCoDC(StreamingDiLoCo):
    """CoCoDC: Streaming DiLoCo + delay compensation + adaptive transmission (see the module
    docstring); no ``mix`` (the compensation merges) and no ``shard_outer_state``."""

    name = "cocodc"
    Config: ClassVar[type[OuterConfig]] = CoCoDCConfig
    config: CoCoDCConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._snapshots = [f.anchor.like() for f in self.fragments]
        self.last_launch = [0] * self.num_fragments
        """Sync index at which each fragment was last launched (0: never)."""

    def _choose_fragment(self, k: int) -> int:
        busy = set(self._in_flight.values())
        free = [f for f in range(self.num_fragments) if f not in busy]
        assert free, "overlap < sync_every leaves at least one fragment free"
        waits = {f: k - self.last_launch[f] for f in free}
        starving = [f for f in free if waits[f] >= self.config.max_wait * self.num_fragments]
        if starving:
            f = max(starving, key=lambda f: (waits[f], -f))
        elif not self.config.adaptive:
            # round-robin over the free fragments, starting where plain Streaming DiLoCo would
            rr = (k - 1) % self.num_fragments
            f = min(free, key=lambda f: (f - rr) % self.num_fragments)
        else:
            scores = torch.zeros(self.num_fragments, dtype=torch.float64)
            for g in free:
                frag = self.fragments[g]
                drift = torch._foreach_sub(
                    frag.anchor.views, [p.detach().float() for p in frag.params]
                )
                rms = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(drift)))
                scores[g] = float(rms) / math.sqrt(frag.numel) * waits[g]
            # ranks' drifts differ: average the scores so that every rank picks the same one
            self.comm.all_reduce_mean([scores])
            f = max(free, key=lambda g: (float(scores[g]), -g))
        self.last_launch[f] = k
        return f

    def _before_launch(self, f: int) -> None:
        self._snapshots[f].copy_from(self.fragments[f].params)

    def _merge(self, f: int) -> None:
        frag = self.fragments[f]
        delay_compensation_(
            frag.params, frag.anchor.views, self._snapshots[f].views, lambda0=self.config.lambda0
        )

    def _extra_state(self) -> dict[str, Any]:
        return {
            "last_launch": list(self.last_launch),
            "snapshots": [[v.clone() for v in s.views] for s in self._snapshots],
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "last_launch" not in state or "snapshots" not in state:
            raise ValueError("CoCoDC state_dict is missing 'last_launch' or 'snapshots'")
        for i, snap in enumerate(self._snapshots):
            load_tensors({"s": state["snapshots"][i]}, "s", snap.views)
        self.last_launch = [int(x) for x in state["last_launch"]]
