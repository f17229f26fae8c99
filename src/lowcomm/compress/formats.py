"""Codecs and wire formats: how one fp32 tensor becomes bytes on the wire, and back.

Every codec reports the exact number of bytes it puts on the wire for a tensor of a given shape
(:meth:`Codec.wire_nbytes`), scales and indices included. A codec whose encoding of a tensor
would not be smaller than the tensor itself sends that tensor raw (fp32) instead
(:meth:`Codec.compresses`); so do PowerSGD for 1-D tensors and every codec for tensors too small
to gain.

Wire formats (byte order: the machine's, little-endian on every platform torch supports; n the
number of elements, ``⌈·⌉`` rounding up):

* :class:`Raw` (``"fp32"``): n fp32 values, ``4n`` bytes.
* :class:`BF16` (``"bf16"``): n bfloat16 values (round to nearest even), ``2n`` bytes.
* :class:`Quantize` (``"int8"``, ``"int4"``, ``"int2"``): blockwise absmax quantisation to b
  bits. The flattened tensor is cut into ⌈n/B⌉ blocks of B elements (the last may be short);
  block j has the scale s_j = max|x| / q_max, q_max = 2^(b−1) − 1, and each element the code
  q = round(x / s_j) ∈ [−q_max, q_max] (nearest, ties to even; or stochastic rounding
  ⌊x / s_j + u⌋, u ~ U[0, 1), which is unbiased). Layout: ⌈n/B⌉ fp32 scales, then the codes
  q + q_max as unsigned b-bit fields packed 8/b to a byte, element i in bits
  ``b·(i mod 8/b)`` and up of byte ``i div (8/b)``: ``⌈n·b/8⌉ + 4·⌈n/B⌉`` bytes. Decoding is
  q·s_j; the error per element is at most s_j / 2 (nearest) or below s_j (stochastic).
* :class:`Sign` (``"sign"``): the sign of each element scaled by its block's mean magnitude
  (scaled signSGD; with error feedback, Karimireddy et al., ICML 2019,
  https://arxiv.org/abs/1901.09847). Blocks as for :class:`Quantize`; block j has the scale
  s_j = mean|x| over its elements, each element one bit (1: x ≥ 0). Layout: ⌈n/B⌉ fp32
  scales, then the bits packed 8 to a byte, element i in bit ``i mod 8`` of byte ``i div 8``:
  ``⌈n/8⌉ + 4·⌈n/B⌉`` bytes. Decoding is ±s_j.
* :class:`TopK` (``"topk:D"``): the k = max(1, ⌈D·n⌉) elements of largest magnitude. Layout:
  k int32 indices (ascending), then their k fp32 values: ``8k`` bytes.
* :class:`PowerSGD` (``"powersgd:R"``): a tensor reshaped to an (n₀ × m) matrix M
  (n₀ = ``shape[0]``) is sent as two fp32 factors P (n₀ × r) and Q (m × r),
  r = min(R, n₀, m): ``4·r·(n₀ + m)`` bytes, in two all-reduces (see
  :mod:`lowcomm.compress.collectives`).

Codecs are built from spec strings such as ``"int4:block=64:sr"`` by
:func:`lowcomm.compress.codecs.parse_compression`, which re-exports the classes defined here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lowcomm.compress.options import flag_option, float_option, int_option, reject_unknown

__all__ = [
    "divisor",
    "BF16",
    "DEFAULT_BLOCK",
    "RAW_BYTES",
    "Codec",
    "ElementwiseCodec",
    "PowerSGD",
    "Quantize",
    "Raw",
    "Sign",
    "TopK",
    "orthogonalize",
    "PACKABLE_BITS",
    "pack_bits",
    "unpack_bits",
]

RAW_BYTES = 4
"""Bytes per element of a tensor sent uncompressed (fp32)."""

DEFAULT_BLOCK = 128
"""Default block size B of :class:`Quantize`."""


def _numel(shape: torch.Size | tuple[int, ...]) -> int:
    return math.prod(shape)


class Codec(ABC):
    """A compression scheme for one tensor. Codecs are immutable settings; per-worker state
    (residuals, PowerSGD's Q, random generators) lives in a
    :class:`~lowcomm.compress.feedback.Compressor`."""

    @property
    @abstractmethod
    def spec(self) -> str:
        """The spec string that :func:`~lowcomm.compress.codecs.parse_compression` turns back
        into this codec."""

    @abstractmethod
    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Wire bytes of a tensor of ``shape`` when this codec compresses it."""

    def compresses(self, shape: torch.Size | tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` is compressed (else it is sent raw, fp32): only when
        the encoding is strictly smaller than ``4·numel`` bytes."""
        n = _numel(shape)
        return n > 0 and self.encoded_nbytes(shape) < RAW_BYTES * n

    def wire_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Exact bytes this codec puts on the wire for one tensor of ``shape`` from one rank
        (its raw size when it does not compress it)."""
        if self.compresses(shape):
            return self.encoded_nbytes(shape)
        return RAW_BYTES * _numel(shape)

    def __str__(self) -> str:
        return self.spec

    @classmethod
    def from_spec(cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]) -> Codec:
        """The codec of the spec string ``spec``: its ``name`` and its options, split into
        ``positional`` and ``keyed`` (:func:`~lowcomm.compress.codecs.parse_codec` calls it
        through its name table). By default a codec that takes no options."""
        reject_unknown(spec, keyed, ())
        if positional:
            raise ValueError(f"compression {spec!r}: {name} takes no options")
        return cls()


class ElementwiseCodec(Codec):
    """A codec whose payloads are decoded independently per rank, so they travel by all-gather
    (see :mod:`lowcomm.compress.collectives`)."""

    stochastic: bool = False

    @abstractmethod
    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """The wire bytes of ``x`` (any shape, fp32): a 1-D uint8 tensor of
        :meth:`encoded_nbytes` bytes."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The fp32 tensor of ``shape`` that ``payload`` (uint8, any storage offset) encodes."""

    def roundtrip(
        self, x: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``decode(encode(x))``: what the other ranks receive for ``x``."""
        return self.decode(self.encode(x, generator=generator), x.shape)


def _as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype`` (copied, so any storage offset works)."""
    return payload.contiguous().clone().view(dtype)


def largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the ``k`` values of largest magnitude in each row of ``values`` (the last
    dimension), ascending. NaN counts as the largest, and which of the values whose magnitude
    equals the k-th's are taken is unspecified, as for :func:`torch.topk` (the set is the same
    wherever the k-th largest magnitude is not repeated). On the CPU by NumPy
    (:func:`_largest_cpu`, where :data:`NUMPY_ON_CPU`: several times as fast as ``torch.topk``
    for the 1% of a tensor that top-k keeps, where torch's CPU kernel keeps a heap of the k
    largest); elsewhere by ``torch.topk`` of the magnitudes."""
    n = values.shape[-1]
    cpu = values.device.type == "cpu" and values.dtype == torch.float32
    if cpu and NUMPY_ON_CPU and 0 < k < n:
        rows = values.detach().reshape(-1, n).numpy()
        return torch.from_numpy(_largest_cpu(rows, k)).reshape(*values.shape[:-1], k)
    return torch.topk(values.abs(), k, dim=-1, sorted=False).indices.sort(dim=-1).values


NUMPY_ON_CPU = True
"""Whether the codecs use NumPy on the CPU where it is faster than torch's CPU kernels:
:func:`largest` (top-k's selection) and the packing and unpacking of a quantiser's or the
sign codec's codes (:mod:`lowcomm.compress.blocked`). ``False``: torch's operations there too,
the path a GPU runs (the structural tests of what the sync path asks of a device set it so);
the bytes are the same either way."""

LARGEST_SAMPLE = 16
""":func:`_largest_cpu` bounds each row's k-th largest magnitude from below by every this-th
element of the row."""


def _largest_cpu(rows: Any, k: int) -> Any:
    """:func:`largest` of a 2-D NumPy array of ``n`` columns, exactly, in one pass over it where
    the values allow: a bound ``b`` from every :data:`LARGEST_SAMPLE`-th element (a
    magnitude of the sample ranked a little above where the k-th largest of the row should
    fall), the candidates (magnitude at least ``b``, or NaN) found in one comparison, and each
    row's k largest among its candidates (``np.argpartition``). Every value of magnitude at
    least ``b`` is a candidate, so where a row has at least k candidates its k largest are among
    them; a row with fewer (a sample that missed the large values) falls back to
    ``np.argpartition`` of the whole row, as do rows too short to sample."""
    count, n = rows.shape
    out = np.empty((count, k), dtype=np.int64)
    sample = np.abs(rows[:, ::LARGEST_SAMPLE])
    m = sample.shape[1]
    expected = k * m / n  # the k-th largest's rank in the sample
    rank = math.ceil(1.25 * expected + 4.0 * math.sqrt(expected)) + 1
    if n < 64 * LARGEST_SAMPLE or rank >= m // 2:
        for r in range(count):
            out[r] = _largest_row(np.abs(rows[r]), k)
        return out
    bound = np.partition(sample, m - rank, axis=1)[:, m - rank][:, None]
    # |x| >= bound, NaN included (both comparisons are false for NaN)
    candidates = np.flatnonzero(~((rows < bound) & (rows > -bound)))
    ends = np.searchsorted(candidates, np.arange(1, count + 1) * n)
    flat = rows.reshape(-1) if rows.flags.c_contiguous else None
    start = 0
    for r in range(count):
        found = candidates[start : ends[r]] - r * n
        start = ends[r]
        if found.size < k:
            out[r] = _largest_row(np.abs(rows[r]), k)
            continue
        magnitudes = np.abs(flat[found + r * n] if flat is not None else rows[r, found])
        out[r] = found[_largest_row(magnitudes, k)]
    return out


def _largest_row(magnitudes: Any, k: int) -> Any:
    """The positions of the k largest of a 1-D NumPy array (NaN the largest), ascending."""
    n = magnitudes.shape[0]
    if k >= n:
        return np.arange(n)
    return np.sort(np.argpartition(magnitudes, n - k)[n - k :])


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).contiguous().view(torch.uint8)


def _uniform(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """U[0, 1) noise of ``like``'s shape and dtype on its device, drawn on ``generator``'s
    device: a generator must draw on its own device (a CPU generator's noise for a GPU tensor
    is drawn on the CPU and copied, the same numbers as for a CPU tensor); without one, from
    the global generator of ``like``'s device."""
    device = like.device if generator is None else generator.device
    u = torch.rand(like.shape, generator=generator, device=device, dtype=like.dtype)
    return u.to(like.device)


def divisor(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-dim fp32 tensor on ``device`` (a fill there, no copy from the host): a
    divisor the GPU divides by exactly, where it multiplies by a Python number's fp32
    reciprocal (a last bit apart for about half of int4's scales and 1 in 20 of int8's)."""
    return torch.full((), float(value), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class Raw(ElementwiseCodec):
    """No compression: fp32 values, ``4n`` bytes. Spec ``"fp32"``."""

    @property
    def spec(self) -> str:
        return "fp32"

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        return RAW_BYTES * _numel(shape)

    def compresses(self, shape: torch.Size | tuple[int, ...]) -> bool:
        return False

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        return _bytes(x.detach().float().clone())

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return _as(payload, torch.float32).view(shape)


@dataclass(frozen=True)
class BF16(ElementwiseCodec):
    """bfloat16 values (round to nearest even), ``2n`` bytes. Spec ``"bf16"``.

    Sent by all-gather and summed in fp32 after decoding, not all-reduced in bf16: a bf16 sum
    rounds every partial sum to 8 significant bits, so its error grows with N and depends on
    the reduction order; decoding first keeps the only rounding the one each rank's error
    feedback sees.
    """

    @property
    def spec(self) -> str:
        return "bf16"

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        return 2 * _numel(shape)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        return _bytes(x.detach().to(torch.bfloat16))

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return _as(payload, torch.bfloat16).float().view(shape)


PACKABLE_BITS = (1, 2, 4, 8)
"""Field widths :func:`pack_bits` packs: whole fields to a byte."""


_SUM_BELOW = 8192
"""Bytes below which :func:`pack_bits` packs with one shift and one sum (fewer operations);
from here on, field by field (a sum over a row of 2 or 4 is slow on long tensors)."""


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """The bit offset of each of the 8/bits fields of a byte, as a uint8 row to broadcast."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, each < 2^bits) 8/bits to a byte; element i goes
    to bits ``bits·(i mod 8/bits)`` and up of byte ``i div (8/bits)``. ⌈n·bits/8⌉ bytes."""
    assert bits in PACKABLE_BITS
    if bits == 8:
        return codes.reshape(-1).to(torch.uint8)
    per = 8 // bits
    n = codes.numel()
    flat = codes.reshape(-1)
    if n % per:
        flat = torch.cat([flat, flat.new_zeros(per - n % per)])
    fields = flat.view(-1, per)
    shifts = _shifts(bits, flat.device)
    if fields.shape[0] < _SUM_BELOW:
        # the fields do not overlap, so their sum is their bitwise or (and fits in a byte)
        return (fields << shifts).sum(dim=1, dtype=torch.uint8)
    out = fields[:, 0].clone()
    for i in range(1, per):
        out.bitwise_or_(fields[:, i].bitwise_left_shift(shifts[i]))
    return out


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes (uint8)."""
    assert bits in PACKABLE_BITS
    if bits == 8:
        return packed[:n].to(torch.uint8)
    fields = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return fields.reshape(-1)[:n]


@dataclass(frozen=True)
class Quantize(ElementwiseCodec):
    """Blockwise absmax quantisation to ``bits`` ∈ {2, 4, 8} bits with one fp32 scale per block
    of ``block`` elements; optional stochastic rounding. See the module docstring for the exact
    layout: ``⌈n·bits/8⌉ + 4·⌈n/block⌉`` bytes. Specs ``"int8"``, ``"int4"``, ``"int2"``
    (``:block=B``, ``:sr``)."""

    bits: int = 8
    block: int = DEFAULT_BLOCK
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.bits not in PACKABLE_BITS:
            raise ValueError(f"bits must be 2, 4 or 8, got {self.bits!r}; e.g. 'int4'")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}; e.g. 128")

    @property
    def qmax(self) -> int:
        """Largest code magnitude, 2^(bits−1) − 1."""
        return (1 << (self.bits - 1)) - 1

    @property
    def spec(self) -> str:
        s = f"int{self.bits}"
        if self.block != DEFAULT_BLOCK:
            s += f":block={self.block}"
        if self.stochastic:
            s += ":sr"
        return s

    @classmethod
    def from_spec(
        cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]
    ) -> Quantize:
        reject_unknown(spec, keyed, ("block", "sr"))
        block, sr = DEFAULT_BLOCK, False
        for p in positional:
            if p == "sr":
                sr = True
            elif p.isdigit():
                block = int(p)
            else:
                raise ValueError(
                    f"compression {spec!r}: unknown option {p!r}; e.g. 'int4:block=64:sr'"
                )
        if "block" in keyed:
            block = int_option(spec, "block", keyed["block"])
        if "sr" in keyed:
            sr = flag_option(spec, "sr", keyed["sr"])
        if block < 1:
            raise ValueError(f"compression {spec!r}: block must be >= 1; e.g. 'int4:block=128'")
        return cls(bits=int(name[3:]), block=block, stochastic=sr)

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        n = _numel(shape)
        return -(-n * self.bits // 8) + 4 * -(-n // self.block)

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel()
        nb = -(-n // self.block)
        if n == nb * self.block:
            return flat.view(nb, self.block)
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        return padded.view(nb, self.block)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1).float()
        n = flat.numel()
        blocks = self._blocks(flat)
        qmax = self.qmax
        scale = blocks.abs().amax(dim=1).div_(divisor(qmax, blocks.device))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = blocks / safe.unsqueeze(1)
        q = torch.floor_(y.add_(_uniform(y, generator))) if self.stochastic else y.round_()
        codes = q.clamp_(-qmax, qmax).add_(qmax).to(torch.uint8).reshape(-1)[:n]
        return torch.cat([_bytes(scale), pack_bits(codes, self.bits)])

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        n = _numel(shape)
        nb = -(-n // self.block)
        scale = _as(payload[: 4 * nb], torch.float32)
        codes = unpack_bits(payload[4 * nb :], self.bits, n)
        if n == nb * self.block:
            q = codes.float().sub_(self.qmax)
        else:
            q = torch.zeros(nb * self.block, dtype=torch.float32, device=payload.device)
            q[:n] = codes.float() - self.qmax
        return (q.view(nb, self.block) * scale.unsqueeze(1)).reshape(-1)[:n].view(shape)


@dataclass(frozen=True)
class Sign(ElementwiseCodec):
    """One bit per element: its sign, scaled by the mean magnitude of its block of ``block``
    elements (see the module docstring): ``⌈n/8⌉ + 4·⌈n/block⌉`` bytes. Spec ``"sign"``
    (``:block=B``). Biased on its own; error feedback carries what it drops to the next
    round."""

    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}; e.g. 128")

    @property
    def spec(self) -> str:
        return "sign" if self.block == DEFAULT_BLOCK else f"sign:block={self.block}"

    @classmethod
    def from_spec(cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]) -> Sign:
        reject_unknown(spec, keyed, ("block",))
        if len(positional) > 1 or (positional and not positional[0].isdigit()):
            raise ValueError(f"compression {spec!r}: sign takes one option, e.g. 'sign:block=64'")
        block = int_option(
            spec, "block", keyed.get("block", positional[0] if positional else str(DEFAULT_BLOCK))
        )
        if block < 1:
            raise ValueError(f"compression {spec!r}: block must be >= 1; e.g. 'sign:block=128'")
        return cls(block=block)

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        n = _numel(shape)
        return -(-n // 8) + 4 * -(-n // self.block)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1).float()
        n = flat.numel()
        nb = -(-n // self.block)
        padded = torch.zeros(nb * self.block, dtype=torch.float32, device=flat.device)
        padded[:n] = flat.abs()
        counts = torch.full((nb,), float(self.block), device=flat.device)
        counts[-1] = float(n - (nb - 1) * self.block)  # the last block may be short
        scale = padded.view(nb, self.block).sum(dim=1) / counts
        bits = (flat >= 0).to(torch.uint8)
        return torch.cat([_bytes(scale), pack_bits(bits, 1)])

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        n = _numel(shape)
        nb = -(-n // self.block)
        scale = _as(payload[: 4 * nb], torch.float32)
        bits = unpack_bits(payload[4 * nb :], 1, n).float()
        s = torch.zeros(nb * self.block, dtype=torch.float32, device=payload.device)
        s[:n] = 2.0 * bits - 1.0
        return (s.view(nb, self.block) * scale.unsqueeze(1)).reshape(-1)[:n].view(shape)


@dataclass(frozen=True)
class TopK(ElementwiseCodec):
    """The k = max(1, ⌈density·n⌉) elements of largest magnitude: k int32 indices (ascending)
    then k fp32 values, ``8k`` bytes. Spec ``"topk:DENSITY"``."""

    density: float = 0.01

    def __post_init__(self) -> None:
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(f"top-k density must be in (0, 1], got {d!r}; e.g. 'topk:0.01'")

    @property
    def spec(self) -> str:
        return f"topk:{self.density:g}"

    def k(self, n: int) -> int:
        """Elements kept of a tensor of ``n``: max(1, ⌈density·n⌉), at most n."""
        return min(n, max(1, math.ceil(self.density * n)))

    @classmethod
    def from_spec(cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]) -> TopK:
        reject_unknown(spec, keyed, ("density",))
        if len(positional) > 1:
            raise ValueError(f"compression {spec!r}: top-k takes one density, e.g. 'topk:0.01'")
        raw = keyed.get("density", positional[0] if positional else None)
        if raw is None:
            raise ValueError(f"compression {spec!r} needs a density, e.g. 'topk:0.01'")
        return cls(density=float_option(spec, "density", raw))

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        return 8 * self.k(_numel(shape))

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1).float()
        k = self.k(flat.numel())
        idx = largest(flat, k)
        return torch.cat([_bytes(idx.to(torch.int32)), _bytes(flat[idx].contiguous())])

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        n = _numel(shape)
        k = self.k(n)
        idx = _as(payload[: 4 * k], torch.int32).long()
        vals = _as(payload[4 * k : 8 * k], torch.float32)
        out = torch.zeros(n, dtype=torch.float32, device=payload.device)
        out[idx] = vals
        return out.view(shape)


@dataclass(frozen=True)
class PowerSGD(Codec):
    """Rank-``rank`` PowerSGD (Vogels et al., NeurIPS 2019, https://arxiv.org/abs/1905.13727).

    A tensor of ≥ 2 dimensions is viewed as an (n₀ × m) matrix M (n₀ = ``shape[0]``) and sent
    as P = M·Q (all-reduced, then orthogonalised to P̂) and Q = Mᵀ·P̂ (all-reduced): two fp32
    factors, ``4·r·(n₀ + m)`` bytes with r = min(rank, n₀, m). Q starts from a random matrix
    drawn from ``seed`` (the same on every rank) and, with ``warm_start``, each round starts
    from the previous round's averaged Q. 1-D tensors, and matrices whose factors would not be
    smaller than M (unless ``only_if_smaller=False``), are sent raw. Spec ``"powersgd:R"``
    (``:warm=0``, ``:seed=S``).
    """

    rank: int = 4
    warm_start: bool = True
    seed: int = 0
    only_if_smaller: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"PowerSGD rank must be a positive integer, got {self.rank!r}; e.g. 'powersgd:4'"
            )

    @property
    def spec(self) -> str:
        s = f"powersgd:{self.rank}"
        if not self.warm_start:
            s += ":warm=0"
        if self.seed:
            s += f":seed={self.seed}"
        if not self.only_if_smaller:
            s += ":always=1"
        return s

    @staticmethod
    def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        """(n₀, m): the matrix a tensor of ``shape`` is viewed as."""
        n0 = int(shape[0])
        return n0, _numel(shape) // max(1, n0)

    def effective_rank(self, shape: torch.Size | tuple[int, ...]) -> int:
        n0, m = self.matrix_shape(shape)
        return min(self.rank, n0, m)

    @classmethod
    def from_spec(
        cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]
    ) -> PowerSGD:
        reject_unknown(spec, keyed, ("rank", "warm", "seed", "always"))
        if len(positional) > 1:
            raise ValueError(f"compression {spec!r}: PowerSGD takes one rank, e.g. 'powersgd:4'")
        rank = int_option(spec, "rank", keyed.get("rank", positional[0] if positional else "4"))
        return cls(
            rank=rank,
            warm_start=flag_option(spec, "warm", keyed.get("warm", "1")),
            seed=int_option(spec, "seed", keyed.get("seed", "0")),
            only_if_smaller=not flag_option(spec, "always", keyed.get("always", "0")),
        )

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        n0, m = self.matrix_shape(shape)
        return RAW_BYTES * self.effective_rank(shape) * (n0 + m)

    def compresses(self, shape: torch.Size | tuple[int, ...]) -> bool:
        if len(shape) < 2 or _numel(shape) == 0:
            return False
        if not self.only_if_smaller:
            return True
        return self.encoded_nbytes(shape) < RAW_BYTES * _numel(shape)

    def initial_q(
        self,
        shape: torch.Size | tuple[int, ...],
        index: int,
        draw: int = 0,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The random (m × r) starting Q of tensor ``index``: the same on every rank and every
        device (drawn from ``seed``, ``index`` and ``draw`` on the CPU, then moved to
        ``device``, the CPU by default)."""
        _, m = self.matrix_shape(shape)
        r = self.effective_rank(shape)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index * 10_007 + draw) % (2**63))
        q = torch.randn(m, r, generator=g)
        return q if device is None else q.to(device)

    def start_q(
        self,
        shape: torch.Size | tuple[int, ...],
        index: int,
        previous: torch.Tensor | None,
        *,
        draw: int = 0,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The (m × r) Q a round starts from: with ``warm_start`` the previous round's mean Q
        (``previous``; cut to r columns, or extended by :meth:`initial_q`'s columns when the
        rank grew), else a fresh draw (``draw``: the round). The same on every rank. On
        ``device`` (default: ``previous``'s, else the CPU)."""
        r = self.effective_rank(shape)
        if device is None and previous is not None:
            device = previous.device
        if not self.warm_start:
            return self.initial_q(shape, index, draw=draw, device=device)
        if previous is None:
            return self.initial_q(shape, index, device=device)
        if previous.shape[1] >= r:
            return previous[:, :r].contiguous().to(device)
        fresh = self.initial_q(shape, index, device=device)
        return torch.cat([previous.to(device), fresh[:, previous.shape[1] :]], dim=1)

    def local_error(self, m: torch.Tensor, q: torch.Tensor) -> float:
        """‖M − P̂·P̂ᵀ·M‖² for P̂ = orth(M·Q): the error of one rank's compression of ``m``
        from the start ``q`` (one power-iteration step, as one round of PowerSGD)."""
        rows, cols = self.matrix_shape(m.shape)
        mat = m.detach().float().reshape(rows, cols)
        p_hat = orthogonalize(mat @ q.to(mat.device))
        return float(torch.sum((mat - p_hat @ (p_hat.t() @ mat)).double() ** 2))


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of ``p`` (n × r, r ≤ n): the Q of a reduced QR
    factorisation (Householder, deterministic for equal inputs)."""
    return torch.linalg.qr(p, mode="reduced").Q
