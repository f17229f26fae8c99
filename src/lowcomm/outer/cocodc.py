"""CoCoDC: Streaming DiLoCo with delay compensation and adaptive transmission.

Paper: Zhu et al., "Cross-region Model Training with Communication-Computation Overlapping and
Delay Compensation" (no public implementation; where the paper is silent, choices below).
On top of :class:`~lowcomm.StreamingDiLoCo`'s schedule:

* **Delay compensation.** θ_s, the fragment's parameters at launch, is snapshotted. At the sync
  point, with θ_now the live parameters and Â the new global fragment:
  θ ← Â − (g + λ·g⊙g⊙D), g = θ_s − θ_now, D = Â − θ_s, λ = λ₀·‖g‖/‖g⊙g⊙D‖ per tensor (0 when
  g⊙g⊙D = 0; :func:`~lowcomm.outer.functional.delay_compensation_`): the overlap's local
  progress is kept on top of the global update, corrected to second order.
* **Adaptive transmission.** At each launch every rank scores each fragment not in flight by
  its RMS drift ‖A_p − θ_p‖/√numel_p (so big and small fragments compete fairly) times the
  sync points since its last launch; the scores are averaged across ranks (one small
  all-reduce, counted) so every rank picks the same one: the highest, ties to the lowest
  index. A fragment that has waited ``max_wait`` rounds goes first. ``adaptive=False``:
  round-robin.

With ``lambda0=0`` and ``adaptive=False`` it is Streaming DiLoCo whose merge keeps the overlap's
progress: θ_p ← Â_p + (θ_now − θ_s), the delay-corrected merge of LOSCAR-SGD (Maziane et al.
2026, https://arxiv.org/abs/2605.20866): with an outer SGD step of lr 1 and no momentum Â_p is
ȳ_p, the mean of the ranks' snapshots, and θᵢ ← θᵢ + (ȳ − θ_s,ᵢ) leaves the mean of the ranks'
parameters where it was (the average model on the synchronous trajectory; a test pins it).

**Full overlap.** Because the merge keeps the progress since the launch, ``overlap`` may equal
``sync_every``: every fragment's all-reduce runs for a whole round (the link carries the same
bytes per round as at τ = H/P, with P times as long for each fragment), and a sync point applies
its fragment's sync before launching the same fragment again, so that the launch measures
Δ_p = Â_p − θ_p from the merged parameters: exactly the progress not yet sent.

Example::

    algo = lowcomm.CoCoDC(model, inner, sync_every=48, num_fragments=4, overlap=4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.hparams import check_bool, check_number, check_positive_int, hyper
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.hparams import OuterConfig
from lowcomm.outer.streaming import FragmentsConfig, StreamingDiLoCo

__all__ = ["CoCoDC", "CoCoDCConfig"]


@dataclass(frozen=True, kw_only=True)
class CoCoDCConfig(FragmentsConfig):
    """CoCoDC's hyperparameters (no ``mix``: the delay compensation merges; ``overlap`` up to
    ``sync_every``, full overlap)."""

    full_overlap: ClassVar[bool] = True

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
        self.last_launch = [0] * self.num_fragments  # sync point of each one's last launch

    def _choose_fragment(self, k: int) -> int:
        busy = set(self._in_flight.values())
        free = [f for f in range(self.num_fragments) if f not in busy]
        assert free, "a sync point applies (τ = H) or launches a free fragment (τ < H)"
        waits = {f: k - self.last_launch[f] for f in free}
        starving = [f for f in free if waits[f] >= self.config.max_wait * self.num_fragments]
        if starving:
            f = max(starving, key=lambda f: (waits[f], -f))
        elif not self.config.adaptive:
            # round-robin over the free fragments, starting where plain Streaming DiLoCo would
            rr = (k - 1) % self.num_fragments
            f = min(free, key=lambda f: (f - rr) % self.num_fragments)
        else:
            # on the device the anchors are all-reduced from (NCCL: the GPU), read once below
            device = self.fragments[0].anchor.device
            scores = torch.zeros(self.num_fragments, dtype=torch.float64, device=device)
            for g in free:
                frag = self.fragments[g]
                drift = torch._foreach_sub(frag.anchor.views, list(frag.params))
                rms = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(drift)))
                # float64 arithmetic as on floats: the same bits as float(rms) / √n * wait
                scores[g] = rms.double() / math.sqrt(frag.numel) * waits[g]
            # ranks' drifts differ: average the scores so that every rank picks the same one
            self.comm.all_reduce_mean([scores])
            values = scores.tolist()
            f = max(free, key=lambda g: (values[g], -g))
        self.last_launch[f] = k
        return f

    def _keeps_progress(self) -> bool:
        return True  # the compensation merge keeps the overlap's progress

    def _merge(self, f: int) -> None:
        OuterAlgorithm._merge(self, f)  # the compensated merge (not Streaming DiLoCo's mix)

    def _extra_state(self) -> dict[str, Any]:
        return {"last_launch": list(self.last_launch)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "last_launch" not in state or "snapshots" not in state:
            raise ValueError("CoCoDC state_dict is missing 'last_launch' or 'snapshots'")
        self.last_launch = [int(x) for x in state["last_launch"]]
