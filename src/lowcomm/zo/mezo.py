"""MeZO-SGD with the seed trick, and DistZO2's ways of spreading it over ranks.

One step (Malladi et al. 2023, the official ``zo_step`` / ``zo_update``): a seed s; z ~ N(0, 1)
per parameter, drawn in ``named_parameters()`` order from a ``torch.Generator`` seeded with s and
never stored (regenerated for every pass, one tensor at a time);

    θ ← θ + εz;  L₊ = L(θ)     θ ← θ − 2εz;  L₋ = L(θ)     θ ← θ + εz
    g = (L₊ − L₋) / (2ε)
    θ ← θ − lr·(g·z + wd·θ)        (no decay where MeZO has none: names holding "bias",
                                     "layer_norm" or "layernorm")

with the forwards in eval mode under ``torch.inference_mode()``. The arithmetic is MeZO's bit for
bit (``z.mul_(c).mul_(ε); p.add_(z)`` is its ``p + c*z*ε``; the update is its
``p − lr*(g*z + wd*p)`` in place). With ``n_directions`` = n > 1 the n estimates are taken at the
same θ (seeds s₁…sₙ), then applied one after the other, θ ← θ − lr·((gₖ/n)·zₖ + (wd/n)·θ),
each zₖ regenerated: no parameter-sized memory beyond one transient z (n = 1 is MeZO).

Every rank derives sₖ from (``seed``, step, k) with no communication. The modes (DistZO2, Wang
et al. 2025), over any process group:

* ``single``: every rank alone (the reference; one process).
* ``pertp`` (2 ranks, the same batch): rank 0 evaluates L₊, rank 1 L₋, and they all-gather the
  two floats. Both replay every in-place addition (+1, −2, +1) and skip only the forward they do
  not own, so the replicas stay bit-identical to single-process MeZO.
* ``ddp`` (W ranks, each its shard of the batch): each rank evaluates L₊ and L₋ on its shard;
  one all-gather of (examples, L₊, L₋) per rank; the global L± = Σᵣ wᵣ L±ᵣ with wᵣ = nᵣ / Σn,
  summed in float64 in rank order on every rank, then rounded to the losses' float32 for MeZO's
  g. Bit-identical to a single-process sharded reference; equal to MeZO on the whole batch up to
  the rounding of that sum.
* ``2d`` (W = 2D ranks): the pairs (2p, 2p + 1) do PertP on shard p; one all-gather of the
  weighted losses. On 4 ranks bit-identical to ``ddp`` on 2 with the same shards.

``blockwise`` (ZO2, Wang et al. 2025): the forward as stages (``GPT.zo_stages``); per stage,
the previous step's update and +εz of the parameters it owns, its + forward, −2εz, its −
forward, +εz, so each stage's two forwards run back to back while its parameters are at hand,
and z is drawn twice per step instead of four times (the update's draw is fused into the next
pass). Every parameter still sees MeZO's operations in MeZO's order from one generator stream
per seed, in ``named_parameters()`` order, so nothing changes by a bit; a tied weight (the
embedding that is also the head) keeps its θ + εz until its last stage. :meth:`MeZO.flush`
applies the pending update.

``offload`` (ZO2's offloading, :mod:`lowcomm.zo.offload`): the blocks' parameters live in host
memory and each is uploaded into a pool of ``offload_buffers`` device buffers just before its
stage (the next one's upload overlapping this one's forwards), updated and perturbed there, and
copied back after it; the embeddings and the tied head stay on the device. The same operations
in the same order on the same device: the same bits as ``blockwise`` alone.

Bytes per rank per step: a few floats (3 or 2 per direction, float64), whatever the model.
Every ``check_every`` steps the ranks compare a 64-bit digest of their parameters (8 bytes each)
and a replica that drifted raises :class:`ReplicaDriftError` naming the step.

Example::

    zo = MeZO(model, lr=1e-6, eps=1e-3, mode="ddp")          # under torchrun
    for batch in loader:                                      # this rank's shard
        result = zo.step(lambda: loss_fn(model, batch), weight=len(batch))
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import CommStats, Communicator
from lowcomm.device import collective_device
from lowcomm.zo.offload import StageOffloader

__all__ = ["MODES", "MeZO", "ReplicaDriftError", "Stage", "ZOStep", "mezo_decays", "zo_seed"]

MODES = ("single", "pertp", "ddp", "2d")

Stage = tuple[Sequence[nn.Module], Callable[[Any], Any]]
"""A piece of a model's forward for ``blockwise`` steps: the modules whose parameters it reads,
and the function from the previous stage's output to its own."""

SEED_RANGE = 1_000_000_000
"""Seeds are drawn from [0, 1e9), as MeZO draws them."""


class ReplicaDriftError(RuntimeError):
    """The ranks' parameters differ where they must be replicas."""


def zo_seed(seed: int, step: int, direction: int = 0) -> int:
    """The seed of direction ``direction`` of step ``step`` (1-based): the same on every rank,
    from (``seed``, step, direction) alone."""
    state = np.random.SeedSequence([seed, step, direction]).generate_state(2, dtype=np.uint64)
    return int(state[0] % SEED_RANGE)


def mezo_decays(name: str) -> bool:
    """MeZO's weight-decay rule: every parameter but those whose name holds ``bias``,
    ``layer_norm`` or ``layernorm``. (Norm weights named otherwise, ``ln_1`` or ``norm``, are
    decayed, as MeZO decays them.)"""
    return "bias" not in name and "layer_norm" not in name and "layernorm" not in name


@dataclass
class ZOStep:
    """What a step computed, the same on every rank."""

    step: int
    lr: float
    loss_plus: list[float]
    """L₊ per direction (the global one in ``ddp`` and ``2d``)."""
    loss_minus: list[float]
    projected_grads: list[float]
    """g per direction."""

    @property
    def loss(self) -> float:
        """The mean of L₊ over the directions: MeZO's reported training loss."""
        return sum(self.loss_plus) / len(self.loss_plus)


class MeZO:
    """MeZO-SGD over ``model_or_params`` (an ``nn.Module``, whose trainable
    ``named_parameters()`` are optimized, or ``(name, parameter)`` pairs); see the module
    docstring.

    Args:
        lr: the learning rate, or a function of the 1-based step returning it.
        eps: ε, the perturbation scale.
        weight_decay: wd, where ``decays(name)`` (MeZO's rule by default).
        n_directions: n, estimates per step.
        seed: the base of every step's seeds.
        mode: ``single``, ``pertp``, ``ddp`` or ``2d``.
        process_group: the ranks of a distributed mode (``None``: WORLD), or a
            :class:`~lowcomm.comm.Communicator`.
        check_every: compare the replicas' parameters every this many steps (0: never).
        blockwise: ZO2's fused dual forward: :meth:`step` takes ``stages`` and runs each
            stage's two forwards back to back, applying the previous step's update to a
            stage's parameters just before (lazily; :meth:`flush` applies what is pending).
            Changes no bit (see the module docstring); one direction only.
        offload: ZO2's offloading (implies ``blockwise``): the blocks' parameters stay in
            (pinned) host memory between their stages, the rest of the model moves to
            ``device``; see :mod:`lowcomm.zo.offload`. Changes no bit.
        device: with ``offload``, the compute device (default: the current CUDA device when
            there is one, else the CPU).
        offload_buffers: with ``offload``, the device buffers, each holding one stage (≥ 2).
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
        *,
        lr: float | Callable[[int], float] = 1e-6,
        eps: float = 1e-3,
        weight_decay: float = 0.0,
        n_directions: int = 1,
        seed: int = 0,
        mode: str = "single",
        process_group: dist.ProcessGroup | Communicator | None = None,
        check_every: int = 100,
        decays: Callable[[str], bool] = mezo_decays,
        blockwise: bool = False,
        offload: bool = False,
        device: torch.device | str | None = None,
        offload_buffers: int = 2,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        _check_positive("eps", eps)
        if not callable(lr):
            _check_positive("lr", lr, allow_zero=True)
        if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        for key, value in (("n_directions", n_directions), ("check_every", check_every)):
            low = 1 if key == "n_directions" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.module = model_or_params if isinstance(model_or_params, nn.Module) else None
        named: list[tuple[str, torch.Tensor]]
        if isinstance(model_or_params, nn.Module):
            named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
        else:
            named = list(model_or_params)
        if not named:
            raise ValueError("MeZO got no trainable parameters to optimize")
        self.named = named
        self.decay = [bool(decays(n)) and weight_decay != 0 for n, _ in named]
        self.lr = lr
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.n_directions = n_directions
        self.seed = seed
        self.mode = mode
        self.check_every = check_every
        self.steps = 0
        self.comm: Communicator | None = None
        self.rank, self.world_size = 0, 1
        if mode != "single":
            group = process_group
            self.comm = group if isinstance(group, Communicator) else Communicator(group)
            self.rank, self.world_size = self.comm.rank, self.comm.world_size
            w = self.world_size
            if mode == "pertp" and w != 2:
                raise ValueError(f"mode 'pertp' runs on 2 ranks (one per sign), got {w}")
            if mode == "2d" and (w < 2 or w % 2):
                raise ValueError(f"mode '2d' runs on an even number of ranks (pairs), got {w}")
        if (blockwise or offload) and n_directions != 1:
            what = "offload" if offload else "blockwise"
            raise ValueError(f"{what}=True takes one direction per step (n_directions=1)")
        self.blockwise = bool(blockwise or offload)
        self.offloader: StageOffloader | None = None
        if offload:
            if device is None:
                device = torch.device("cuda") if torch.cuda.is_available() else "cpu"
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.offloader = StageOffloader(device, offload_buffers)
        elif device is not None:
            raise ValueError("device= is the compute device of offload=True; pass offload=True")
        self._pending: tuple[int, float, float] | None = None
        """blockwise: the (seed, g, lr) of the update not yet applied."""
        self._index = {id(p): i for i, (_, p) in enumerate(named)}
        self._stage_plan: list[tuple[list[int], list[int]]] | None = None
        self.device = self.offloader.device if self.offloader else named[0][1].device
        """Where z is drawn and the forwards run."""
        self.generator = torch.Generator(device=self.device)
        self._update_generator = torch.Generator(device=self.device)

    stats = property(
        lambda self: self.comm.stats if self.comm is not None else CommStats(),
        doc="This rank's communication counters.",
    )
    outer_step = property(lambda self: self.steps, doc="Steps taken (each exchanges once).")

    # -- what this rank evaluates -----------------------------------------------------------

    def _signs(self) -> tuple[bool, bool]:
        """Whether this rank evaluates L₊ and L₋."""
        if self.mode in ("pertp", "2d"):
            return self.rank % 2 == 0, self.rank % 2 == 1
        return True, True

    def lr_at(self, step: int) -> float:
        return float(self.lr(step)) if callable(self.lr) else float(self.lr)

    # -- the two passes over the parameters -------------------------------------------------

    def _z(self, p: torch.Tensor) -> torch.Tensor:
        return torch.normal(
            mean=0, std=1, size=p.size(), generator=self.generator, device=p.device, dtype=p.dtype
        )

    @torch.no_grad()
    def _perturb(self, seed: int, scale: int) -> None:
        """θ ← θ + scale·z·ε, MeZO's ``p + scaling_factor*z*eps`` bit for bit."""
        self.generator.manual_seed(seed)
        for _, p in self.named:
            z = self._z(p)
            z.mul_(scale).mul_(self.eps)
            p.add_(z)

    @torch.no_grad()
    def _update(self, seed: int, g: float, lr: float) -> None:
        """θ ← θ − lr·(g·z + wd·θ), MeZO's ``p − lr*(g*z + wd*p)`` bit for bit (with n > 1:
        g/n and wd/n)."""
        n = self.n_directions
        g_k = g / n if n > 1 else g
        wd = self.weight_decay / n if n > 1 else self.weight_decay
        self.generator.manual_seed(seed)
        for (_, p), decays in zip(self.named, self.decay):
            self._update_one(p, self._z(p), g_k, wd, lr, decays)

    @staticmethod
    def _update_one(
        p: torch.Tensor, z: torch.Tensor, g: float, wd: float, lr: float, decays: bool
    ) -> None:
        z.mul_(g)
        if decays:
            z.add_(p.mul(wd))
        z.mul_(lr)
        p.sub_(z)

    @torch.no_grad()
    def flush(self, stages: Sequence[Stage] | None = None) -> None:
        """Apply the update a ``blockwise`` step left pending (before evaluating or saving the
        model; the next step would apply it otherwise). A no-op without one. With ``offload``,
        a pass over the stages, each block uploaded in turn; ``stages`` are needed only before
        the first step or evaluation (after a resume)."""
        if self._pending is None:
            return
        seed, g, lr = self._pending
        if self.offloader is None:
            self._pending = None
            self._update(seed, g, lr)
            return
        plan = self._place(stages)
        self._pending = None
        off = self.offloader
        self.generator.manual_seed(seed)
        off.begin()
        try:
            for k, (owned, _) in enumerate(plan):
                off.enter(k)
                for i in owned:
                    p = self.named[i][1]
                    self._update_one(p, self._z(p), g, self.weight_decay, lr, self.decay[i])
                off.leave(k)
        finally:
            off.end()

    def _place(self, stages: Sequence[Stage] | None) -> list[tuple[list[int], list[int]]]:
        """``offload``: the stages' plan, placing the model on the first call."""
        assert self.offloader is not None
        if stages is None:
            if self._stage_plan is None:
                raise ValueError(
                    "MeZO(offload=True) has not seen the model's stages yet: pass them, e.g. "
                    "flush(stages=model.zo_stages(x, y))"
                )
            return self._stage_plan
        plan = self._plan(stages)
        owned = [[self.named[i][1] for i in mine] for mine, _ in plan]
        self.offloader.place([modules for modules, _ in stages], owned)
        self._stage_plan = plan
        return plan

    @torch.no_grad()
    def evaluate(self, stages: Sequence[Stage]) -> torch.Tensor:
        """The loss the ``stages`` compute at the current parameters (the pending update
        applied first), in eval mode under ``torch.inference_mode()``: with ``offload`` each
        block uploaded in turn, the same bits as the model's own forward."""
        if not self.blockwise:
            raise ValueError("MeZO.evaluate(stages) is for blockwise=True or offload=True")
        off = self.offloader
        if off is not None:
            self._place(stages)
        self.flush()  # (offloaded: over the stages just placed)
        if off is not None:
            off.begin()
        was_training = self.module.training if self.module is not None else False
        if self.module is not None:
            self.module.eval()
        state: Any = None
        try:
            for k, (_, run) in enumerate(stages):
                if off is not None:
                    off.enter(k)
                with torch.inference_mode():
                    state = run(state)
                if off is not None:
                    off.leave(k, changed=False)
        finally:
            if off is not None:
                off.end()
            if self.module is not None:
                self.module.train(was_training)
        return state.detach().reshape(())

    def _plan(self, stages: Sequence[Stage]) -> list[tuple[list[int], list[int]]]:
        """Per stage, the parameters it reads first (its own, in ``named_parameters()`` order)
        and those an earlier stage owns (tied weights)."""
        seen: set[int] = set()
        order: list[int] = []
        plan = []
        for modules, _ in stages:
            ids: list[int] = []
            for module in modules:
                for p in module.parameters():
                    i = self._index.get(id(p))
                    if i is not None and i not in ids:
                        ids.append(i)
            owned = sorted(i for i in ids if i not in seen)
            plan.append((owned, [i for i in ids if i in seen]))
            seen.update(owned)
            order += owned
        if order != list(range(len(self.named))):
            raise ValueError(
                "blockwise stages must read every trainable parameter, the first reads in "
                "named_parameters() order (z is drawn in that order); check the stages' modules"
            )
        return plan

    @torch.no_grad()
    def _dual_pass(
        self, stages: Sequence[Stage], seed: int, plus: bool, minus: bool, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the stages: per stage, the pending update and +εz of the parameters it
        owns, its + forward, −2εz, its − forward, and +εz once a parameter's last stage is done.
        Every parameter sees MeZO's in-place operations in MeZO's order."""
        off = self.offloader
        plan = self._plan(stages) if off is None else self._place(stages)
        pending = self._pending
        self._pending = None
        if pending is not None:
            self._update_generator.manual_seed(pending[0])
        self.generator.manual_seed(seed)
        if off is not None:
            off.begin()  # the first blocks upload while the embeddings compute
        try:
            state_plus, state_minus = self._stages_pass(stages, plan, pending, plus, minus)
        finally:
            if off is not None:
                off.end()
        l_plus = state_plus.detach().reshape(()) if plus else zero
        l_minus = state_minus.detach().reshape(()) if minus else zero
        return l_plus, l_minus

    def _stages_pass(
        self,
        stages: Sequence[Stage],
        plan: list[tuple[list[int], list[int]]],
        pending: tuple[int, float, float] | None,
        plus: bool,
        minus: bool,
    ) -> tuple[Any, Any]:
        off = self.offloader
        last = {i: k for k, (owned, tied) in enumerate(plan) for i in (*owned, *tied)}
        zs: dict[int, torch.Tensor] = {}
        plus_values: dict[int, torch.Tensor] = {}  # θ + εz of tied weights, until their last use
        state_plus: Any = None
        state_minus: Any = None
        for k, ((_, run), (owned, tied)) in enumerate(zip(stages, plan)):
            if off is not None:
                off.enter(k)
            for i in owned:
                p = self.named[i][1]
                if pending is not None:
                    z_update = torch.normal(
                        mean=0,
                        std=1,
                        size=p.size(),
                        generator=self._update_generator,
                        device=p.device,
                        dtype=p.dtype,
                    )
                    _, g, lr = pending
                    self._update_one(p, z_update, g, self.weight_decay, lr, self.decay[i])
                z = self._z(p)
                p.add_(z.mul(1).mul_(self.eps))
                zs[i] = z
                if last[i] > k:
                    plus_values[i] = p.clone()
            if plus:
                minus_values = [(i, self.named[i][1].clone()) for i in tied]
                for i in tied:
                    self.named[i][1].copy_(plus_values[i])
                with torch.inference_mode():
                    state_plus = run(state_plus)
                for i, value in minus_values:
                    self.named[i][1].copy_(value)
            for i in owned:
                self.named[i][1].add_(zs[i].mul(-2).mul_(self.eps))
            if minus:
                with torch.inference_mode():
                    state_minus = run(state_minus)
            for i in (*owned, *tied):
                if last[i] == k:
                    self.named[i][1].add_(zs.pop(i).mul(1).mul_(self.eps))
                    plus_values.pop(i, None)
            if off is not None:
                off.leave(k)
        return state_plus, state_minus

    def _evaluate(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            loss = closure()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "the closure given to MeZO.step must return the loss as a one-element tensor"
            )
        return loss.detach().reshape(())

    # -- a step -----------------------------------------------------------------------------

    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        weight: float | None = None,
        *,
        stages: Sequence[Stage] | None = None,
    ) -> ZOStep:
        """One MeZO step: ``closure()`` returns this rank's loss on its batch at the current
        parameters (called once or twice per direction). ``weight`` (``ddp``, ``2d``): this
        rank's share of the global batch, e.g. its number of examples or tokens (default 1).
        With ``blockwise``, ``stages`` instead: the model's forward on this rank's batch as
        ``(modules, run)`` pairs, ``run`` taking the previous stage's output (``None`` for the
        first) and the last returning the loss (``GPT.zo_stages(x, y)``). Returns the same
        :class:`ZOStep` on every rank."""
        if self.blockwise != (stages is not None) or (closure is None) == (stages is None):
            raise ValueError(
                "MeZO.step takes stages=... with blockwise=True and a closure otherwise"
            )
        step = self.steps + 1
        lr = self.lr_at(step)
        seeds = [zo_seed(self.seed, step, k) for k in range(self.n_directions)]
        plus, minus = self._signs()
        was_training = self.module.training if self.module is not None else False
        if self.module is not None:
            self.module.eval()  # MeZO's forwards: dropout off
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        local: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            if stages is not None:
                local.append(self._dual_pass(stages, seeds[0], plus, minus, zero))
            for s in seeds if stages is None else []:
                assert closure is not None
                self._perturb(s, 1)
                l_plus = self._evaluate(closure) if plus else zero
                self._perturb(s, -2)
                l_minus = self._evaluate(closure) if minus else zero
                self._perturb(s, 1)
                local.append((l_plus, l_minus))
        finally:
            if self.module is not None:
                self.module.train(was_training)
        losses = self._combine(local, 1.0 if weight is None else float(weight))
        grads = []
        for l_plus, l_minus in losses:
            grads.append(float(((l_plus - l_minus) / (2 * self.eps)).item()))
        if self.blockwise:
            self._pending = (seeds[0], grads[0], lr)  # applied in the next pass (or flush())
        else:
            for s, g in zip(seeds, grads):
                self._update(s, g, lr)
        self.steps = step
        if self.check_every and self.comm is not None and step % self.check_every == 0:
            self.check_replicas()
        return ZOStep(
            step=step,
            lr=lr,
            loss_plus=[float(a) for a, _ in losses],
            loss_minus=[float(b) for _, b in losses],
            projected_grads=grads,
        )

    def _combine(
        self, local: list[tuple[torch.Tensor, torch.Tensor]], weight: float
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every direction's (L₊, L₋) of the whole group, as float32 scalars, the same bits on
        every rank: one all-gather of this rank's (weight, L₊, L₋ per direction)."""
        if self.comm is None:
            return local
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
        dtype = local[0][0].dtype
        device = local[0][0].device
        row = [weight]
        for l_plus, l_minus in local:
            row += [float(l_plus), float(l_minus)]
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.float64, device=device)
        self.comm.all_gather_async(mine, everyone).wait()
        table = everyone.reshape(self.world_size, -1).tolist()
        out = []
        for k in range(len(local)):
            if self.mode == "pertp":
                a, b = table[0][1 + 2 * k], table[1][2 + 2 * k]
            else:
                a, b = _weighted(table, k, pairs=self.mode == "2d")
            out.append(
                (
                    torch.tensor(a, dtype=dtype, device=device),
                    torch.tensor(b, dtype=dtype, device=device),
                )
            )
        return out

    # -- replicas and state -----------------------------------------------------------------

    def digest(self) -> int:
        """A 63-bit digest of every parameter's bits."""
        h = hashlib.sha256()
        for _, p in self.named:
            h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
        return int.from_bytes(h.digest()[:8], "little") >> 1

    def check_replicas(self) -> None:
        """Raise :class:`ReplicaDriftError` on every rank unless all hold the same parameters
        (8 bytes each over the group)."""
        if self.comm is None:
            return
        device = collective_device(self.comm)  # NCCL gathers GPU tensors only
        mine = torch.tensor([self.digest()], dtype=torch.int64, device=device)
        everyone = torch.empty(self.world_size, dtype=torch.int64, device=device)
        self.comm.all_gather_async(mine, everyone).wait()
        values = everyone.tolist()
        if len(set(values)) > 1:
            differ = [r for r, v in enumerate(values) if v != values[0]]
            raise ReplicaDriftError(
                f"MeZO ({self.mode}): after step {self.steps} the parameters of rank(s) "
                f"{differ} differ from rank 0's; every rank must replay the same perturbations "
                "and updates on the same starting model (same seed, same model, same lr)"
            )

    def state_dict(self) -> dict[str, Any]:
        """The step and settings; the seeds derive from them (the parameters are the model's)."""
        return {
            "step": self.steps,
            "seed": self.seed,
            "mode": self.mode,
            "eps": self.eps,
            "n_directions": self.n_directions,
            "weight_decay": self.weight_decay,
            "lr": None if callable(self.lr) else self.lr,
            "pending": None if self._pending is None else list(self._pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "mode", "eps", "n_directions", "weight_decay"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"MeZO state_dict was saved with {key}={state.get(key)!r} but this MeZO has "
                    f"{key}={getattr(self, key)!r}; resume with the same settings"
                )
        self.steps = int(state["step"])
        pending = state.get("pending")
        if pending is not None and not self.blockwise:
            raise ValueError(
                "MeZO state_dict holds a pending update (saved with blockwise=True); resume "
                "with blockwise=True, or flush() before saving"
            )
        self._pending = (
            None if pending is None else (int(pending[0]), float(pending[1]), float(pending[2]))
        )


def _weighted(table: list[list[float]], k: int, *, pairs: bool) -> tuple[float, float]:
    """Σ wᵣ L±ᵣ in float64, in rank (``pairs``: pair) order; wᵣ = nᵣ / Σn."""
    if pairs:  # 2d: pair p = ranks 2p (L₊) and 2p + 1 (L₋), the pair's weight is the + rank's
        shards = [
            (table[r][0], table[r][1 + 2 * k], table[r + 1][2 + 2 * k])
            for r in range(0, len(table), 2)
        ]
    else:
        shards = [(row[0], row[1 + 2 * k], row[2 + 2 * k]) for row in table]
    total = 0.0
    for n, _, _ in shards:
        total += n
    l_plus = l_minus = 0.0
    for n, a, b in shards:
        w = n / total
        l_plus += w * a
        l_minus += w * b
    return l_plus, l_minus


def _check_positive(key: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{key} must be a finite number {bound}, got {value!r}")
