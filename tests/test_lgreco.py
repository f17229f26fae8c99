"""L-GreCo: the dynamic programme against brute force, the budget, and the adaptive compressor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lowcomm.comm import Communicator, FlatBuckets
from lowcomm.compress import Compressor, LGreCo, PowerSGD, Quantize, Raw, TopK
from lowcomm.compress.lgreco import candidate_errors, choose, decide


def _brute_force(errors: list[list[float]], sizes: list[list[float]], budget: float) -> float:
    best = math.inf
    for pick in itertools.product(*(range(len(e)) for e in errors)):
        if math.fsum(errors[l][c] for l, c in enumerate(pick)) <= budget:
            best = min(best, math.fsum(sizes[l][c] for l, c in enumerate(pick)))
    return best


def _tables(draw: st.DrawFn, *, integral: bool) -> tuple[list[list[float]], list[list[float]]]:
    layers = draw(st.integers(1, 4))
    errors, sizes = [], []
    for _ in range(layers):
        c = draw(st.integers(1, 4))
        if integral:
            errors.append([float(draw(st.integers(0, 12))) for _ in range(c)])
        else:
            errors.append([draw(st.floats(0, 10, allow_nan=False)) for _ in range(c)])
        sizes.append([float(draw(st.integers(1, 50))) for _ in range(c)])
    return errors, sizes


@st.composite
def exact_instances(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], int]:
    """Integer errors and an integer budget cut into unit steps: the discretisation is exact."""
    errors, sizes = _tables(draw, integral=True)
    budget = draw(st.integers(0, 30))
    return errors, sizes, budget


@st.composite
def float_instances(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], float, int]:
    errors, sizes = _tables(draw, integral=False)
    return errors, sizes, draw(st.floats(0, 25)), draw(st.integers(1, 200))


@settings(max_examples=300, deadline=None)
@given(exact_instances())
def test_choose_equals_brute_force_when_discretisation_is_exact(
    inst: tuple[list[list[float]], list[list[float]], int],
) -> None:
    errors, sizes, budget = inst
    best = _brute_force(errors, sizes, budget)
    if math.isinf(best):
        with pytest.raises(ValueError, match="no assignment meets"):
            choose(errors, sizes, budget, resolution=max(1, budget))
        return
    pick = choose(errors, sizes, budget, resolution=max(1, budget))
    assert len(pick) == len(errors)
    assert math.fsum(errors[l][c] for l, c in enumerate(pick)) <= budget
    assert math.fsum(sizes[l][c] for l, c in enumerate(pick)) == best


@settings(max_examples=300, deadline=None)
@given(float_instances())
@example(([[0.0]], [[1.0]], 5e-324, 2))  # the budget unit underflows to 0
def test_choose_never_exceeds_the_budget(
    inst: tuple[list[list[float]], list[list[float]], float, int],
) -> None:
    errors, sizes, budget, resolution = inst
    feasible = not math.isinf(_brute_force(errors, sizes, budget))
    if not feasible:
        with pytest.raises(ValueError):
            choose(errors, sizes, budget, resolution=resolution)
        return
    pick = choose(errors, sizes, budget, resolution=resolution)
    assert math.fsum(errors[l][c] for l, c in enumerate(pick)) <= budget
    # never worse than the most accurate assignment it could always fall back to
    accurate = [min(range(len(e)), key=lambda c: (e[c], s[c])) for e, s in zip(errors, sizes)]
    chosen = math.fsum(sizes[l][c] for l, c in enumerate(pick))
    assert chosen <= math.fsum(sizes[l][c] for l, c in enumerate(accurate))


@st.composite
def uniform_instances(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]], int, int]:
    """Tables with the same candidates in every layer, a uniform candidate and a resolution."""
    layers, cands = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    unit = st.floats(0, 1, allow_nan=False, exclude_max=True)
    errors = [[draw(unit) for _ in range(cands)] for _ in range(layers)]
    sizes = [[float(draw(st.integers(1, 50))) for _ in range(cands)] for _ in range(layers)]
    return errors, sizes, draw(st.integers(0, cands - 1)), draw(st.integers(1, 1000))


@settings(max_examples=500, deadline=None)
@given(uniform_instances())
def test_choose_accepts_the_budget_of_a_uniform_assignment(
    inst: tuple[list[list[float]], list[list[float]], int, int],
) -> None:
    errors, sizes, c, resolution = inst
    budget = sum(row[c] for row in errors)
    pick = choose(errors, sizes, budget, resolution=resolution)
    assert sum(errors[l][k] for l, k in enumerate(pick)) <= budget
    assert sum(sizes[l][k] for l, k in enumerate(pick)) <= sum(row[c] for row in sizes)


def test_choose_accepts_a_plain_sum_below_the_exact_one() -> None:
    # the uniform assignment at candidate 1 is the most accurate one, and the plain sum of its
    # errors is one ulp below their correctly rounded sum
    errors = [
        [0.7021227719986103, 0.055328646981933405, 0.2865613588800565],
        [0.3793225620817874, 0.33303380320773956, 0.3825571619968171],
        [0.8460317508179072, 0.4545358143132996, 0.4696164342612148],
        [0.7323034836482556, 0.21069499109656709, 0.5655730501194198],
        [0.9836099429575262, 0.2740261510357531, 0.8483295555171133],
    ]
    sizes = [[14, 42, 28], [5, 21, 26], [31, 36, 1], [26, 29, 15], [1, 43, 11]]
    budget = sum(row[1] for row in errors)
    assert budget < math.fsum(row[1] for row in errors)
    assert choose(errors, sizes, budget) == [1] * 5
    assert decide(errors, sizes, 1) == [1] * 5


def test_choose_trades_error_between_layers() -> None:
    # layer 0 is cheap to compress hard, layer 1 is not: with the budget of "both at level 1"
    # plus a little, layer 0 goes to level 2
    errors = [[0.0, 1.0, 1.5], [0.0, 1.0, 9.0]]
    sizes = [[100, 50, 10], [100, 50, 10]]
    assert choose(errors, sizes, 2.0) == [1, 1]
    assert choose(errors, sizes, 2.5) == [2, 1]
    assert choose(errors, sizes, 1.6) == [2, 0]
    assert choose(errors, sizes, 0.0) == [0, 0]
    assert choose([], [], 1.0) == []


@pytest.mark.parametrize(
    "errors,sizes,budget,match",
    [
        ([[1.0]], [[1.0, 2.0]], 1.0, "same, non-zero number"),
        ([[1.0]], [], 1.0, "layers"),
        ([[-1.0]], [[1.0]], 1.0, "finite and >= 0"),
        ([[math.nan]], [[1.0]], 1.0, "finite and >= 0"),
        ([[1.0]], [[1.0]], -1.0, "max_error"),
        ([[2.0]], [[1.0]], 1.0, "no assignment meets"),
        ([[2.0]], [[1.0]], 0.0, "error-free"),
    ],
)
def test_choose_rejects_bad_tables(
    errors: list[list[float]], sizes: list[list[float]], budget: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        choose(errors, sizes, budget)


def test_decide_keeps_the_uniform_setting_when_choose_does_not_help() -> None:
    errors = [[3.0, 1.0], [3.0, 1.0]]
    sizes = [[10, 20], [10, 20]]
    assert decide(errors, sizes, 1) == [1, 1]  # uniform is optimal
    assert decide([[math.inf, 1.0]], [[1, 2]], 1) == [1]  # unusable table


# -- settings and measurement --------------------------------------------------------------------


def test_lgreco_candidates() -> None:
    assert LGreCo("powersgd").candidates == (1, 2, 4, 8, 16)
    assert LGreCo("powersgd", default=8).candidates == (2, 4, 8, 16, 32)
    assert LGreCo("int").candidates == (2, 4, 8)
    assert LGreCo("topk", default=0.4).candidates == (0.1, 0.2, 0.4, 0.8, 1.0)
    s = LGreCo("powersgd", candidates=(1, 3))
    assert s.candidates == (1, 3, 4) and s.default_index == 2
    assert [c.spec for c in LGreCo("int", block=32).codecs()] == [
        "int2:block=32",
        "int4:block=32",
        "int8:block=32",
    ]
    with pytest.raises(ValueError, match="family"):
        LGreCo("zip")


def test_candidate_errors() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 24, generator=g)
    ranks = [PowerSGD(r) for r in (1, 2, 4, 16)]
    errs = candidate_errors(ranks, x, index=5)
    assert errs == sorted(errs, reverse=True)
    assert errs[-1] == 0.0  # rank 16 of a 16 × 24 matrix does not gain: sent raw
    q = PowerSGD(4).start_q(x.shape, 5, None)
    assert errs[2] == PowerSGD(4).local_error(x, q)
    codecs = [Quantize(bits=2), Quantize(bits=8, stochastic=True), TopK(0.1), Raw()]
    errs = candidate_errors(codecs, x)
    assert errs[0] == pytest.approx(float(((x - Quantize(bits=2).roundtrip(x)) ** 2).sum()))
    assert errs[1] == pytest.approx(float(((x - Quantize(bits=8).roundtrip(x)) ** 2).sum()))
    assert errs[3] == 0.0


def _layers(seed: int = 0) -> list[torch.Tensor]:
    """Layers whose spectra differ: low-rank ones gain from a small rank, noisy ones do not."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(32, 2, generator=g) @ torch.randn(2, 48, generator=g)
    noisy = torch.randn(32, 48, generator=g)
    mid = torch.randn(40, 6, generator=g) @ torch.randn(6, 40, generator=g)
    mid += 0.05 * torch.randn(40, 40, generator=g)
    return [low, noisy, mid, torch.randn(48, generator=g), torch.randn(4, 4, generator=g)]


def test_adaptive_compressor_beats_the_uniform_setting(single_rank_group: None) -> None:
    layers = _layers()
    shapes = [t.shape for t in layers]
    comm = Communicator()
    setting = LGreCo("powersgd", default=4, every=3, min_numel=100)
    comp = Compressor(setting, shapes)
    # tiny layers (the bias, the 4 × 4) are never compressed
    assert comp.eligible == [0, 1, 2]
    uniform = sum(PowerSGD(4).wire_nbytes(s) for s in shapes[:3]) + 4 * (48 + 16)
    assert comp.wire_nbytes() == uniform
    buckets = FlatBuckets(shapes)
    buckets.copy_from(layers)
    comm.compressed_mean_async(buckets, comp).wait()
    assert comp.decisions == 1
    ranks = [c.rank if isinstance(c, PowerSGD) else None for c in comp.assignment]
    # the rank-2 layer needs no more than rank 2; the noisy layer gains little from any rank
    # and is squeezed to rank 1; the budget saved buys the structured layer rank 8
    assert ranks == [2, 1, 8, None, None]
    assert comp.wire_nbytes() < uniform
    # the total error of the choice is within the uniform budget
    errs = [candidate_errors(comp.candidates, t) for t in layers[:3]]
    chosen = sum(errs[i][comp.candidates.index(comp.assignment[i])] for i in range(3))
    assert chosen <= sum(e[setting.default_index] for e in errs)
    # re-chosen every K = 3 means only
    for _ in range(3):
        buckets.copy_from(layers)
        comm.compressed_mean_async(buckets, comp).wait()
    assert comp.decisions == 2 and comp.launches == 4


def test_adaptive_quantisation_and_topk(single_rank_group: None) -> None:
    layers = _layers(1)
    shapes = [t.shape for t in layers]
    comm = Communicator()
    for spec in ("lgreco:int:min_numel=100", "lgreco:topk:0.05:min_numel=100"):
        comp = Compressor(spec, shapes)
        before = comp.wire_nbytes()
        buckets = FlatBuckets(shapes)
        buckets.copy_from(layers)
        comm.compressed_mean_async(buckets, comp).wait()
        assert comp.decisions == 1 and comp.wire_nbytes() <= before
        assert isinstance(comp.assignment[3], Raw)
        applied = [v.clone() for v in buckets.views]
        for a, x, e in zip(applied, layers, comp.residuals):  # error feedback still exact
            torch.testing.assert_close(a + e, x, rtol=1e-5, atol=1e-5)
