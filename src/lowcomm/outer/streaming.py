"""Streaming DiLoCo: DiLoCo over P fragments, one synced at a time, with overlapped all-reduces.

Paper: Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512). The schedule is torchft's
``DiLoCo(model_fragments, sync_every, fragment_sync_delay, fragment_update_alpha)``:

* sync points every H/P inner steps; the k-th (k = 1, 2, …) syncs fragment (k − 1) mod P;
* fragment p's pseudo-gradient Δ_p = A_p − θ_p is taken and its all-reduce launched ``overlap``
  (τ) inner steps before its sync point;
* at the sync point: Â_p = OuterOpt_p(A_p, Δ̄_p); θ_p ← (1 − mix)·Â_p + mix·θ_p; A_p ← Â_p.

torchft keeps at most one fragment in flight (τ < H/P). Here τ may be anything below H: with
τ ≥ H/P the next fragment's all-reduce is launched while earlier ones are still running, which
hides more of a slow link at the price of staler pseudo-gradients. The first sync points, whose
launch would then fall before the first step, are skipped.

Paper symbols → arguments: H ``sync_every``, P ``num_fragments``, τ ``overlap``, α ``mix``
(the paper's mixing factor), outer α/β ``outer_lr``/``outer_momentum``.

Example::

    algo = lowcomm.StreamingDiLoCo(model, inner, sync_every=48, num_fragments=4, overlap=2)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        algo.step()
    algo.finish()
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lowcomm.comm import DEFAULT_BUCKET_CAP_MB, Communicator
from lowcomm.compress.codecs import parse_compression
from lowcomm.compress.feedback import Compressor
from lowcomm.guard import all_finite, optimizer_state_tensors
from lowcomm.outer.base import (
    Compression,
    OuterAlgorithm,
    _check_positive_int,
    optimizer_settings,
)
from lowcomm.outer.diloco import _sgd_factory, validate_outer_sgd
from lowcomm.outer.fragment import Fragment, OuterOptimizerFactory
from lowcomm.outer.sharded import ShardedFragment, check_sharding

__all__ = ["StreamingDiLoCo", "split_by_blocks"]


def _find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` with the most children: the transformer blocks of usual models."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    return best


def split_by_blocks(model: nn.Module, num_fragments: int) -> list[list[torch.Tensor]]:
    """Automatic fragments, strided by transformer block as in the Streaming DiLoCo paper.

    Block j of the model's largest ``nn.ModuleList`` goes to fragment j mod P (blocks are
    interleaved across fragments). Every other trainable parameter (embeddings, final norm,
    head) goes, in ``named_parameters()`` order, to the fragment with the fewest elements so
    far (ties: the lowest index), which keeps the fragments' sizes — and so the bursts on the
    link — close to each other. Deterministic: every rank computes the same split.
    """
    blocks = _find_blocks(model)
    if blocks is None or len(blocks) < num_fragments:
        found = 0 if blocks is None else len(blocks)
        raise ValueError(
            f"automatic fragments need at least num_fragments={num_fragments} transformer "
            f"blocks in an nn.ModuleList, found {found}; pass fragments=[module, ...] instead"
        )
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_fragments)]
    in_blocks: set[int] = set()
    for j, block in enumerate(blocks):
        for p in block.parameters():
            if p.requires_grad and id(p) not in in_blocks:
                groups[j % num_fragments].append(p)
                in_blocks.add(id(p))
    sizes = [sum(p.numel() for p in g) for g in groups]
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in in_blocks or id(p) in seen:
            continue
        seen.add(id(p))
        i = min(range(num_fragments), key=lambda f: (sizes[f], f))
        groups[i].append(p)
        sizes[i] += p.numel()
    return groups


class StreamingDiLoCo(OuterAlgorithm):
    """Streaming DiLoCo: P fragments synced in turn, each all-reduce overlapped with τ steps.

    Args:
        model_or_params: an ``nn.Module`` (needed for automatic fragments) or parameters.
        inner_optimizer: the optimizer whose ``step()`` drives the schedule.
        sync_every: H: each fragment is synced once every H inner steps; a multiple of P.
        num_fragments: P, for automatic fragments (:func:`split_by_blocks`). Default 1.
        fragments: explicit fragments instead: a list of modules or of parameter lists that
            together hold every trainable parameter exactly once.
        overlap: τ, inner steps between launching a fragment's all-reduce and applying it
            (0 ≤ τ < H; τ ≥ H/P keeps several fragments in flight).
        mix: α of the paper, θ_p ← (1 − α)·Â_p + α·θ_p at the sync point (0 ≤ α ≤ 1).
        outer_lr, outer_momentum, nesterov, outer_optimizer: the outer optimizer of every
            fragment, as :class:`~lowcomm.DiLoCo` (one optimizer per fragment).
        process_group: the group to average over; ``None`` is WORLD.
        bucket_cap_mb: size cap of one flat fp32 bucket (one collective each).
        compression: compress each fragment's pseudo-gradient, with error feedback on each
            rank (a codec or a spec such as ``"int4"``, ``"powersgd:4"``; see
            :mod:`lowcomm.compress`). Still overlapped: the compressed collective is launched
            τ steps early; PowerSGD's second all-reduce goes out τ/2 steps after the first.

    ``finish()`` applies every all-reduce still in flight and then resets every fragment to
    its anchor, so all ranks agree; local progress since a fragment's last sync is dropped.
        shard_outer_state: keep 1/N of every fragment's anchor and outer optimizer state on
            each rank (:mod:`lowcomm.outer.sharded`): the reduce-scatter is launched τ steps
            early, the owner's update and the all-gather halfway to the sync point.
        nan_policy, check_consistency: the guards every algorithm has (see
            :class:`~lowcomm.outer.base.OuterAlgorithm`).
    """

    name = "streaming"
    schedule = "fragments"
    compressible = True
    _default_nesterov = True

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[torch.Tensor],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        num_fragments: int | None = None,
        fragments: Sequence[nn.Module | Iterable[torch.Tensor]] | None = None,
        overlap: int = 0,
        mix: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: OuterOptimizerFactory | None = None,
        process_group: dist.ProcessGroup | Communicator | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        compression: Compression = None,
        shard_outer_state: bool = False,
        nan_policy: str = "skip",
        check_consistency: bool = True,
    ) -> None:
        if fragments is not None and num_fragments is not None and num_fragments != len(fragments):
            raise ValueError(
                f"num_fragments={num_fragments} but {len(fragments)} fragments were given; "
                "pass one of the two"
            )
        if not isinstance(model_or_params, nn.Module):
            # iterated twice (all parameters, then fragments): a generator would run dry
            model_or_params = list(model_or_params)
        self.validate(
            sync_every=sync_every,
            num_fragments=len(fragments) if fragments is not None else (num_fragments or 1),
            overlap=overlap,
            mix=mix,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            outer_optimizer=outer_optimizer,
            bucket_cap_mb=bucket_cap_mb,
            compression=compression,
            shard_outer_state=shard_outer_state,
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
        groups = self._fragment_groups(model_or_params, num_fragments, fragments)
        if outer_optimizer is None:
            outer_optimizer = _sgd_factory(float(outer_lr), float(outer_momentum), bool(nesterov))
        self.compression = parse_compression(compression)
        self.shard_outer_state = bool(shard_outer_state)
        self.fragments: list[Any] = [
            ShardedFragment(g, self.comm, bucket_cap_mb=self.bucket_cap_mb, factory=outer_optimizer)
            if self.shard_outer_state
            else Fragment(
                g,
                outer_optimizer,
                bucket_cap_mb=self.bucket_cap_mb,
                compression=self.compression,
                rank=self.comm.rank,
                stream=i,
            )
            for i, g in enumerate(groups)
        ]
        self.num_fragments = len(self.fragments)
        self.interval = self.sync_every // self.num_fragments
        """Inner steps between sync points: H / P."""
        self.overlap = int(overlap)
        self.mix = float(mix)
        self.sync_points = 0
        """Sync points completed."""
        self._in_flight: dict[int, int] = {}  # sync index k -> fragment index

    @classmethod
    def validate(cls, **kwargs: Any) -> None:
        super().validate(**kwargs)
        validate_outer_sgd(kwargs, default_nesterov=cls._default_nesterov)
        p = kwargs.get("num_fragments", 1)
        if p is not None:
            _check_positive_int("num_fragments", p, 4)
        h = kwargs.get("sync_every")
        if h is not None and p is not None and h % p:
            raise ValueError(
                f"sync_every={h} must be a multiple of num_fragments={p} (a sync point every "
                f"H/P steps); e.g. sync_every={p * max(1, round(h / p))}"
            )
        if "overlap" in kwargs:
            tau = kwargs["overlap"]
            if isinstance(tau, bool) or not isinstance(tau, numbers.Integral) or int(tau) < 0:
                raise ValueError(f"overlap must be an integer >= 0, got {tau!r}")
            if h is not None and int(tau) >= h:
                raise ValueError(
                    f"overlap={tau} must be < sync_every={h}: a fragment's all-reduce must "
                    "land before the same fragment is launched again"
                )
        if "mix" in kwargs:
            mix = kwargs["mix"]
            if (
                isinstance(mix, bool)
                or not isinstance(mix, numbers.Real)
                or not 0 <= float(mix) <= 1
            ):
                raise ValueError(f"mix must be in [0, 1], got {mix!r}; 0 keeps the global model")

    def _fragment_groups(
        self,
        model_or_params: nn.Module | list[torch.Tensor],
        num_fragments: int | None,
        fragments: Sequence[nn.Module | Iterable[torch.Tensor]] | None,
    ) -> list[list[torch.Tensor]]:
        if fragments is None:
            p = num_fragments or 1
            if p == 1:
                return [self.params]
            if not isinstance(model_or_params, nn.Module):
                raise ValueError(
                    "automatic fragments (num_fragments > 1) need the model as an nn.Module; "
                    "pass the module, or fragments=[...]"
                )
            groups = split_by_blocks(model_or_params, p)
        else:
            groups = [
                [q for q in (f.parameters() if isinstance(f, nn.Module) else f) if q.requires_grad]
                for f in fragments
            ]
        mine = {id(q) for q in self.params}
        seen: set[int] = set()
        for i, g in enumerate(groups):
            if not g:
                raise ValueError(f"fragment {i} has no trainable parameters")
            for q in g:
                if id(q) in seen:
                    raise ValueError(f"a parameter appears in two fragments (again in {i})")
                if id(q) not in mine:
                    raise ValueError(f"fragment {i} holds a parameter that is not in the model")
                seen.add(id(q))
        if len(seen) != len(mine):
            raise ValueError(
                f"{len(mine) - len(seen)} trainable parameter(s) are in no fragment and would "
                "never be synchronised; give every parameter to a fragment"
            )
        return groups

    # -- schedule ----------------------------------------------------------------------------

    def _choose_fragment(self, k: int) -> int:
        """Fragment synced at the k-th sync point (round-robin; CoCoDC overrides)."""
        return (k - 1) % self.num_fragments

    def _launch(self, k: int) -> None:
        f = self._choose_fragment(k)
        assert f not in self._in_flight.values()
        with record_function(f"{self._profile_tag}::launch"):
            self._before_launch(f)
            frag = self.fragments[f]
            if isinstance(frag, ShardedFragment):
                # advanced (update and all-gather launched) halfway to the sync point
                frag.launch(self._check_own, lambda: self._skip(f"fragment {f}"))
            else:
                frag.launch(self.comm, self._check_own)
            assert frag.pending is not None
            self._schedule_advance(frag.pending, self.overlap)
        self._in_flight[k] = f

    def _before_launch(self, f: int) -> None:
        """Hook: called just before fragment ``f``'s pseudo-gradient is taken."""

    def _sync(self, k: int) -> None:
        f = self._in_flight.pop(k)
        frag = self.fragments[f]
        with record_function(f"{self._profile_tag}::outer"):
            if isinstance(frag, ShardedFragment):
                applied = frag.wait()
            else:
                applied = frag.outer_step(accept=lambda avg: self._guard(avg, f"fragment {f}"))
            if applied:
                self._merge(f)
            else:
                frag.anchor.copy_to(frag.params)  # skipped: back to the unchanged anchor
        self.sync_points += 1

    def _merge(self, f: int) -> None:
        """θ_p ← (1 − mix)·Â_p + mix·θ_p (Â_p is now the fragment's anchor)."""
        frag = self.fragments[f]
        if self.mix == 0.0:
            frag.anchor.copy_to(frag.params)
            return
        local = [p.detach().clone() for p in frag.params]
        frag.anchor.copy_to(frag.params)
        torch._foreach_lerp_([p.detach() for p in frag.params], local, self.mix)

    # Fragments are synced at their own sync points, not at round boundaries; the docstring
    # says what finish() drops.
    _discards_partial_round = False

    def _on_step(self, step: int) -> None:
        # Launch before syncing: with τ = 0 both concern the same fragment at this step.
        if (step + self.overlap) % self.interval == 0:
            self._launch((step + self.overlap) // self.interval)
        # With τ ≥ H/P the first sync points would have launched before step 1: skipped.
        if step % self.interval == 0 and step - self.overlap >= 1:
            self._sync(step // self.interval)

    def _finish(self) -> None:
        # Apply every all-reduce still in flight, then reset every fragment to its anchor so
        # that all ranks agree.
        for k in sorted(self._in_flight):
            self._sync(k)
        for frag in self.fragments:
            frag.anchor.copy_to(frag.params)

    # -- guards ------------------------------------------------------------------------------

    def _compressors(self) -> list[Compressor]:
        return [f.compressor for f in self.fragments if f.compressor is not None]

    def _state_tensors(self) -> list[torch.Tensor]:
        out = super()._state_tensors()
        for frag in self.fragments:
            if isinstance(frag, ShardedFragment):
                out += frag.state_tensors()
            else:
                out += [*frag.anchor.buffers, *optimizer_state_tensors(frag.outer)]
        return out

    def _buffer_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for frag in self.fragments:
            if isinstance(frag, ShardedFragment):
                out += frag.buffer_tensors()
            else:
                out += list(frag.delta.buffers)
        return out

    def _settings(self) -> dict[str, Any]:
        return {
            **super()._settings(),
            "shard_outer_state": self.shard_outer_state,
            "num_fragments": self.num_fragments,
            "fragment sizes": [frag.numel for frag in self.fragments],
            "overlap": self.overlap,
            "mix": self.mix,
            "compression": None if self.compression is None else self.compression.spec,
            **optimizer_settings("outer optimizer", self.fragments[0].outer),
        }

    def _drain(self) -> None:
        for frag in self.fragments:
            if frag.pending is not None:
                frag.pending.wait()

    def _recover_local(self) -> int:
        fixed = super()._recover_local()
        if not all_finite(self.params):
            # this rank diverged: its other fragments would poison the next steps' gradients
            for frag in self.fragments:
                frag.anchor.copy_to(frag.params)
        return fixed

    # -- state -------------------------------------------------------------------------------

    @property
    def anchor_views(self) -> list[torch.Tensor]:
        """A for every trainable parameter, in model order (for checks and evaluation)."""
        by_id = {
            id(p): v for frag in self.fragments for p, v in zip(frag.params, frag.anchor.views)
        }
        return [by_id[id(p)] for p in self.params]

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "num_fragments": self.num_fragments,
            "overlap": self.overlap,
            "sync_points": self.sync_points,
            "in_flight": [[k, f] for k, f in sorted(self._in_flight.items())],
        }
        for i, frag in enumerate(self.fragments):
            state[f"fragment_{i}"] = frag.state_dict()
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        for key, mine in (("num_fragments", self.num_fragments), ("overlap", self.overlap)):
            if state.get(key) != mine:
                raise ValueError(
                    f"state_dict was saved with {key}={state.get(key)!r} but this "
                    f"{type(self).__name__} has {key}={mine!r}; resume with the same settings"
                )
        self.sync_points = int(state["sync_points"])
        for i, frag in enumerate(self.fragments):
            key = f"fragment_{i}"
            if key not in state:
                raise ValueError(f"{type(self).__name__} state_dict is missing {key!r}")
            check_sharding(state[key], self.shard_outer_state, type(self).__name__)
            frag.load_state_dict(state[key], self.comm, self._load_tensors)
        self._in_flight = {int(k): int(f) for k, f in state["in_flight"]}
        for k, f in self._in_flight.items():
            if self.fragments[f].pending is None:
                raise ValueError(
                    f"state_dict lists sync point {k} (fragment {f}) in flight but holds no "
                    "result for it; the checkpoint is inconsistent"
                )
