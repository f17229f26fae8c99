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

__all__ = ["CostFit", "CostModel", "analytic_cost_model", "fit_cost_model", "measure_cost_model"]

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
    w = 1.0 / y
    active = [0, 1, 2, 3]  # c0, d, a, b
    coef = torch.zeros(4, dtype=torch.float64)
    while active:
        sol = torch.linalg.lstsq(x[:, active] * w[:, None], (y * w)[:, None]).solution[:, 0]
        if bool((sol >= 0).all()):
            coef.zero_()
            coef[active] = sol
            break
        active.remove(active[int(torch.argmin(sol))])
    c0, d, a, b = (float(c) for c in coef)
    if a == 0 and b == 0:
        a = float((y / x[:, 2]).median())  # degenerate timings: per-token cost alone
    model = CostModel(a=a, b=b, d=d, c0=c0)
    pred = torch.tensor([model.batch(ls) for ls, _ in samples], dtype=torch.float64)
    rel = (pred - y) / y
    return CostFit(
        model=model,
        samples=[(list(ls), float(t)) for ls, t in samples],
        rms_rel_error=float(rel.pow(2).mean().sqrt()),
        max_rel_error=float(rel.abs().max()),
    )


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
