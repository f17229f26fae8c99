"""L-GreCo: a compression level per layer, chosen by dynamic programming.

Paper: Markov et al., "L-GreCo: Layerwise-Adaptive Gradient Compression for Efficient and
Accurate Deep Learning", MLSys 2024 (https://arxiv.org/abs/2210.17357).

For a codec family (PowerSGD ranks, top-k densities or quantisation bits) every layer l has
candidates c with a compression error ``errors[l][c]`` (‖x − C_c(x)‖², measured on the
accumulated tensor, error-feedback residual included) and a wire size ``sizes[l][c]``
(bytes). :func:`choose` picks one candidate per layer minimising the total size subject to the
total error being at most ``max_error``; the adaptive compressor sets ``max_error`` to the total
error of the uniform default (every layer at the family's default level), so the choice is
never less accurate than the uniform setting and never larger.

Totals are measured one way everywhere: :func:`total`, Python's built-in ``sum()`` over the
layers in order — what ``sum(errors[l][c] for l, c in enumerate(picks))`` gives. Floating-point
sums depend on the order and method (``math.fsum`` or numpy may differ in the last bit), so an
assignment "meets" ``max_error`` when its :func:`total` is ≤ ``max_error``; compute budgets with
``sum()`` or :func:`total` to have the assignment they came from accepted.

:func:`choose` is the paper's dynamic programme over a discretised error budget: the budget is
cut into ``resolution`` units u = max_error / resolution and every error is rounded **up** to
whole units, ⌈e/u⌉. An assignment the programme accepts has Σ⌈e/u⌉ ≤ resolution, hence a real
(undiscretised) total error ≤ max_error. The programme is exact for the discretised errors (so
for errors that are multiples of u it equals brute force); rounding up may cost some size for
other errors, at most one unit per layer of slack. That slack can hide an assignment whose total
is within one unit per layer of the budget — in particular the uniform assignment whose total
*is* the budget, which is how L-GreCo sets it — so :func:`choose` also evaluates every uniform
assignment (all layers at candidate c) and the most accurate one exactly, and returns the
smallest of everything that meets the budget: never larger than a uniform assignment that meets
it, and never a rejection when the most accurate assignment meets it. Every answer is checked
with :func:`total`. Time O(layers × candidates × resolution).

The adaptive compressor (:class:`LGreCo`, used through
:class:`~lowcomm.compress.feedback.Compressor`) re-measures and re-chooses every ``every``
rounds: each rank measures the error table on its own accumulated tensors, the tables are
averaged across ranks (one small all-reduce), and every rank runs :func:`choose` on the same
averaged table, so every rank holds the same decision. Layers with fewer than ``min_numel``
elements, or that no candidate makes smaller, stay uncompressed. Measured errors: quantisation
and top-k by their deterministic round trip; PowerSGD rank r by one round of this rank's own
compression from the tensor's current warm-start Q (cut or extended to r columns) — what the
next round would actually lose, at O(n₀·m·r) instead of a full SVD.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from lowcomm.compress.formats import (
    DEFAULT_BLOCK,
    Codec,
    ElementwiseCodec,
    PowerSGD,
    Quantize,
    TopK,
)
from lowcomm.compress.options import (
    flag_option,
    float_option,
    int_option,
    reject_unknown,
    split_options,
)

__all__ = [
    "FAMILIES",
    "LGreCo",
    "candidate_errors",
    "choose",
    "decide",
    "parse_lgreco",
    "total",
]

FAMILIES = ("powersgd", "topk", "int")
"""Codec families L-GreCo chooses within."""

logger = logging.getLogger(__name__)

DEFAULT_RESOLUTION = 1000
"""Units the error budget is cut into by :func:`choose`."""


def total(values: Sequence[Sequence[float]], picks: Sequence[int]) -> float:
    """Σ ``values[l][picks[l]]`` by Python's built-in ``sum()`` over the layers in order: how
    :func:`choose` measures an assignment's total error (and size) against the budget."""
    return sum(float(row[c]) for row, c in zip(values, picks))


def choose(
    errors: Sequence[Sequence[float]],
    sizes: Sequence[Sequence[float]],
    max_error: float,
    *,
    resolution: int = DEFAULT_RESOLUTION,
) -> list[int]:
    """One candidate index per layer minimising Σ sizes with Σ errors ≤ ``max_error``.

    ``errors[l][c]`` and ``sizes[l][c]`` are candidate c's error and size in layer l (layers may
    have different numbers of candidates). Totals are :func:`total`. The answer is the smallest
    of: the dynamic programme's over the budget cut into ``resolution`` units, errors rounded up;
    every uniform assignment (candidate c in every layer); the most accurate assignment — among
    those whose total error is ≤ ``max_error`` (see the module docstring). So the result never
    exceeds ``max_error`` and is never larger than a uniform assignment that meets it. Ties in
    size go to the programme's answer (its own ties to the smaller discretised error, then the
    lower candidate index), then the lower uniform candidate. Raises ``ValueError`` when not even
    the most accurate assignment meets the budget, or the tables are malformed.
    """
    if len(errors) != len(sizes):
        raise ValueError(f"errors has {len(errors)} layers but sizes has {len(sizes)}")
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ValueError(f"resolution must be a positive integer, got {resolution!r}; e.g. 1000")
    max_error = float(max_error)
    if not math.isfinite(max_error) or max_error < 0:
        raise ValueError(f"max_error must be a finite number >= 0, got {max_error!r}")
    for l, (e, s) in enumerate(zip(errors, sizes)):
        if len(e) != len(s) or not e:
            raise ValueError(
                f"layer {l}: errors and sizes need the same, non-zero number of candidates "
                f"(got {len(e)} and {len(s)})"
            )
        if any(not math.isfinite(float(x)) or float(x) < 0 for x in (*e, *s)):
            raise ValueError(f"layer {l}: errors and sizes must be finite and >= 0")
    if not errors:
        return []
    if max_error == 0.0:
        out = []
        for l, (e, s) in enumerate(zip(errors, sizes)):
            exact = [c for c in range(len(e)) if float(e[c]) == 0.0]
            if not exact:
                raise ValueError(
                    f"no assignment meets max_error=0: layer {l} has no error-free candidate"
                )
            out.append(min(exact, key=lambda c: (float(s[c]), c)))
        return out

    candidates = [] if (dp := _programme(errors, sizes, max_error, resolution)) is None else [dp]
    candidates += [[c] * len(errors) for c in range(min(len(e) for e in errors))]
    candidates.append(
        [
            min(range(len(e)), key=lambda c: (float(e[c]), float(s[c]), c))
            for e, s in zip(errors, sizes)
        ]
    )
    fits = [picks for picks in candidates if total(errors, picks) <= max_error]
    if not fits:
        raise ValueError(
            f"no assignment meets max_error={max_error!r}: even the most accurate candidates "
            f"total {total(errors, candidates[-1])!r}; raise the budget"
        )
    return min(fits, key=lambda picks: total(sizes, picks))  # first of equal sizes


def _programme(
    errors: Sequence[Sequence[float]],
    sizes: Sequence[Sequence[float]],
    max_error: float,
    resolution: int,
) -> list[int] | None:
    """The dynamic programme's least-size assignment with Σ⌈e/u⌉ ≤ ``resolution`` (u =
    ``max_error / resolution``), or ``None`` when no assignment fits in whole units."""
    unit = max_error / resolution
    g = resolution
    inf = math.inf
    best = np.full(g + 1, inf)  # best[j]: least size of the layers so far at discretised error j
    best[0] = 0.0
    picks: list[np.ndarray] = []  # picks[l][j]: candidate of layer l on the best path to j
    for e, s in zip(errors, sizes):
        new = np.full(g + 1, inf)
        pick = np.full(g + 1, -1, dtype=np.int64)
        for c, (ec, sc) in enumerate(zip(e, s)):
            d = _units(float(ec), unit, g)
            if d > g:
                continue
            cand = np.full(g + 1, inf)
            cand[d:] = best[: g + 1 - d] + float(sc)
            better = cand < new
            new[better] = cand[better]
            pick[better] = c
        best = new
        picks.append(pick)
    finite = np.isfinite(best)
    if not finite.any():
        return None
    j = int(np.flatnonzero(best == best[finite].min())[0])  # least size, then least error
    out = [0] * len(errors)
    for l in range(len(errors) - 1, -1, -1):
        c = int(picks[l][j])
        assert c >= 0
        out[l] = c
        j -= _units(float(errors[l][c]), unit, g)
    assert j == 0
    return out


def decide(
    errors: Sequence[Sequence[float]],
    sizes: Sequence[Sequence[float]],
    default_index: int,
    *,
    resolution: int = DEFAULT_RESOLUTION,
) -> list[int]:
    """L-GreCo's choice for one measured table: :func:`choose` under the budget of the uniform
    default (every layer at ``default_index``, its :func:`total`), hence never less accurate and
    never larger than the uniform default. The uniform default itself is kept when the table is
    not usable (non-finite errors of a diverged run)."""
    uniform = [default_index] * len(errors)
    try:
        picks = choose(errors, sizes, total(errors, uniform), resolution=resolution)
    except ValueError as e:
        logger.warning("L-GreCo keeps the uniform setting: %s", e)
        return uniform
    assert total(sizes, picks) <= total(sizes, uniform)
    return picks


def _units(error: float, unit: float, limit: int) -> int:
    """⌈error / unit⌉, corrected so that units·unit ≥ error also in floating point; anything
    above ``limit`` (over the budget on its own) is ``limit + 1``. A unit that underflowed to 0
    (a denormal budget) admits error-free candidates only."""
    if unit <= 0.0:
        return 0 if error == 0.0 else limit + 1
    q = error / unit
    if not q <= limit:
        return limit + 1
    d = math.ceil(q)
    while d * unit < error:
        d += 1
    return d


def candidate_errors(
    codecs: Sequence[Codec],
    x: torch.Tensor,
    *,
    index: int = 0,
    warm_q: torch.Tensor | None = None,
) -> list[float]:
    """‖x − C(x)‖² of every codec on ``x`` (0 for a codec that sends ``x`` raw).

    Elementwise codecs by their round trip with deterministic rounding; PowerSGD rank r by one
    round of this rank's compression from the Q the next round would start from (``warm_q``,
    tensor ``index``'s current warm start, cut or extended to r columns):
    :meth:`~lowcomm.compress.formats.PowerSGD.local_error`."""
    x = x.detach().float()
    out: list[float] = []
    for codec in codecs:
        if not codec.compresses(x.shape):
            out.append(0.0)
        elif isinstance(codec, PowerSGD):
            q = codec.start_q(x.shape, index, warm_q, device=x.device)
            out.append(codec.local_error(x, q))
        else:
            assert isinstance(codec, ElementwiseCodec)
            det = replace(codec, stochastic=False) if isinstance(codec, Quantize) else codec
            out.append(float(torch.sum((x - det.roundtrip(x)).double() ** 2)))
    return out


@dataclass(frozen=True)
class LGreCo:
    """Layer-wise adaptive compression within one codec family.

    Args:
        family: ``"powersgd"`` (candidates are ranks), ``"topk"`` (densities) or ``"int"``
            (bits of :class:`~lowcomm.compress.formats.Quantize`).
        default: the uniform setting whose total error is the budget (rank 4, density 0.01,
            4 bits by default).
        candidates: the levels to choose from; by default ``default`` × {¼, ½, 1, 2, 4} for
            ranks and densities, and bits {2, 4, 8}.
        every: K, rounds (or DDP steps) between re-measuring and re-choosing (default 10).
        min_numel: layers with fewer elements stay uncompressed (default 1024).
        resolution: error-budget units of :func:`choose` (default 1000).
        block: block size of the quantisation family.
        seed: PowerSGD's seed.

    Spec ``"lgreco:FAMILY[:DEFAULT][:every=K][:min_numel=N][:candidates=A/B/C]"``, e.g.
    ``"lgreco:powersgd"``, ``"lgreco:topk:0.01:every=5"``, ``"lgreco:int:4"``.
    """

    family: str = "powersgd"
    default: float = 0.0
    candidates: tuple[float, ...] = ()
    every: int = 10
    min_numel: int = 1024
    resolution: int = DEFAULT_RESOLUTION
    block: int = DEFAULT_BLOCK
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"L-GreCo family must be one of {', '.join(FAMILIES)}, got {self.family!r}; "
                "e.g. 'lgreco:powersgd'"
            )
        default = self.default or {"powersgd": 4, "topk": 0.01, "int": 4}[self.family]
        object.__setattr__(self, "default", default)
        cands = tuple(self.candidates) or self._default_candidates(default)
        if default not in cands:
            cands = (*cands, default)
        object.__setattr__(self, "candidates", tuple(sorted(set(cands))))
        for name, v in (("every", self.every), ("min_numel", self.min_numel)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"L-GreCo {name} must be a positive integer, got {v!r}")
        self.codecs()  # validates the candidate levels

    def _default_candidates(self, default: float) -> tuple[float, ...]:
        if self.family == "int":
            return (2, 4, 8)
        if self.family == "powersgd":
            r = int(default)
            return tuple(sorted({max(1, r // 4), max(1, r // 2), r, 2 * r, 4 * r}))
        return tuple(
            sorted(
                {default / 4, default / 2, default, min(1.0, 2 * default), min(1.0, 4 * default)}
            )
        )

    def _codec(self, level: float) -> Codec:
        if self.family == "powersgd":
            if level != int(level):
                raise ValueError(f"L-GreCo PowerSGD ranks must be integers, got {level!r}")
            return PowerSGD(rank=int(level), seed=self.seed)
        if self.family == "topk":
            return TopK(density=float(level))
        if level not in (2, 4, 8):
            raise ValueError(f"L-GreCo quantisation bits must be 2, 4 or 8, got {level!r}")
        return Quantize(bits=int(level), block=self.block)

    def codecs(self) -> list[Codec]:
        """The candidate codecs, in increasing level."""
        return [self._codec(level) for level in self.candidates]

    @property
    def default_index(self) -> int:
        """Index of the uniform default among :meth:`codecs`."""
        return list(self.candidates).index(self.default)

    @property
    def spec(self) -> str:
        s = f"lgreco:{self.family}:{self.default:g}"
        if tuple(self.candidates) != tuple(
            sorted(set(self._default_candidates(self.default)) | {self.default})
        ):
            s += ":candidates=" + "/".join(f"{c:g}" for c in self.candidates)
        if self.every != 10:
            s += f":every={self.every}"
        if self.min_numel != 1024:
            s += f":min_numel={self.min_numel}"
        if self.resolution != DEFAULT_RESOLUTION:
            s += f":resolution={self.resolution}"
        if self.block != DEFAULT_BLOCK:
            s += f":block={self.block}"
        if self.seed:
            s += f":seed={self.seed}"
        return s

    def __str__(self) -> str:
        return self.spec


def parse_lgreco(spec: str) -> LGreCo:
    """An :class:`LGreCo` from ``"lgreco:FAMILY[:DEFAULT][:key=value]..."``."""
    _, *rest = spec.strip().split(":")
    positional, keyed = split_options(rest)
    reject_unknown(
        spec, keyed, ("every", "min_numel", "resolution", "candidates", "block", "seed", "warm")
    )
    if not positional:
        raise ValueError(
            f"compression {spec!r} needs a family: 'lgreco:powersgd', 'lgreco:topk' or 'lgreco:int'"
        )
    family, *more = positional
    if family not in FAMILIES:
        raise ValueError(
            f"compression {spec!r}: unknown L-GreCo family {family!r}; use 'lgreco:powersgd', "
            "'lgreco:topk' or 'lgreco:int'"
        )
    if len(more) > 1:
        raise ValueError(
            f"compression {spec!r}: one default level at most, e.g. 'lgreco:topk:0.01'"
        )
    default = float_option(spec, "default", more[0]) if more else 0.0
    cands: tuple[float, ...] = ()
    if "candidates" in keyed:
        cands = tuple(
            float_option(spec, "candidates", c) for c in keyed["candidates"].split("/") if c
        )
    if "warm" in keyed and not flag_option(spec, "warm", keyed["warm"]):
        raise ValueError(f"compression {spec!r}: L-GreCo's PowerSGD always warm-starts")
    return LGreCo(
        family=family,
        default=default,
        candidates=cands,
        every=int_option(spec, "every", keyed.get("every", "10")),
        min_numel=int_option(spec, "min_numel", keyed.get("min_numel", "1024")),
        resolution=int_option(spec, "resolution", keyed.get("resolution", str(DEFAULT_RESOLUTION))),
        block=int_option(spec, "block", keyed.get("block", str(DEFAULT_BLOCK))),
        seed=int_option(spec, "seed", keyed.get("seed", "0")),
    )
