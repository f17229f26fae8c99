"""DeMo: decoupled momentum, a per-step optimizer that sends only the fast components of each
rank's momentum, used *instead of* DDP's gradient all-reduce.

Paper: Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", 2024
(https://arxiv.org/abs/2411.19870); official code bloc97/DeMo ``demo.py``, whose arithmetic
this follows. Per parameter, with η the group's lr, β = ``compression_decay``, k =
``compression_topk``, s = ``compression_chunk``, λ = ``weight_decay`` and g the rank's *local*
gradient:

1. p ← p·(1 − ηλ);  m ← β·m + η·g  (m: this rank's residual momentum, ``state["delta"]``);
2. q ← the k largest-magnitude coefficients of each chunk of the chunked orthonormal DCT of m
   (:mod:`lowcomm.optim.dct`; indices local to the chunk, signed values);
3. m ← m − IDCT(q)  (what is not sent stays: error feedback);
4. all-gather every rank's (indices, values); per chunk and coefficient the mean over the ranks
   that sent it (``scatter_reduce(mean, include_self=False)``), Q = IDCT of that;
5. p ← p − η·sign(Q).

Every rank decodes the same gathered set with the same operations, so the replicas stay
bit-identical. What the official code gets wrong and lowcomm fixes: m lives in
``optimizer.state`` (``state_dict`` checkpoints it; the official code keeps it aside and loses
it); a parameter whose ``.grad`` is ``None`` is skipped (on every rank alike, as with DDP's
unused parameters; the official code crashes); tensors of any rank (the last two dimensions
chunked, leading ones batched; 0-d as one element); indices sent as int32 (gloo all-gathers no
int16); and one pair of all-gathers per step over flat buckets of every parameter's indices
and values, not two per parameter, counted exactly in :attr:`DeMo.stats`.

``overlap=True`` applies the update gathered at step t at step t + 1 (and the one of the last
step at :meth:`DeMo.finish`), so the all-gather runs behind the next forward and backward, as
the production descendant of DeMo does: the gradient of step t + 1 is then taken one update
late.

Example::

    model = build_model()                        # the same initial weights on every rank
    opt = lowcomm.DeMo(model.parameters(), lr=3e-4, compression_topk=32)
    for batch in loader:
        loss_fn(model, batch).backward()         # no DDP wrapper: no gradient all-reduce
        opt.step(); opt.zero_grad()
    opt.finish()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import Communicator, Handle
from lowcomm.guard import explain_lost_collectives
from lowcomm.hparams import (
    HyperparameterError,
    Hyperparameters,
    check_number,
    check_positive_int,
    hyper,
)
from lowcomm.optim.dct import ChunkPlan, decode, encode

__all__ = ["DeMo", "DeMoConfig", "demo_compress", "demo_decode"]

INDEX_DTYPE = torch.int32
"""Indices on the wire: the smallest integer type gloo all-gathers."""


def demo_compress(
    m: torch.Tensor, plan: ChunkPlan, topk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2 and 3 for one tensor: ``(indices, values, transmitted)`` with ``indices`` and
    ``values`` of shape ``(chunks, k)`` (k = ``topk`` clamped to the chunk) and
    ``transmitted`` = IDCT(q), the part of m they carry (the caller subtracts it)."""
    coeffs = encode(m, plan)
    k = max(1, min(topk, plan.per_chunk))
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=False).indices
    val = torch.gather(coeffs, -1, idx)
    own = torch.zeros_like(coeffs).scatter_reduce_(-1, idx, val, "mean", include_self=False)
    return idx, val, decode(own, plan)


def demo_decode(
    indices: list[torch.Tensor], values: list[torch.Tensor], plan: ChunkPlan
) -> torch.Tensor:
    """Step 4 for one tensor: the ranks' ``(chunks, k)`` indices and values, in rank order →
    Q = IDCT of the per-coefficient mean over the ranks that sent each coefficient.

    The sums are taken rank after rank (one ``scatter_add_`` per rank, whose indices are
    distinct within a chunk), so each coefficient's sum is added up in rank order on every
    device: on a GPU a single ``scatter_reduce`` over every rank's values adds colliding
    coefficients with atomics, in an order that may differ from rank to rank, and the
    replicas would drift apart. The same bits as ``scatter_reduce_(mean, include_self=False)``
    on the CPU (the official code's), which adds them in this order too."""
    dtype, device = values[0].dtype, values[0].device
    total = torch.zeros(plan.chunks, plan.per_chunk, dtype=dtype, device=device)
    count = torch.zeros(plan.chunks, plan.per_chunk, dtype=dtype, device=device)
    for idx, val in zip(indices, values):
        idx = idx.long()
        total.scatter_add_(-1, idx, val)
        count.scatter_add_(-1, idx, torch.ones_like(val))
    return decode(total.div_(count.clamp_(min=1)), plan)


def _check_overlap(key: str, value: Any) -> None:
    if value not in (0, 1) or (not isinstance(value, (bool, int))):
        raise HyperparameterError(key, f"must be True or False (1 or 0), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DeMoConfig(Hyperparameters):
    """DeMo's compression settings (the official code's defaults): what ``lowcomm train
    --algo demo`` takes besides the job's lr and weight decay."""

    compression_decay: float = hyper(
        0.999,
        doc="decay of each rank's residual momentum m",
        symbol="β",
        check=check_number("must be in [0, 1), got {value!r}; e.g. {key}=0.999", 0, 1),
    )
    compression_topk: int = hyper(
        32, doc="DCT coefficients sent per chunk", symbol="k", check=check_positive_int(32)
    )
    compression_chunk: int = hyper(
        64,
        doc="target chunk size per dimension (the largest divisor not above it)",
        symbol="s",
        check=check_positive_int(64),
    )
    overlap: bool = hyper(
        False,
        doc="apply each step's gathered update one step later, so the all-gather runs behind "
        "the next step's compute",
        check=_check_overlap,
        job_type="int | None",
    )


@dataclass
class _Pending:
    """An all-gather in flight (``overlap``): what to decode and apply when it lands."""

    works: list[Any]
    indices: torch.Tensor
    """Every rank's indices, rank after rank (the all-gather's output)."""
    values: torch.Tensor
    params: list[torch.Tensor]
    lrs: list[float]
    layouts: list[tuple[ChunkPlan, int]]
    """Each parameter's chunking and k, in the order of the gathered buffers."""

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.indices, self.values


class DeMo(torch.optim.Optimizer):
    """DeMo (see the module docstring). Hyperparameters may differ per param group, as in
    torch's optimizers.

    Args:
        params: parameters or param groups.
        lr: η.
        compression_decay: β, the residual momentum's decay (0 ≤ β < 1).
        compression_topk: k, coefficients kept per chunk.
        compression_chunk: s, the target chunk size per dimension.
        weight_decay: λ, decoupled (p ← p·(1 − ηλ)).
        process_group: the ranks to gather over (``None``: WORLD), or a
            :class:`~lowcomm.comm.Communicator` (an emulated link).
        overlap: apply each step's gathered update one step later (see the module docstring).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        process_group: dist.ProcessGroup | Communicator | None = None,
        overlap: bool = False,
    ) -> None:
        config = DeMoConfig(
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            overlap=overlap,
        )
        check_number("must be a finite number > 0, got {value!r}; e.g. lr=3e-4", 0, open_low=True)(
            "lr", lr
        )
        check_number("must be a finite number >= 0, got {value!r}", 0)("weight_decay", weight_decay)
        settings = asdict(config)
        del settings["overlap"]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **settings})
        group = process_group
        self.comm = group if isinstance(group, Communicator) else Communicator(group)
        self.overlap = bool(overlap)
        self._pending: _Pending | None = None
        self._plans: dict[tuple[torch.Size, int], ChunkPlan] = {}
        self.steps = 0
        """Steps that gathered an update (every step with a gradient)."""

    stats = property(lambda self: self.comm.stats, doc="This rank's communication counters.")
    outer_step = property(lambda self: self.steps, doc="Syncs so far: the steps taken.")

    def metrics(self) -> dict[str, float | int | None]:
        """This rank's numbers for loggers, under the outer algorithms' names
        (:meth:`lowcomm.outer.engine.OuterAlgorithm.metrics`): every step is a sync, so
        ``outer_step`` and ``inner_step`` are the steps taken; no pseudo-gradient."""
        return {"outer_step": self.steps, "inner_step": self.steps, **self.comm.stats.metrics()}

    def _layout(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[ChunkPlan, int]:
        """How ``p`` is chunked under ``group``'s settings, and k (clamped to a chunk)."""
        key = (p.shape, group["compression_chunk"])
        if key not in self._plans:
            self._plans[key] = ChunkPlan.for_shape(p.shape, group["compression_chunk"])
        plan = self._plans[key]
        return plan, max(1, min(group["compression_topk"], plan.per_chunk))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One DeMo step over every parameter with a gradient: one pair of all-gathers (on
        every rank the same number of times: a collective that never completes names that as
        its likely cause)."""
        with explain_lost_collectives("DeMo", "step()", lambda: self.steps):
            return self._demo_step(closure)

    def _demo_step(self, closure: Callable[[], float] | None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending is not None:
            self._apply(self._pending)
            self._pending = None
        params: list[torch.Tensor] = []
        lrs: list[float] = []
        layouts: list[tuple[ChunkPlan, int]] = []
        indices: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for group in self.param_groups:
            lr, decay, wd = group["lr"], group["compression_decay"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["delta"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                m = state["delta"]
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                m.mul_(decay)
                m.add_(p.grad.float(), alpha=lr)
                plan, k = self._layout(p, group)
                idx, val, sent = demo_compress(m, plan, k)
                m.sub_(sent)
                params.append(p)
                lrs.append(float(lr))
                layouts.append((plan, k))
                indices.append(idx.to(INDEX_DTYPE).reshape(-1))
                values.append(val.reshape(-1))
        if not params:
            return loss
        self.steps += 1
        pending = self._gather(params, lrs, layouts, indices, values)
        if self.overlap:
            self._pending = pending
        else:
            self._apply(pending)
        return loss

    def _gather(
        self,
        params: list[torch.Tensor],
        lrs: list[float],
        layouts: list[tuple[ChunkPlan, int]],
        indices: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> _Pending:
        n = self.comm.world_size
        idx_send, val_send = torch.cat(indices), torch.cat(values)
        idx_out = torch.empty(n * idx_send.numel(), dtype=idx_send.dtype, device=idx_send.device)
        val_out = torch.empty(n * val_send.numel(), dtype=val_send.dtype, device=val_send.device)
        works = [
            self.comm.all_gather_async(idx_send, idx_out),
            self.comm.all_gather_async(val_send, val_out),
        ]
        # one handle: the time blocked and in flight are counted like every collective's
        handle = Handle(works, [idx_out, val_out], 1, self.comm.stats)
        return _Pending([handle], idx_out, val_out, params, lrs, layouts)

    def _apply(self, pending: _Pending) -> None:
        idx_out, val_out = pending.wait()
        n = self.comm.world_size
        idx_ranks = idx_out.view(n, -1)
        val_ranks = val_out.view(n, -1)
        offset = 0
        for p, lr, (plan, k) in zip(pending.params, pending.lrs, pending.layouts):
            size = plan.chunks * k
            per_rank_idx = [
                idx_ranks[r, offset : offset + size].view(plan.chunks, k) for r in range(n)
            ]
            per_rank_val = [
                val_ranks[r, offset : offset + size].view(plan.chunks, k) for r in range(n)
            ]
            offset += size
            q = demo_decode(per_rank_idx, per_rank_val, plan)
            p.add_(torch.sign(q).to(p.dtype), alpha=-lr)

    @property
    def in_flight(self) -> bool:
        """Whether a gathered update is still in flight (``overlap``: from one step to the
        next)."""
        return self._pending is not None

    def finish(self) -> None:
        """Apply the update still in flight (``overlap``); idempotent."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with (
                torch.no_grad(),
                explain_lost_collectives("DeMo", "finish()", lambda: self.steps),
            ):
                self._apply(pending)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (with every residual m), plus, with ``overlap``, the update
        gathered and not yet applied (waited for, so resuming gives the same numbers)."""
        state = super().state_dict()
        state["demo_steps"] = self.steps
        state["demo_pending"] = None
        if self._pending is not None:
            idx_out, val_out = self._pending.wait()
            ids = {id(p): i for i, p in enumerate(self._all_params())}
            state["demo_pending"] = {
                "params": [ids[id(p)] for p in self._pending.params],
                "lrs": list(self._pending.lrs),
                "indices": idx_out.clone(),
                "values": val_out.clone(),
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        pending = state_dict.pop("demo_pending", None)
        steps = int(state_dict.pop("demo_steps", 0))
        if pending is not None and not self.overlap:
            raise ValueError(
                "DeMo state_dict holds an update in flight (saved with overlap=True) but this "
                "DeMo has overlap=False; resume with the same settings"
            )
        super().load_state_dict(state_dict)
        self.steps = steps
        self._pending = None
        if pending is not None:
            placed = [(p, g) for g in self.param_groups for p in g["params"]]
            chosen = [placed[i] for i in pending["params"]]
            # a checkpoint is read onto the CPU: the update goes where the parameters are
            device = chosen[0][0].device if chosen else pending["indices"].device
            self._pending = _Pending(
                [],
                pending["indices"].to(device, copy=True),
                pending["values"].to(device, copy=True),
                [p for p, _ in chosen],
                [float(x) for x in pending["lrs"]],
                [self._layout(p, g) for p, g in chosen],
            )

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def bytes_per_step(self) -> int:
        """Bytes this rank contributes per step when every parameter has a gradient:
        chunks × k × (index + value bytes), summed over the parameters."""
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                plan, k = self._layout(p, group)
                total += plan.chunks * k * (torch.iinfo(INDEX_DTYPE).bits // 8 + 4)
        return total
