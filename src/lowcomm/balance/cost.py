"""The cost of a document: ``c(s) = d + a*s + b*s**2`` seconds, plus ``c0`` per micro-batch.

The linear layers cost ``a`` per token, attention ``b`` per token squared (causal: half the
square), ``d`` is a fixed cost per document (its attention call) and ``c0`` per forward and
backward of a micro-batch (embedding, head and launch overheads). :func:`measure_cost_model`
fits all four by least squares on timed forward and backward passes of the actual model on this
device (single documents at several lengths and micro-batches packed with many short ones);
:func:`analytic_cost_model` gives the FLOP count's shape instead (24*s*h**2 + 2*s**2*h per layer
and pass, times 3 for forward and backward) at an assumed FLOP rate, for when timing is not
wanted. The planner balances :meth:`CostModel.doc`; :meth:`CostModel.rank_time` predicts a
rank's compute time for what it was given, which the measurements compare with the clock.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "CostFit",
    "CostModel",
    "OnlineRefit",
    "analytic_cost_model",
    "features",
    "fit_cost_model",
    "measure_cost_model",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostModel:
    """Seconds of forward and backward: ``c0`` per micro-batch, ``d + a*s + b*s**2`` per
    document of ``s`` tokens."""

    a: float
    """Seconds per token (the linear layers)."""
    b: float
    """Seconds per token squared (attention)."""
    d: float = 0.0
    """Seconds per document."""
    c0: float = 0.0
    """Seconds per micro-batch."""
    split_factor: float = 1.0
    """What a split document's part costs over its ideal share ``(a*s + b*s**2)/k`` (ring
    attention's block-wise kernels and exchanges; measured by the job when it splits)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.split_factor) and self.split_factor > 0):
            raise ValueError(f"CostModel.split_factor={self.split_factor!r} must be > 0.")
        for name in ("a", "b", "d", "c0"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name}={value!r} must be finite and >= 0.")
        if self.a == 0 and self.b == 0:
            raise ValueError("CostModel needs a > 0 or b > 0: every token must cost something.")

    def doc(self, length: float) -> float:
        """Cost of one document of ``length`` tokens (without the micro-batch's ``c0``)."""
        return self.d + self.a * length + self.b * length * length

    def split_piece(self, length: float, k: int) -> float:
        """Cost on each of ``k`` ranks of a ``length``-token document split over them (the
        zig-zag layout gives each the same tokens and the same causal attention work), times
        :attr:`split_factor`."""
        return self.d + self.split_factor * (self.a * length + self.b * length * length) / k

    def batch(self, lengths: Sequence[float]) -> float:
        """Cost of one micro-batch packing documents of ``lengths``."""
        return self.c0 + sum(self.doc(s) for s in lengths)

    def rank_time(self, micro_batches: Sequence[Sequence[float]]) -> float:
        """Predicted compute time of a rank given these micro-batches."""
        return sum(self.batch(mb) for mb in micro_batches)

    def crossover(self) -> float:
        """The length at which attention costs as much as the linear layers (``a / b``)."""
        return self.a / self.b if self.b > 0 else math.inf

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class CostFit:
    """A fitted :class:`CostModel` with what it was fitted on and how well it fits."""

    model: CostModel
    samples: list[tuple[list[int], float]] = field(repr=False)
    """``(document lengths of a micro-batch, seconds)`` for every timed shape."""
    rms_rel_error: float
    """Root-mean-square of (predicted - measured) / measured over the samples."""
    max_rel_error: float
    """Largest |predicted - measured| / measured over the samples."""

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.model.as_dict(),
            "rms_rel_error": self.rms_rel_error,
            "max_rel_error": self.max_rel_error,
            "samples": [{"lengths": ls, "seconds": t} for ls, t in self.samples],
        }


def analytic_cost_model(
    *, n_layer: int, n_embd: int, flops_per_s: float = 2e10, causal: bool = True
) -> CostModel:
    """The FLOP count's shape: per layer, forward ``24*s*h**2`` (linear) and ``4*s**2*h``
    (attention; half with a causal mask), backward twice the forward, at ``flops_per_s``."""
    if flops_per_s <= 0:
        raise ValueError(f"flops_per_s={flops_per_s!r} must be > 0.")
    attn = (2.0 if causal else 4.0) * n_embd
    return CostModel(
        a=3 * 24.0 * n_embd * n_embd * n_layer / flops_per_s,
        b=3 * attn * n_layer / flops_per_s,
    )


def _features(lengths: Sequence[int]) -> list[float]:
    return [1.0, float(len(lengths)), float(sum(lengths)), float(sum(s * s for s in lengths))]


def features(lengths: Sequence[int], *, split_k: int = 1, split_factor: float = 1.0) -> list[float]:
    """What one micro-batch costs in units of ``[c0, d, a, b]``: ``[1, documents, tokens,
    tokens²]`` (documents packed back to back: no padding); for a rank's part of a document
    split over ``split_k`` ranks, ``[1, 1, f*s/k, f*s**2/k]`` with ``f`` the split factor. The
    features of several micro-batches add up, so a rank's step or round is one row."""
    if split_k > 1:
        (s,) = lengths
        return [1.0, 1.0, split_factor * s / split_k, split_factor * s * s / split_k]
    return _features(lengths)


def _solve(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None
) -> tuple[float, float, float, float]:
    """Non-negative least squares of ``x @ [c0, d, a, b] = y`` weighted by 1/y (times
    ``weight``): a coefficient the fit makes negative is dropped (held at 0) and the rest
    refitted. Solved in Python floats, summing with :func:`math.fsum` (correctly rounded, so
    independent of order) and eliminating in a fixed order: the same rows give the same bits
    in every process, whatever the BLAS, its threads or the memory's alignment — the ranks of a
    job plan from it without a broadcast."""
    rows = x.tolist()
    ys = y.tolist()
    ws = [1.0 / t for t in ys] if weight is None else [w / t for w, t in zip(weight.tolist(), ys)]
    active = [0, 1, 2, 3]  # c0, d, a, b
    coef = [0.0, 0.0, 0.0, 0.0]
    while active:
        sol = _weighted_lstsq([[r[j] for j in active] for r in rows], ys, ws)
        if sol is not None and all(v >= 0 for v in sol):
            coef = [0.0, 0.0, 0.0, 0.0]
            for j, v in zip(active, sol, strict=True):
                coef[j] = v
            break
        if sol is None:  # singular: drop the column with the least weight
            active.pop(0)
            continue
        active.remove(active[min(range(len(sol)), key=lambda k: sol[k])])
    c0, d, a, b = coef
    if a == 0 and b == 0:
        a = float((y / x[:, 2]).median())  # degenerate timings: per-token cost alone
    return c0, d, a, b


def _weighted_lstsq(
    rows: list[list[float]], ys: list[float], ws: list[float]
) -> list[float] | None:
    """argmin ``sum (w (r . c - y))**2`` by the normal equations on columns scaled to a largest
    value of 1 (Gaussian elimination with partial pivoting); None when singular."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    z = [[r[j] / scale[j] for j in range(n)] for r in rows]
    m = [
        [math.fsum(w * w * zr[i] * zr[j] for zr, w in zip(z, ws)) for j in range(n)]
        + [math.fsum(w * w * zr[i] * t for zr, w, t in zip(z, ws, ys))]
        for i in range(n)
    ]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


def fit_cost_model(samples: Sequence[tuple[Sequence[int], float]]) -> CostFit:
    """Least-squares fit of ``c0 + sum(d + a*s + b*s**2)`` to timed micro-batches, weighted by
    1/time (so the relative error is what is minimised). A coefficient the fit makes negative
    is dropped (held at 0) and the rest refitted.

    Raises:
        ValueError: fewer samples than coefficients, or times that are not positive.
    """
    if len(samples) < 4:
        raise ValueError(
            f"fit_cost_model needs at least 4 timed micro-batches, got {len(samples)}: time "
            "several lengths and at least one micro-batch packing several documents."
        )
    if any(not (t > 0 and math.isfinite(t)) for _, t in samples):
        raise ValueError("fit_cost_model: every time must be positive and finite.")
    x = torch.tensor([_features(ls) for ls, _ in samples], dtype=torch.float64)
    y = torch.tensor([t for _, t in samples], dtype=torch.float64)
    c0, d, a, b = _solve(x, y)
    model = CostModel(a=a, b=b, d=d, c0=c0)
    pred = torch.tensor([model.batch(ls) for ls, _ in samples], dtype=torch.float64)
    rel = (pred - y) / y
    return CostFit(
        model=model,
        samples=[(list(ls), float(t)) for ls, t in samples],
        rms_rel_error=float(rel.pow(2).mean().sqrt()),
        max_rel_error=float(rel.abs().max()),
    )


class OnlineRefit:
    """Refits a :class:`CostModel` from what the ranks measure while they train.

    Every plan unit each rank contributes one row: the summed :func:`features` of the
    micro-batches it computed and its measured compute time. The rows are exchanged so that
    every rank holds all of them in the same order (the job all-reduces a ``world x 5`` table),
    and every rank fits the same model from the same rows: the plans stay identical without a
    broadcast. The fit is :func:`fit_cost_model`'s non-negative least squares on the start-up
    timings and the rows of the last ``window`` units; the split factor is kept. The start-up
    timings, weighing together as much as one unit's rows, pin the coefficients the training
    rows cannot tell apart (every rank of a unit computes about the same tokens); the training
    rows, ``window`` × ranks of them, carry the device as it runs: its speed under load, what
    the start-up shapes did not cover."""

    def __init__(
        self, startup: Sequence[tuple[Sequence[int], float]] = (), *, window: int = 8
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"OnlineRefit window={window!r} must be an integer >= 1 (units).")
        self.window = window
        self.startup = [(features(ls), float(t)) for ls, t in startup]
        self.units: list[list[tuple[list[float], float]]] = []
        self.refits = 0

    def add_unit(self, rows: Sequence[tuple[Sequence[float], float]]) -> None:
        """One unit's rows (one per rank, in rank order); the oldest unit beyond ``window``
        is forgotten. Rows without compute time (a rank with nothing to do) are left out."""
        self.units.append([(list(map(float, f)), float(t)) for f, t in rows if t > 0])
        del self.units[: -self.window]

    def rows(self) -> list[tuple[list[float], float]]:
        return self.startup + [row for unit in self.units for row in unit]

    def fit(self, current: CostModel) -> CostModel:
        """The model the rows give (``current`` when there are fewer than 4)."""
        rows = self.rows()
        if len(rows) < 4:
            return current
        x = torch.tensor([f for f, _ in rows], dtype=torch.float64)
        y = torch.tensor([t for _, t in rows], dtype=torch.float64)
        weight = torch.ones(len(rows), dtype=torch.float64)
        if self.units and self.startup:
            # the start-up timings weigh as much as one unit of training rows together
            weight[: len(self.startup)] = len(self.units[-1]) / len(self.startup)
        c0, d, a, b = _solve(x, y, weight)
        self.refits += 1
        return CostModel(a=a, b=b, d=d, c0=c0, split_factor=current.split_factor)

    @staticmethod
    def predict(model: CostModel, row: Sequence[float]) -> float:
        """``model``'s time for a row of :func:`features`."""
        return model.c0 * row[0] + model.d * row[1] + model.a * row[2] + model.b * row[3]

    def state_dict(self) -> dict[str, Any]:
        return {"startup": self.startup, "units": self.units, "refits": self.refits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.startup = [(list(f), float(t)) for f, t in state["startup"]]
        self.units = [[(list(f), float(t)) for f, t in unit] for unit in state["units"]]
        self.refits = int(state["refits"])


def timing_shapes(block_size: int, *, points: int = 6) -> list[list[int]]:
    """The micro-batches :func:`measure_cost_model` times: one document at ``points`` lengths
    from ``block_size / 2**(points-1)`` to ``block_size``, and two micro-batches packing
    many short documents (which separate the per-document from the per-micro-batch cost)."""
    if block_size < 16:
        raise ValueError(f"block_size={block_size} is too short to time (at least 16 tokens).")
    lengths = sorted({max(8, block_size >> i) for i in range(points)})
    short = max(8, block_size // 32)
    return [[s] for s in lengths] + [[short] * (block_size // short), [2 * short] * 4]


def measure_cost_model(
    model: nn.Module,
    block_size: int,
    *,
    vocab_size: int = 256,
    repeats: int = 3,
    device: torch.device | str = "cpu",
    between: Callable[[], None] | None = None,
    combine: Callable[[list[float]], list[float]] | None = None,
) -> CostFit:
    """Time forward and backward of ``model`` (a GPT: ``model(x, y, packed=...)``) on
    :func:`timing_shapes` and fit a :class:`CostModel`. Each shape runs once untimed, then
    ``repeats`` times; the median counts. Gradients are accumulated into the parameters and
    cleared at the end (call it before training, or on a copy).

    ``between`` runs before each shape (a barrier, so that ranks timing together share the
    device the same way); ``combine`` maps this rank's times to the ones to fit (e.g. the mean
    over ranks, so that every rank fits the same model).
    """
    from lowcomm.models.gpt import Packed

    gen = torch.Generator().manual_seed(0)
    shapes = timing_shapes(block_size)
    times: list[float] = []
    was_training = model.training
    model.train()
    for lengths in shapes:
        if between is not None:
            between()
        n = sum(lengths)
        x = torch.randint(vocab_size, (1, n), generator=gen).to(device)
        packed = Packed(lengths=lengths)
        runs = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            _, loss = model(x, x, packed=packed, reduction="sum")
            assert loss is not None
            loss.backward()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            if i:
                runs.append(time.perf_counter() - t0)
        times.append(statistics.median(runs))
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    if combine is not None:
        times = combine(times)
    fit = fit_cost_model(list(zip(shapes, times, strict=True)))
    logger.debug("cost model %s (rms error %.1f%%)", fit.model, 100 * fit.rms_rel_error)
    return fit
