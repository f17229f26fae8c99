"""Matrix-multiply time as a function of its shape and the device.

One GEMM ``C[m, n] = A[m, k] · B[k, n]`` (``batch`` of them in one call) takes

    t = t₀ + 2 · batch · m · n · k / (peak · e) · (1 + k₀ / k)

a fixed cost per call ``t₀`` (launch and the last wave's tail), and the FLOPs at a sustained
fraction ``e`` of the device's peak, slowed where the reduction dimension ``k`` is short: each
output tile pays a fixed prologue and epilogue (loading, writing C) worth ``k₀`` elements of its
k loop. Small GEMMs are bound by ``t₀``; large ones approach ``e``; a GEMM whose k is a head
size (the attention scores, k = 64–128) runs at about half of it.

**Fit.** ``t₀``, ``e`` and ``k₀`` were fitted (least squares on relative error, linear in
``t₀``, ``1/e`` and ``k₀/e``) to the 375 bf16 GEMMs of H100 SXM that OpenXLA ships as its
latency-hiding scheduler's cost table (``xla/service/gpu/model/matmul_interpolator_data.h``,
key ``sm_90``, commit 71feeddf7cc3 of 2025-10-21; b ∈ {1, 2, 4}, m, n, k ∈ {256 … 4096}):
t₀ = 6.0 µs, e = 0.823, k₀ = 102. The predicted time's RMS error is 8.5% over all 375 shapes
and 4.4% over the 108 of at least 2 · 2048³ FLOPs (worst 12.4%). A few of the points (TFLOP/s
measured / this model): 4096³ 780.2 / 767.6; 2048³ 641.0 / 610.1; 4096 × 4096 × 256 398.6 /
413.8; 2048 × 2048 × 256 219.7 / 221.6; 1024³ 252.8 / 241.3. :data:`H100_POINTS` holds them
for the tests.

**Other devices.** The shape terms (t₀, k₀) are kept; ``e`` scales with the device's largest
sustained GEMM throughput relative to H100's, from the maximal achievable matmul FLOP/s
measured by the same sweep on each (Bekman, "Machine Learning Engineering",
``compute/accelerator/benchmarks/mamf-finder.py``: A100 SXM 271.2 of 312, H100 SXM 794.5 of
989, MI250X (one GCD) 147.0 of 191.5 TFLOP/s). A cluster's ``gemm_efficiency`` is this ``e``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["H100_POINTS", "Gemm", "gemm_time"]

OVERHEAD_S = 6.0e-6
"""t₀: the fitted fixed cost per GEMM call."""
K_HALF = 102.0
"""k₀: the fitted per-tile overhead, in elements of k."""


class Gemm(NamedTuple):
    """``batch`` products of an (m × k) and a (k × n) matrix in one call."""

    m: float
    n: float
    k: float
    batch: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k


H100_POINTS: tuple[tuple[Gemm, float], ...] = (
    (Gemm(4096, 4096, 4096), 780.19e12),
    (Gemm(2048, 2048, 2048), 641.04e12),
    (Gemm(4096, 4096, 256), 398.57e12),
    (Gemm(2048, 2048, 256), 219.67e12),
    (Gemm(1024, 1024, 1024), 252.76e12),
)
"""Measured bf16 FLOP/s of a few shapes on H100 SXM (OpenXLA's table, module docstring)."""


def gemm_time(
    gemm: Gemm,
    peak_flops: float,
    efficiency: float,
    *,
    overhead_s: float = OVERHEAD_S,
    k_half: float = K_HALF,
) -> float:
    """Seconds for ``gemm`` on a device of ``peak_flops`` whose large GEMMs sustain
    ``efficiency`` of it (module docstring)."""
    if not (gemm.m > 0 and gemm.n > 0 and gemm.k > 0 and gemm.batch > 0):
        raise ValueError(f"a GEMM's dimensions must be > 0, got {gemm}")
    return overhead_s + gemm.flops / (peak_flops * efficiency) * (1.0 + k_half / gemm.k)
