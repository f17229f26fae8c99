"""SparseLoCo: sparse, 2-bit syncs whose error feedback takes the place of the outer momentum.

Paper: Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", 2025 (https://arxiv.org/abs/2508.15706); official code tplr-ai/SparseLoCo. On the
engine: one fragment. Every H inner steps, on each rank i, with Δᵢ = A − θᵢ:

1. eᵢ ← β·eᵢ + Δᵢ (the error-feedback accumulator: the outer momentum, kept per rank);
2. Δ̂ᵢ = Q(TopK(eᵢ)): in every s × s tile of each tensor the k = round(density·s²) largest
   magnitudes, their values quantised to 2 bits with a codebook fitted to them
   (:mod:`lowcomm.compress.sparse`); eᵢ ← eᵢ − Δ̂ᵢ (what was sent, as the others decode it);
3. all-gather the ranks' (indices, values); Δ̄ = each element's mean over the ranks that sent
   it (0 where none did); with ``sender_power`` γ ≠ 1 their sum divided by n^γ, n those ranks;
4. A ← A − α·Δ̄ (plain SGD, no momentum); θᵢ ← A.

With ``overlap=τ`` > 0 a round's sync is launched τ steps before the round ends and applied at
its end, the all-gather hidden behind those τ steps: the reset θ ← A drops the τ steps since
the launch (as Streaming DiLoCo does), the delay-corrected merge (``merge="delay_corrected"``,
as CO2's) keeps them, θ ← A + (θ − θ_s) with θ_s the parameters at the launch. At τ = H the
reset leaves the sync in flight for the whole next round (CO2's one-round-stale schedule, the
progress carried by the next Δ); the merge applies each sync at the sync point where the next
launches, a round after its own launch.

Early rounds (lowcomm's; ``early_steps`` W, ``early_every`` H₀, none by default): the first W
inner steps after any warm start sync every H₀ steps instead of every H, the same sync each time
(one fragment; with ``overlap`` τ, below H₀, each sync launched τ steps before its sync
point). They protect the fast-moving early phase as a synchronous warm start
does without crossing the link every step (``docs/studies/slow-links.md``).

Where lowcomm differs from the official code, and why:

* the accumulator takes Δᵢ, as the paper's equations write it; the code adds α·Δᵢ and then steps
  with α again, which is the same at the default α = 1;
* the quantiser's mean, standard deviation and codebook are summed in float64 and rounded to
  fp32 (the code sums in fp32 in an order of its own): the same values up to the last bit,
  independent of the summation order and the device;
* indices are sent as ⌈log₂ s²⌉-bit fields (12 bits), as the production code packs them, where
  the research code gathers int64; the bytes on the wire are those counted;
* ``sender_power`` γ (1, the paper's mean, by default) is lowcomm's: an element several ranks
  sent takes the sum of their values over n^γ, so γ > 1 steps less where they agree than the
  mean does, while an element one rank sent keeps its value (screened for the 4-worker job:
  1.5 within the seeds' noise of the mean, so the job keeps the mean;
  ``docs/studies/slow-links.md``).

Paper symbols → arguments: H ``sync_every``, β ``error_decay``, α ``outer_lr``, k/s²
``density``, s ``chunk``; the values' bits ``bits``; lowcomm's γ ``sender_power``, W
``early_steps`` and H₀ ``early_every``.

Example::

    algo = lowcomm.SparseLoCo(model, inner, sync_every=15)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch

from lowcomm.compress.sparse import DEFAULT_CHUNK, DEFAULT_DENSITY, VALUE_BITS, Sparse
from lowcomm.hparams import (
    HyperparameterError,
    check_number,
    check_positive_int,
    hyper,
)
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import OptimizerState, OuterState
from lowcomm.outer.hparams import (
    OuterConfig,
    check_overlap,
    check_whole_rounds,
    merge,
    outer_lr,
    outer_lr_schedule,
)
from lowcomm.schedules import SPARSE_GATHER

__all__ = ["SparseLoCo", "SparseLoCoConfig"]


def _check_bits(key: str, value: Any) -> None:
    if isinstance(value, bool) or value not in VALUE_BITS or not isinstance(value, int):
        raise HyperparameterError(key, f"must be 2, 4 or 32 (fp32 values), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig(OuterConfig):
    """SparseLoCo's hyperparameters."""

    sync_every: int = hyper(
        15, doc="inner steps per round (the paper's H)", symbol="H", check=check_positive_int(15)
    )
    outer_lr: float = outer_lr(1.0)
    outer_lr_schedule: str = outer_lr_schedule()
    error_decay: float = hyper(
        0.95,
        doc="decay of the error-feedback accumulator e ← β·e + Δ (the paper's sweeps)",
        symbol="β",
        check=check_number(
            "must be in [0, 1], got {value!r}; e.g. {key}=0.95", 0, 1, open_high=False
        ),
    )
    density: float = hyper(
        DEFAULT_DENSITY,
        doc="elements kept per tile: k = round(density·chunk²) (1/64: 64 of 4096, 146× smaller "
        "than fp32 with 2-bit values)",
        check=check_number(
            "must be in (0, 1], got {value!r}; e.g. {key}=0.02",
            0,
            1,
            open_low=True,
            open_high=False,
        ),
    )
    chunk: int = hyper(
        DEFAULT_CHUNK,
        doc="side s of the tiles top-k keeps k of (a matrix: s × s tiles; a vector: chunks of s)",
        symbol="s",
        check=check_positive_int(64),
    )
    bits: int = hyper(
        2,
        doc="bits of a kept value: 2 or 4 (a codebook fitted per tensor), or 32 (fp32)",
        check=_check_bits,
    )
    sender_power: float = hyper(
        1.0,
        doc="Δ̄ of an element: the sum of what the n ranks that sent it sent, over n^γ (1: their "
        "mean, the paper's; 0: their sum; 1.5: a shorter step where ranks agree)",
        symbol="γ",
        check=check_number("must be a number >= 0, got {value!r}; e.g. {key}=1.5", 0),
    )
    merge: str = merge()
    overlap: int = hyper(
        0,
        doc="inner steps a sync is in flight before it is applied, at most sync_every (0: "
        "blocking, the paper's; sync_every: the whole next round, one round stale)",
        symbol="τ",
        check=check_number(
            "must be an integer >= 0, got {value!r}; e.g. {key}=15", 0, integer=True
        ),
    )

    early_every: int = hyper(
        4,
        doc="inner steps per round in the first early_steps steps (after any warm start): "
        "shorter rounds while the model moves fast; a divisor of sync_every",
        symbol="H₀",
        check=check_positive_int(4),
    )
    early_steps: int = hyper(
        0,
        doc="inner steps at the start that sync every early_every steps instead of every "
        "sync_every, a multiple of sync_every (0: none, the paper's); overlap below early_every",
        symbol="W",
        check=check_number(
            "must be an integer >= 0, got {value!r}; e.g. {key}=120", 0, integer=True
        ),
    )

    def check(self) -> None:
        super().check()
        check_overlap(self.sync_every, self.overlap, "sync_every: one round stale")
        h, h0, w = self.sync_every, self.early_every, self.early_steps
        if not w:
            return
        check_whole_rounds("early_steps", w, h)
        if h % h0:
            divisors = ", ".join(str(d) for d in range(1, h) if h % d == 0)
            raise HyperparameterError(
                "early_every", f"must divide sync_every={h}: one of {divisors}", shown=str(h0)
            )
        if self.overlap >= h0:
            raise HyperparameterError(
                "overlap",
                f"must be below early_every={h0} with early rounds (one sync in flight at a "
                f"time): set overlap to at most {h0 - 1}, or early_steps=0 to keep it",
                shown=str(self.overlap),
            )
        if self.local_steps != "fixed":
            raise HyperparameterError(
                "early_steps",
                "early rounds need local_steps='fixed' (rounds of H₀ steps on every rank); "
                "set early_steps=0 for dynamic local steps",
                shown=str(w),
            )

    @property
    def compression(self) -> Sparse:
        """The codec of the syncs: chunk-wise top-k with quantised values."""
        return Sparse(
            density=float(self.density),
            chunk=int(self.chunk),
            bits=int(self.bits),
            power=float(self.sender_power),
        )


class SparseLoCo(OuterAlgorithm):
    """SparseLoCo (see the module docstring): sparse quantised syncs all-gathered every H inner
    steps, the error-feedback accumulator (decay ``error_decay``) in place of an outer
    momentum, plain SGD with ``outer_lr`` on the mean of the ranks that sent each element;
    ``overlap`` keeps the sync in flight while the next steps compute."""

    name = "sparseloco"
    Config: ClassVar[type[OuterConfig]] = SparseLoCoConfig
    config: SparseLoCoConfig
    schedule = SPARSE_GATHER
    _apply_unlaunched = True

    @property
    def feedback_decay(self) -> float:
        """β: the error-feedback accumulator's decay."""
        return float(self.config.error_decay)

    def _keeps_progress(self) -> bool:
        return self.config.merge == "delay_corrected"

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        sgd = partial(torch.optim.SGD, lr=float(self.config.outer_lr), momentum=0.0, foreach=True)
        return OptimizerState(sgd, anchor, lr_factor=self.outer_lr_factor)
