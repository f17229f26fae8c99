"""The pure outer updates, pinned against element-by-element formulas and degenerate cases."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from lowcomm.outer.functional import (
    GAP_EPS,
    clip_momentum_,
    co2_outer_update_,
    delay_compensation_,
    gap_aware_penalty,
    noloco_groups,
    noloco_outer_update_,
    pseudo_gradient_,
)


def _rand(*shapes: int) -> list[torch.Tensor]:
    return [torch.randn(s) for s in shapes]


def test_pseudo_gradient_is_anchor_minus_params_bitwise() -> None:
    anchor, params = _rand(7, 5), _rand(7, 5)
    out = [torch.empty(7), torch.empty(5)]
    pseudo_gradient_(out, anchor, params)
    assert all(torch.equal(o, a - p) for o, a, p in zip(out, anchor, params))


def test_pseudo_gradient_of_bf16_params_is_fp32() -> None:
    anchor, params = _rand(6), [torch.randn(6).bfloat16()]
    out = [torch.empty(6)]
    pseudo_gradient_(out, anchor, params)
    assert torch.equal(out[0], anchor[0] - params[0].float())


def test_gap_aware_penalty_matches_elementwise_formula() -> None:
    d, u = _rand(50), _rand(50)
    c0 = [torch.rand(50)]
    c = [c0[0].clone()]
    lam = gap_aware_penalty(d, u, c, first=False)
    for i in range(50):
        ci = 0.9 * c0[0][i].item() + 0.1 * abs(d[0][i].item())
        expect = 1.0 / max(1.0, abs(d[0][i].item() + u[0][i].item()) / (ci + GAP_EPS))
        assert lam[0][i].item() == pytest.approx(expect, rel=1e-5)
        assert c[0][i].item() == pytest.approx(ci, rel=1e-5)
    assert (lam[0] < 1).any() and (lam[0] == 1).any()


def test_gap_aware_first_update_seeds_the_statistic() -> None:
    d, u, c = _rand(20), [torch.zeros(20)], [torch.full((20,), 123.0)]
    lam = gap_aware_penalty(d, u, c, first=True)
    assert torch.equal(c[0], d[0].abs())
    # with no previous outer update the gap is Δ̄ itself, so Λ = 1 (up to ε)
    assert torch.allclose(lam[0], torch.ones(20))


def test_clip_by_value_and_norm() -> None:
    m = [torch.tensor([3.0, -0.2, -5.0]), torch.tensor([0.5])]
    clip_momentum_(m, clip=1.0, clip_mode="value")
    assert m[0].tolist() == [1.0, pytest.approx(-0.2), -1.0] and m[1].item() == 0.5
    m = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # norm 13
    clip_momentum_(m, clip=1.3, clip_mode="norm")
    total = math.sqrt(sum(float(t.pow(2).sum()) for t in m))
    assert total == pytest.approx(1.3, rel=1e-5)
    assert m[0][0].item() == pytest.approx(0.3, rel=1e-5)
    small = [torch.tensor([0.1, 0.2])]
    clip_momentum_(small, clip=5.0, clip_mode="norm")
    assert torch.allclose(small[0], torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="clip_mode"):
        clip_momentum_(small, clip=1.0, clip_mode="bogus")


def test_co2_without_penalty_or_clip_follows_its_recurrence() -> None:
    """Λ ≡ 1, no clipping: m ← β·m + Δ̄; A ← A − α·m; u = A_new − A_old, exactly."""
    alpha, beta = 0.8, 0.5
    a = [torch.randn(9)]
    m, c, u = [torch.zeros(9)], [torch.zeros(9)], [torch.zeros(9)]
    a_ref, m_ref = a[0].clone(), torch.zeros(9)
    for k in range(5):
        d = [torch.randn(9)]
        co2_outer_update_(
            a,
            m,
            c,
            u,
            d,
            lr=alpha,
            beta=beta,
            nesterov=False,
            clip=None,
            clip_mode="value",
            gap_penalty="none",
            first=k == 0,
        )
        m_ref = m_ref * beta + d[0]
        old = a_ref.clone()
        a_ref = a_ref - alpha * m_ref
        assert torch.allclose(m[0], m_ref, atol=1e-6)
        assert torch.allclose(a[0], a_ref, atol=1e-6)
        assert torch.allclose(u[0], a_ref - old, atol=1e-6)


def test_co2_nesterov_and_constant_divisor() -> None:
    alpha, beta, lam = 1.0, 0.5, 4.0
    a, m = [torch.zeros(3)], [torch.ones(3)]
    d = [torch.tensor([4.0, -8.0, 2.0])]
    co2_outer_update_(
        a,
        m,
        [torch.zeros(3)],
        [torch.zeros(3)],
        d,
        lr=alpha,
        beta=beta,
        nesterov=True,
        clip=None,
        clip_mode="value",
        gap_penalty=lam,
        first=True,
    )
    scaled = d[0] / lam
    m_expect = 0.5 * torch.ones(3) + scaled
    assert torch.equal(m[0], m_expect)
    assert torch.allclose(a[0], -(scaled + beta * m_expect))


def test_gap_penalty_damps_a_large_stale_gap() -> None:
    """A big last update u makes the gap large relative to c: Λ < 1 shrinks the step."""
    d = [torch.full((4,), 0.1)]
    kw = dict(lr=1.0, beta=0.0, nesterov=False, clip=None, clip_mode="value", first=False)
    a1, a2 = [torch.zeros(4)], [torch.zeros(4)]
    big_u = [torch.full((4,), 5.0)]
    co2_outer_update_(
        a1,
        [torch.zeros(4)],
        [torch.full((4,), 0.1)],
        [big_u[0].clone()],
        d,
        gap_penalty="gap_aware",
        **kw,
    )
    co2_outer_update_(
        a2,
        [torch.zeros(4)],
        [torch.full((4,), 0.1)],
        [big_u[0].clone()],
        d,
        gap_penalty="none",
        **kw,
    )
    assert (a1[0].abs() < a2[0].abs()).all()
    assert torch.allclose(a1[0], a2[0] / (5.1 / (0.1 + GAP_EPS)), rtol=1e-5)


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(finite, min_size=1, max_size=16),
    st.lists(finite, min_size=16, max_size=16),
    st.floats(1e-3, 10.0),
    st.sampled_from(["value", "norm"]),
)
def test_properties_penalty_in_unit_interval_and_clip_bounds(
    d: list[float], u: list[float], clip: float, mode: str
) -> None:
    n = len(d)
    dt, ut = [torch.tensor(d)], [torch.tensor(u[:n])]
    lam = gap_aware_penalty(dt, ut, [torch.rand(n)], first=False)[0]
    assert ((lam > 0) & (lam <= 1)).all()
    m = [torch.tensor(u[:n])]
    clip_momentum_(m, clip=clip, clip_mode=mode)
    if mode == "value":
        assert m[0].abs().max().item() <= clip * (1 + 1e-6)
    else:
        assert torch.linalg.vector_norm(m[0]).item() <= clip * (1 + 1e-5)


def test_delay_compensation_matches_its_formula_per_tensor() -> None:
    now, snap, new = _rand(6, 4), _rand(6, 4), _rand(6, 4)
    params = [t.clone() for t in now]
    delay_compensation_(params, new, snap, lambda0=0.2)
    for p, n0, s, a in zip(params, now, snap, new):
        g = s - n0
        h = g * g * (a - s)
        lam = 0.2 * g.norm() / h.norm()
        torch.testing.assert_close(p, a - (g + lam * h), rtol=1e-6, atol=1e-6)
    # λ is per tensor: the correction has norm λ₀‖g‖ in every tensor
    for p, n0, s, a in zip(params, now, snap, new):
        correction = (a - (s - n0)) - p
        assert correction.norm().item() == pytest.approx(0.2 * (s - n0).norm().item(), rel=1e-5)


def test_delay_compensation_degenerate_forms() -> None:
    now, snap, new = _rand(5), _rand(5), _rand(5)
    params = [now[0].clone()]
    delay_compensation_(params, new, snap, lambda0=0.0)
    assert torch.equal(params[0], new[0] - (snap[0] - now[0]))  # Â + (θ_now − θ_s)
    params = [snap[0].clone()]  # no progress during the overlap: g = 0, so θ ← Â
    delay_compensation_(params, new, snap, lambda0=0.5)
    assert torch.equal(params[0], new[0])


# --- NoLoCo ------------------------------------------------------------------------------------


def _official_groups(world_size: int, size: int, step: int) -> list[list[int]]:
    """gensyn-ai/noloco ``create_random_permutation`` + ``batched``, transcribed (W mod n = 0)."""
    import numpy as np

    perm = [int(x) for x in np.random.default_rng(step + 1).permutation(world_size)]
    count = len(perm) // size
    out: list[list[int]] = [[] for _ in range(count)]
    for i, x in enumerate(perm):
        out[i % count].append(x)
    return out


@pytest.mark.parametrize(
    ("world", "size", "step", "expected"),
    [
        (8, 2, 12, [[0, 5], [6, 7], [1, 3], [2, 4]]),
        (4, 2, 3, [[1, 3], [0, 2]]),
        (4, 2, 6, [[0, 1], [2, 3]]),
        (16, 4, 500, [[0, 5, 7, 15], [3, 6, 9, 12], [2, 10, 11, 14], [1, 4, 8, 13]]),
        # W not divisible by n: the last W mod n ranks of the permutation join the last group
        (5, 2, 12, [[0, 3], [1, 2, 4]]),
        (7, 3, 0, [[1, 2, 5], [0, 3, 4, 6]]),
        (1, 2, 3, [[0]]),
    ],
)
def test_noloco_groups_test_vectors(
    world: int, size: int, step: int, expected: list[list[int]]
) -> None:
    assert noloco_groups(world, size, step) == expected
    if world % size == 0:
        assert noloco_groups(world, size, step) == [
            sorted(g) for g in _official_groups(world, size, step)
        ]


@given(
    world=st.integers(1, 40),
    size=st.integers(2, 9),
    step=st.integers(0, 10_000),
    seed=st.integers(0, 100),
)
@settings(max_examples=60, deadline=None)
def test_noloco_groups_partition_the_ranks(world: int, size: int, step: int, seed: int) -> None:
    groups = noloco_groups(world, size, step, seed)
    assert sorted(r for g in groups for r in g) == list(range(world))
    assert len(groups) == max(1, world // size)
    sizes = sorted(len(g) for g in groups)
    assert sizes[:-1] == [size] * (len(groups) - 1) or world < size
    assert noloco_groups(world, size, step + seed, 0) == noloco_groups(world, size, step, seed)


def test_noloco_groups_change_with_the_step() -> None:
    assert len({str(noloco_groups(16, 2, s)) for s in range(0, 120, 12)}) > 5


def test_noloco_update_matches_the_official_outer_step() -> None:
    """``noloco_outer_update_`` against ``SparseOptimizerC``'s ``outer_step`` arithmetic (sent:
    φⱼ and θⱼ − φⱼ separately; m_ = (μ − 1)·m + α·mean_g + α·(mean − φ); m += m_; φ += m)
    for a group of 3, over several rounds."""
    g = torch.Generator().manual_seed(0)
    lr, mu = 0.7, 0.5
    phi = [[torch.randn(4, 3, generator=g), torch.randn(5, generator=g)] for _ in range(3)]
    mine_phi = [[t.clone() for t in p] for p in phi]
    mom = [[torch.zeros_like(t) for t in p] for p in phi]
    mine_mom = [[torch.zeros_like(t) for t in p] for p in phi]
    for _ in range(4):
        theta = [[t + 0.1 * torch.randn(t.shape, generator=g) for t in p] for p in phi]
        for i in range(3):  # the official code, member i
            for j in range(2):
                mean = sum(phi[k][j] for k in range(3)) * (1.0 / 3)
                mean_g = sum(theta[k][j] - phi[k][j] for k in range(3)) * (1.0 / 3)
                m_ = (mu - 1.0) * mom[i][j] + lr * mean_g + lr * (mean - phi[i][j])
                mom[i][j] += m_
        new_phi = [[phi[i][j] + mom[i][j] for j in range(2)] for i in range(3)]
        mean_theta = [(theta[0][j] + theta[1][j] + theta[2][j]) / 3 for j in range(2)]
        for i in range(3):
            noloco_outer_update_(mine_phi[i], mine_mom[i], mean_theta, lr=lr, momentum_coef=mu)
        phi = new_phi
        for i in range(3):
            for a, b in zip(mine_phi[i], phi[i]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        mine_phi = [[t.clone() for t in p] for p in phi]  # no drift: compare one round each


def test_noloco_update_without_momentum_at_lr_1_is_the_group_mean() -> None:
    anchor, mean = _rand(6, 2), _rand(6, 2)
    momentum = [torch.zeros(6), torch.zeros(2)]
    noloco_outer_update_(anchor, momentum, mean, lr=1.0, momentum_coef=0.0)
    for a, m in zip(anchor, mean):
        torch.testing.assert_close(a, m, rtol=0, atol=1e-6)
