"""Pure outer-loop updates over lists of tensors with matching shapes (``torch._foreach_*``), in
place, testable without any process group; the algorithm classes own the tensors and call them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "GAP_EPS",
    "clip_momentum_",
    "co2_outer_update_",
    "delay_compensation_",
    "flat_norm",
    "gap_aware_penalty",
    "noloco_groups",
    "noloco_outer_update_",
    "pseudo_gradient_",
    "pseudo_gradient_norm",
]

Tensors = Sequence[torch.Tensor]

GAP_EPS = 1e-8
"""ε of the Gap-Aware penalty Λ = 1 / max(1, |g| / (c + ε))."""

GAP_STAT_DECAY = 0.9
GAP_STAT_NEW = 0.1
"""c ← 0.9·c + 0.1·|Δ̄|: the running mean of |Δ̄| the gap is compared with."""


def pseudo_gradient_(out: Tensors, anchor: Tensors, params: Tensors) -> None:
    """Δᵢ = A − θᵢ into ``out`` (fp32; ``params`` may be bf16, cast by the copy), computed as
    ``−(θ − A)``, bitwise equal to ``A − θ`` in IEEE arithmetic: three ``_foreach`` operations
    whatever the number of tensors."""
    with torch.no_grad():
        torch._foreach_copy_(list(out), list(params))
        torch._foreach_sub_(list(out), list(anchor))
        torch._foreach_neg_(list(out))


def pseudo_gradient_norm(anchor: Tensors, params: Tensors) -> torch.Tensor:
    """‖A − θ‖ over all tensors (fp32, on the device: reading it is the caller's sync), in a
    fixed number of ``_foreach`` operations (the differences are allocated at once)."""
    with torch.no_grad():
        diff = torch._foreach_sub(list(anchor), list(params))
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diff)))


def flat_norm(buffers: Tensors) -> torch.Tensor:
    """The L2 norm of the values of flat ``buffers`` together (a bucket's: one reduction per
    buffer, none per tensor), as a 0-dim tensor on their device."""
    norms = [torch.linalg.vector_norm(b) for b in buffers]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def gap_aware_penalty(
    avg_delta: Tensors,
    last_update: Tensors,
    gap_stat: Tensors,
    *,
    first: bool,
    eps: float = GAP_EPS,
) -> list[torch.Tensor]:
    """CO2's staleness penalty in Gap-Aware form (Barkai et al. 2019), elementwise: c ← |Δ̄|
    (``first``) or 0.9·c + 0.1·|Δ̄| in ``gap_stat``, then Λ = 1 / max(1, |g| / (c + ε)) ∈ (0, 1]
    with the gap g = Δ̄ + u, u = ``last_update`` (A_t − A_{t−1})."""
    abs_delta = torch._foreach_abs(list(avg_delta))
    if first:
        torch._foreach_copy_(list(gap_stat), abs_delta)
    else:
        torch._foreach_mul_(list(gap_stat), GAP_STAT_DECAY)
        torch._foreach_add_(list(gap_stat), abs_delta, alpha=GAP_STAT_NEW)
    gap = torch._foreach_add(list(avg_delta), list(last_update))
    torch._foreach_abs_(gap)
    denom = torch._foreach_add(list(gap_stat), eps)
    torch._foreach_div_(gap, denom)
    torch._foreach_clamp_min_(gap, 1.0)
    torch._foreach_reciprocal_(gap)
    return list(gap)


def clip_momentum_(momentum: Tensors, *, clip: float | None, clip_mode: str) -> None:
    """Outer momentum clipping: clamp each element to [−φ, φ] (``"value"``) or scale the whole
    list to global L2 norm ≤ φ (``"norm"``, the ``clip_grad_norm_`` rule). ``None``: no-op."""
    if clip is None:
        return
    m = list(momentum)
    if clip_mode == "value":
        torch._foreach_clamp_min_(m, -clip)
        torch._foreach_clamp_max_(m, clip)
    elif clip_mode == "norm":
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(m)))
        scale = torch.clamp(clip / (total + 1e-6), max=1.0)
        torch._foreach_mul_(m, scale)
    else:
        raise ValueError(f"clip_mode must be 'value' or 'norm', got {clip_mode!r}")


def co2_outer_update_(
    anchor: Tensors,
    momentum: Tensors,
    gap_stat: Tensors,
    last_update: Tensors,
    avg_delta: Tensors,
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    clip: float | None,
    clip_mode: str,
    gap_penalty: str | float,
    first: bool,
) -> None:
    """One CO2 outer step with the stale average Δ̄: m ← β·m + Λ ⊙ Δ̄, m ← clip(m, φ),
    A ← A − α·m (nesterov: A ← A − α·(Λ ⊙ Δ̄ + β·m)), u ← A_new − A_old (``last_update``, for
    the next gap). Λ: ``"gap_aware"`` (:func:`gap_aware_penalty`; ``first`` seeds its c),
    ``"none"`` (1) or a float λ ≥ 1 (1/λ)."""
    a, m, u = list(anchor), list(momentum), list(last_update)
    scaled: list[torch.Tensor]
    if gap_penalty == "gap_aware":
        penalty = gap_aware_penalty(avg_delta, u, gap_stat, first=first)
        scaled = list(torch._foreach_mul(penalty, list(avg_delta)))
    elif gap_penalty == "none":
        scaled = [d.clone() for d in avg_delta]
    else:
        assert isinstance(gap_penalty, float) and math.isfinite(gap_penalty) and gap_penalty >= 1
        scaled = list(torch._foreach_div(list(avg_delta), gap_penalty))
    torch._foreach_mul_(m, beta)
    torch._foreach_add_(m, scaled)
    clip_momentum_(m, clip=clip, clip_mode=clip_mode)
    step = torch._foreach_add(scaled, m, alpha=beta) if nesterov else m
    torch._foreach_copy_(u, a)
    torch._foreach_add_(a, step, alpha=-lr)
    torch._foreach_sub_(u, a)
    torch._foreach_neg_(u)


def delay_compensation_(
    params: Tensors,
    new_anchor: Tensors,
    snapshot: Tensors,
    *,
    lambda0: float,
) -> None:
    """CoCoDC's merge of one fragment, per tensor, in place on ``params`` (θ_now), with θ_s
    the ``snapshot`` at launch and Â the ``new_anchor``: g = θ_s − θ_now, D = Â − θ_s,
    h = g ⊙ g ⊙ D, λ = λ₀·‖g‖/‖h‖ (0 when h = 0), θ ← Â − (g + λ·h). Every tensor's λ is
    formed on the device (``_foreach`` operations and one ``where``, nothing read by the host)."""
    with torch.no_grad():
        g = torch._foreach_sub(list(snapshot), list(params))
        out = torch._foreach_sub(list(new_anchor), g)
        if lambda0 != 0.0 and g:
            h = torch._foreach_mul(g, g)
            torch._foreach_mul_(h, torch._foreach_sub(list(new_anchor), list(snapshot)))
            h_norm = torch.stack(torch._foreach_norm(h))
            g_norm = torch.stack(torch._foreach_norm(g))
            lam = torch.where(h_norm > 0, lambda0 * g_norm / h_norm, torch.zeros_like(h_norm))
            torch._foreach_mul_(h, list(lam.unbind()))
            torch._foreach_sub_(out, h)
        torch._foreach_copy_(list(params), out)


def noloco_groups(world_size: int, group_size: int, step: int, seed: int = 0) -> list[list[int]]:
    """NoLoCo's random groups for the sync after inner step ``step``, the same on every rank
    with no communication: a permutation of the ranks from numpy's ``default_rng(seed + step +
    1)`` cut strided into G = max(1, W // n) groups (group ``i mod G`` gets ``perm[i]``), as the
    official code's ``create_random_permutation`` and ``batched`` do with ``seed`` 0. Where W is
    not a multiple of n (the official code asserts it is) the last W mod n ranks of the
    permutation join the last group. Each group is listed in rank order."""
    perm = [int(r) for r in np.random.default_rng(seed + step + 1).permutation(world_size)]
    count = max(1, world_size // group_size)
    full = min(world_size, count * group_size)
    groups: list[list[int]] = [[] for _ in range(count)]
    for i, r in enumerate(perm[:full]):
        groups[i % count].append(r)
    groups[-1].extend(perm[full:])
    return [sorted(g) for g in groups]


def noloco_outer_update_(
    anchor: Tensors, momentum: Tensors, group_mean: Tensors, *, lr: float, momentum_coef: float
) -> None:
    """One NoLoCo outer step (heavy ball, as the official ``SparseOptimizerC``), in place, with
    φ the ``anchor`` (this rank's outer weights), δ its ``momentum`` and the group's mean live
    weights θ̄_G: δ ← μ·δ + α·(θ̄_G − φ); φ ← φ + δ. (The official code's two α terms,
    α·mean_G(θ − φ) + α·(mean_G φ − φᵢ), add up to this one.)"""
    diff = torch._foreach_sub(list(group_mean), list(anchor))
    torch._foreach_mul_(list(momentum), momentum_coef)
    torch._foreach_add_(list(momentum), diff, alpha=lr)
    torch._foreach_add_(list(anchor), list(momentum))
