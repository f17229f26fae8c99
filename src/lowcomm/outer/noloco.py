"""NoLoCo: no all-reduce; every H inner steps each rank averages with a small random group.

Paper: Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
Models", 2025 (https://arxiv.org/abs/2506.10911); official code gensyn-ai/noloco,
``SparseOptimizerC``, whose arithmetic this follows. With φᵢ this rank's outer weights (its
anchor, which differs from rank to rank), θᵢ its live weights, δᵢ its outer momentum and G the
group it drew for this sync (:func:`~lowcomm.outer.functional.noloco_groups`: a permutation from
(``group_seed``, inner step), identical on every rank with no communication)::

    δᵢ ← μ·δᵢ + α·(mean_G θⱼ − φᵢ);   φᵢ ← φᵢ + δᵢ;   θᵢ ← φᵢ

(the official code's α·mean_G(θⱼ − φⱼ) + α·(mean_G φⱼ − φᵢ), summed). This is heavy-ball
momentum: the paper writes Nesterov, the code does not; lowcomm follows the code. Each member
sends its θ to the others of its group by point-to-point ``batch_isend_irecv`` (one message per
bucket and peer) and sums what it receives in rank order, so every member of a group holds the
same mean; a sync costs (n − 1) model copies per rank whatever the world size. A world size not
divisible by n puts the remainder in the last group (the official code refuses it).

On the engine: one fragment that sends θ (not Δ); ``overlap=τ`` launches the exchange τ steps
before the round ends and applies it at the end (θ ← φ then drops those τ steps, as
Streaming DiLoCo does). ``finish()`` ends with one all-reduce of φ over every rank, so that all
ranks hold the same model afterwards (between syncs they differ by design). Not offered: the
codecs (the exchange carries weights, not deltas with error feedback) and sharded outer state
(φ is per rank). The official code's random routing of pipeline activations needs pipeline
parallelism and is out of scope.

Degenerate cases: n = W is DiLoCo with heavy-ball ``SGD(lr=α, momentum=μ)``; μ = 0, α = 1 is
gossip averaging θᵢ ← mean_G θ (with n = W, LocalSGD).

Example::

    algo = lowcomm.NoLoCo(model, inner, sync_every=50, group_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import FlatBuckets, Handle
from lowcomm.hparams import HyperparameterError, check_number, hyper
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.fragment import AnyFragment, Fragment, OuterState
from lowcomm.outer.functional import noloco_groups, noloco_outer_update_
from lowcomm.outer.hparams import OuterConfig, outer_lr, outer_momentum, overlap
from lowcomm.params import load_tensors
from lowcomm.schedules import GOSSIP

__all__ = ["NoLoCo", "NoLoCoConfig"]


@dataclass(frozen=True, kw_only=True)
class NoLoCoConfig(OuterConfig):
    """NoLoCo's hyperparameters (defaults: the paper's)."""

    outer_lr: float = outer_lr(0.7)
    outer_momentum: float = outer_momentum(0.5)
    group_size: int = hyper(
        2,
        doc="ranks averaged together at each sync, drawn at random (the remainder of a world "
        "size not divisible by it joins the last group)",
        symbol="n",
        check=check_number("must be an integer >= 2, got {value!r}; e.g. {key}=2", 2, integer=True),
    )
    group_seed: int = hyper(
        0,
        doc="seed of the random groups: the sync after inner step s uses numpy's "
        "default_rng(group_seed + s + 1), the official code's groups with 0",
        check=check_number("must be an integer >= 0, got {value!r}", 0, integer=True),
    )
    overlap: int = overlap(
        "inner steps the group exchange runs before it is applied (below sync_every)"
    )

    def check(self) -> None:
        super().check()
        if self.overlap >= self.sync_every:
            raise HyperparameterError(
                "overlap",
                f"must be < sync_every={self.sync_every}: an exchange must land before the "
                "next one is launched",
                shown=str(self.overlap),
            )
        if self.local_steps == "dynamic":
            raise HyperparameterError(
                "local_steps",
                "'dynamic' cannot be used with NoLoCo: its gossip groups average parameters "
                "pair by pair, with no weight for the steps each rank took; use 'fixed'",
                shown="'dynamic'",
            )


class NoLoCoState:
    """The outer momentum δ of one rank and its step (:func:`noloco_outer_update_`)."""

    def __init__(self, anchor: list[torch.Tensor], lr: float, momentum: float) -> None:
        self.momentum = [torch.zeros_like(a) for a in anchor]
        self.lr, self.momentum_coef = lr, momentum

    def step(self, anchor: list[torch.Tensor], avg_delta: list[torch.Tensor]) -> None:
        # avg_delta is the group's mean θ: this fragment sends parameters
        noloco_outer_update_(
            anchor, self.momentum, avg_delta, lr=self.lr, momentum_coef=self.momentum_coef
        )

    def tensors(self) -> list[torch.Tensor]:
        return list(self.momentum)

    def settings(self) -> dict[str, Any]:
        return {}  # the guard compares the config's outer_lr and outer_momentum

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": [m.detach().clone() for m in self.momentum]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_tensors(state, "momentum", self.momentum)


class NoLoCo(OuterAlgorithm):
    """NoLoCo: outer heavy-ball steps towards the mean of a random group of ranks, by
    point-to-point exchange (no all-reduce)."""

    name = "noloco"
    Config: ClassVar[type[OuterConfig]] = NoLoCoConfig
    schedule = GOSSIP
    elastic = False  # its gossip pairs need a fixed group
    config: NoLoCoConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._recv: list[FlatBuckets] = []
        self._agreed = False
        super().__init__(*args, **kwargs)

    def _outer_state(self, anchor: list[torch.Tensor]) -> OuterState:
        return NoLoCoState(anchor, float(self.config.outer_lr), float(self.config.outer_momentum))

    def _new_fragment(self, params: list[torch.Tensor], index: int) -> AnyFragment:
        return Fragment(
            params,
            self,
            outer=self._outer_state,
            bucket_cap_mb=self.config.bucket_cap_mb,
            send_params=True,
        )

    def group(self, step: int) -> list[int]:
        """This rank's group (ranks of the process group, in order) for the sync that applies
        after inner step ``step`` of the schedule (counted from the end of the warm start)."""
        groups = noloco_groups(
            self.world_size, int(self.config.group_size), step, int(self.config.group_seed)
        )
        return next(g for g in groups if self.comm.rank in g)

    def mean_async(self, buffers: list[torch.Tensor]) -> Handle:
        """The mean of θ over this sync's group, by point-to-point exchange."""
        # launched τ steps before the round's end; the groups are those of that end
        members = self.group(self.local_step - self.warmup + self.overlap)
        while len(self._recv) < len(members) - 1:
            self._recv.append(self.fragment.anchor.like())
        return self.comm.group_mean_async(buffers, members, [r.buffers for r in self._recv])

    def _apply(self, k: int) -> None:
        super()._apply(k)
        self._agreed = False

    def _after_finish(self, drained: bool) -> None:
        # every rank's φ is its own: agree on their mean, once per state (finish is idempotent)
        if self.sync_points and not self._agreed:
            self.comm.all_reduce_mean(self.fragment.anchor.buffers)
            self._agreed = True

    def memory_report(self) -> dict[str, int]:
        report = super().memory_report()
        report["buffers"] += sum(r.nbytes for r in self._recv)
        return report

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "group_size": int(self.config.group_size)}

    def _extra_state(self) -> dict[str, Any]:
        return {"agreed": self._agreed}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._agreed = bool(state.get("agreed", False))
