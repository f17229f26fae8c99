"""The chunked orthonormal DCT-II that DeMo compresses with, as pure functions over tensors.

A tensor is cut into chunks along its last one or two dimensions: per dimension the chunk is the
largest divisor of the size that is ≤ the target (:func:`chunk_size`; official DeMo's
``_get_smaller_split``), and each chunk is transformed by the orthonormal DCT-II along each of
its dimensions (a 2-D DCT per block of a matrix). :func:`encode` returns the coefficients as
``(chunks, coefficients per chunk)``; :func:`decode` inverts it. Leading dimensions of tensors
with more than two are batch dimensions; a 0-d tensor is one chunk of one element.

Example::

    plan = ChunkPlan.for_shape(torch.Size([128, 96]), target=64)   # 2 x 3 blocks of 64 x 32
    coeffs = encode(x, plan)                                        # (6, 2048)
    torch.testing.assert_close(decode(coeffs, plan), x)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = ["ChunkPlan", "chunk_size", "dct_matrix", "decode", "encode"]


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is ≤ ``target`` (``n`` itself when ``n`` ≤ target)."""
    if n <= target:
        return max(1, n)
    return max(d for d in range(1, target + 1) if n % d == 0)


@functools.lru_cache(maxsize=64)
def _dct64(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


@functools.lru_cache(maxsize=256)
def _dct_on(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _dct64(n).to(dtype=dtype, device=device)


def dct_matrix(n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix C (``C[k, j]``: coefficient k of position j; C⁻¹ = Cᵀ),
    computed in float64 on the CPU and cast: the same values on every device.

    Cached per size, dtype and device (read-only: do not modify it in place). DeMo transforms
    every parameter twice a step; building the matrix on a GPU each time would be a host-to-
    device copy from pageable memory per call, each stalling the stream.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _dct_on(n, dtype, device)


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor shape is chunked: ``sizes`` the chunk size along each chunked trailing
    dimension (the last two of a tensor with two or more, else the one; a 0-d tensor is one
    chunk of one element)."""

    shape: torch.Size
    sizes: tuple[int, ...]

    @classmethod
    def for_shape(cls, shape: torch.Size, target: int) -> ChunkPlan:
        trailing = tuple(shape[-2:]) if len(shape) >= 2 else (tuple(shape) or (1,))
        return cls(torch.Size(shape), tuple(chunk_size(n, target) for n in trailing))

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def per_chunk(self) -> int:
        """Coefficients per chunk."""
        return math.prod(self.sizes)

    @property
    def chunks(self) -> int:
        return self.numel // self.per_chunk


def _matrices(plan: ChunkPlan, like: torch.Tensor) -> list[torch.Tensor]:
    return [dct_matrix(n, like.dtype, like.device) for n in plan.sizes]


def encode(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The chunked DCT of ``x`` (shape ``plan.shape``): ``(chunks, coefficients per chunk)``,
    chunks in row-major block order, a 2-D block's coefficients row-major (k₁ · n₂ + k₂)."""
    mats = _matrices(plan, x)
    if len(plan.sizes) == 1:
        (n,) = plan.sizes
        return x.reshape(-1, n) @ mats[0].T
    a, b = plan.sizes
    rows, cols = plan.shape[-2], plan.shape[-1]
    blocks = x.reshape(-1, rows // a, a, cols // b, b).permute(0, 1, 3, 2, 4)
    out = mats[0] @ blocks @ mats[1].T
    return out.reshape(-1, a * b)


def decode(coeffs: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The inverse of :func:`encode`: a tensor of ``plan.shape``."""
    mats = _matrices(plan, coeffs)
    if len(plan.sizes) == 1:
        return (coeffs @ mats[0]).reshape(plan.shape)
    a, b = plan.sizes
    rows, cols = plan.shape[-2], plan.shape[-1]
    blocks = coeffs.reshape(-1, rows // a, cols // b, a, b)
    out = mats[0].T @ blocks @ mats[1]
    return out.permute(0, 1, 3, 2, 4).reshape(plan.shape)
