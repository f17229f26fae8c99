"""SparseLoCo's codec (:class:`Sparse`, spec ``"sparse"``): each tensor cut into chunks, the
largest magnitudes of every chunk kept, their values quantised to a few bits with a codebook
fitted to them, their positions sent as bit-packed indices within the chunk.

Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo",
2025 (https://arxiv.org/abs/2508.15706), whose official code this follows:

* **Chunks.** A tensor is read as an (r × c) matrix (r = ``shape[0]``, c the rest; a 1-D or 0-D
  tensor as 1 × n) and cut into tiles of h × w, h the largest divisor of r that is at most
  ``chunk`` (s) and w that of c: s × s = 4096-element tiles for the usual matrices, chunks of s
  for a vector, no padding (a prime dimension gives a side of 1).
* **Top-k.** k = max(1, round(density · h·w)) elements of largest magnitude per tile (Python's
  round, half to even; at most h·w); their indices within the tile in ascending order.
* **Values** (``bits`` = b ∈ {2, 4}): over every kept value v of the tensor, the shift
  μ = mean(v), the centred c = v − μ, σ = ‖c‖ / √(K − 1) (K the values kept; 0 when K = 1), the
  step s = 6σ / 2^b (1 when that is 0 or not finite) and the code
  q = clamp(round(c / s + 2^(b−1)), 0, 2^b − 1) (half to even); the codebook holds for each code
  the mean of the c that took it (0 for a code none took), and a value decodes to
  codebook[q] + μ. μ, σ and the codebook's means are summed in float64 and rounded to fp32, so
  they do not depend on the order of the summation (nor on the device). ``bits=32`` sends the
  kept values as they are.
* **Wire format** of a tensor (K = tiles · k): the fp32 μ and the 2^b fp32 codebook entries
  (none with ``bits=32``), then the K indices as ⌈log₂(h·w)⌉-bit unsigned fields (12 bits for a
  4096-element tile), then the K codes as b-bit fields (or K fp32 values), tile after tile; each
  part a little-endian bit stream (field i in bits i·w and up, lowest bit first), padded to a
  whole byte: ``4·(1 + 2^b) + ⌈K·⌈log₂ h·w⌉ / 8⌉ + ⌈K·b / 8⌉`` bytes. At density 1/64 and 2 bits
  that is 0.22 bits an element against fp32's 32: 146× smaller.
* **Aggregation.** The ranks' payloads are all-gathered (indices counted on the wire) and an
  element's value is the **mean over the ranks that sent it** (their values summed in rank order,
  divided by how many they are); an element no rank sent is 0. This is the official code's
  ``scatter_reduce(mean, include_self=False)``: not a mean over all N ranks, which would shrink
  every element that only some ranks kept. ``power`` = γ (lowcomm's, 1 the paper's) divides
  the sum by n^γ instead, n the ranks that sent the element: γ > 1 takes a shorter step where
  several ranks agree than where one alone sent, an element one rank sent keeping its value.

A bucket's tensors of one shape are one :class:`SparseSection`, encoded together through
strided views of the bucket (a model's layers repeat their shapes: a fixed number of operations
per shape, not per tensor), their bytes tensor after tensor, each tensor's as above.

The error feedback that goes with it (SparseLoCo's accumulator e ← β·e + Δ, what was sent taken
out of it) is the :class:`~lowcomm.compress.feedback.Compressor`'s with ``feedback_decay=β``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowcomm.compress.formats import ElementwiseCodec
from lowcomm.compress.options import float_option, int_option, reject_unknown
from lowcomm.compress.sections import Section, as_type, strided_chains

__all__ = [
    "DEFAULT_DENSITY",
    "Sparse",
    "SparseSection",
    "Tiling",
    "chunk_side",
    "pack_rows",
    "quantise_rows",
    "unpack_rows",
]

DEFAULT_DENSITY = 1 / 64
"""Elements kept per tile: 64 of a 64 × 64 tile (1.56%), the official code's production
setting and the paper's 146× compression."""

DEFAULT_CHUNK = 64
"""s: the side of a tile."""

RANGE_SIGMAS = 6.0
"""The quantiser's range, in standard deviations of the kept values (the official code's)."""

VALUE_BITS = (2, 4, 32)
"""Bits a kept value takes: a 4- or 16-entry codebook, or fp32 as it is."""


def chunk_side(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (``n`` itself when smaller)."""
    if n <= target:
        return max(1, n)
    for d in range(target, 0, -1):
        if n % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class Tiling:
    """How a tensor is cut into tiles (see the module docstring)."""

    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def tiles(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def kept(self) -> int:
        """K: the elements kept, k of every tile."""
        return self.tiles * self.k

    @property
    def index_bits(self) -> int:
        """Bits of an index within a tile: ⌈log₂(h·w)⌉, at least 1."""
        return max(1, math.ceil(math.log2(self.h * self.w)))

    def tile_starts(self) -> torch.Tensor:
        """Where each tile's first element lies in the tensor (row-major over the tile grid)."""
        tx = self.cols // self.w
        tile = torch.arange(self.tiles)
        return (tile // tx) * (self.h * self.cols) + (tile % tx) * self.w

    def offsets(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices within a tile as offsets from the tile's first element."""
        return (idx // self.w) * self.cols + idx % self.w


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Each row of unsigned integers (R × K, each < 2^bits) as a little-endian bit stream:
    field i in bits ``bits·i`` and up, lowest bit first, padded with zeros to a whole byte:
    R × ⌈K·bits/8⌉ bytes (for 1, 2, 4 and 8 bits the layout of
    :func:`~lowcomm.compress.formats.pack_bits`)."""
    rows, k = values.shape
    shifts = torch.arange(bits, dtype=torch.int32, device=values.device)
    stream = ((values.to(torch.int32).unsqueeze(2) >> shifts) & 1).to(torch.uint8)
    stream = stream.reshape(rows, k * bits)
    # (padded even by nothing: as many operations whatever the sizes)
    stream = torch.cat([stream, stream.new_zeros(rows, -(k * bits) % 8)], dim=1)
    weights = torch.arange(8, dtype=torch.uint8, device=values.device)
    return (stream.view(rows, -1, 8) << weights).sum(dim=2, dtype=torch.uint8)


def unpack_rows(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: each row's first ``k`` fields (int64)."""
    rows = packed.shape[0]
    weights = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(2) >> weights) & 1).reshape(rows, -1)[:, : k * bits]
    shifts = torch.arange(bits, dtype=torch.int64, device=packed.device)
    return (stream.reshape(rows, k, bits).long() << shifts).sum(dim=2)


def quantise_rows(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes (uint8, R × K), the shifts μ (fp32, R) and the codebooks (fp32, R × 2^bits)
    of the kept values ``v`` (fp32, R × K: one tensor's a row), as the module docstring
    defines them."""
    bins = 1 << bits
    k = v.shape[1]
    shift = v.double().mean(dim=1).float()
    c = v - shift.unsqueeze(1)
    c64 = c.double()
    std = (c64.square().sum(dim=1) / max(1, k - 1)).sqrt() if k > 1 else c64.new_zeros(len(v))
    step = (std * RANGE_SIGMAS / bins).float()
    step = torch.where(torch.isfinite(step) & (step > 0), step, torch.ones_like(step))
    codes = (c / step.unsqueeze(1) + float(bins // 2)).round_().clamp_(0, bins - 1)
    codes = codes.to(torch.uint8)
    hit = codes.unsqueeze(2) == torch.arange(bins, device=v.device, dtype=torch.uint8)
    sums = torch.where(hit, c64.unsqueeze(2), 0.0).sum(dim=1)
    counts = hit.sum(dim=1)
    book = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0).float()
    return codes, shift, book


@dataclass(frozen=True)
class Sparse(ElementwiseCodec):
    """SparseLoCo's chunk-wise top-k with quantised values (see the module docstring). Spec
    ``"sparse"``, ``"sparse:DENSITY"`` with options ``chunk=S`` and ``bits=2|4|32``, e.g.
    ``"sparse:0.03:bits=4"``."""

    density: float = DEFAULT_DENSITY
    chunk: int = DEFAULT_CHUNK
    bits: int = 2
    power: float = 1.0

    def __post_init__(self) -> None:
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(f"sparse density must be in (0, 1], got {d!r}; e.g. 'sparse:0.02'")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"sparse chunk must be an integer >= 1, got {self.chunk!r}; e.g. 64")
        if self.bits not in VALUE_BITS:
            raise ValueError(
                f"sparse bits must be 2, 4 or 32 (fp32 values), got {self.bits!r}; "
                "e.g. 'sparse:bits=2'"
            )
        g = self.power
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < math.inf:
            raise ValueError(
                f"sparse power must be a finite number >= 0, got {g!r}; e.g. 'sparse:power=1.5'"
            )

    @property
    def spec(self) -> str:
        s = f"sparse:{self.density:g}"
        if self.chunk != DEFAULT_CHUNK:
            s += f":chunk={self.chunk}"
        if self.bits != 2:
            s += f":bits={self.bits}"
        if self.power != 1:
            s += f":power={self.power:g}"
        return s

    @classmethod
    def from_spec(
        cls, spec: str, name: str, positional: list[str], keyed: dict[str, str]
    ) -> Sparse:
        reject_unknown(spec, keyed, ("density", "chunk", "bits", "power"))
        if len(positional) > 1:
            raise ValueError(
                f"compression {spec!r}: sparse takes one density, e.g. 'sparse:0.02:bits=2'"
            )
        raw = keyed.get("density", positional[0] if positional else None)
        density = DEFAULT_DENSITY if raw is None else float_option(spec, "density", raw)
        chunk = int_option(spec, "chunk", keyed.get("chunk", str(DEFAULT_CHUNK)))
        bits = int_option(spec, "bits", keyed.get("bits", "2"))
        power = float_option(spec, "power", keyed.get("power", "1"))
        try:
            return cls(density=density, chunk=chunk, bits=bits, power=power)
        except ValueError as e:
            raise ValueError(f"compression {spec!r}: {e}") from None

    def tiling(self, shape: torch.Size | tuple[int, ...]) -> Tiling:
        """The tiles of a tensor of ``shape`` and the k kept of each."""
        n = math.prod(shape)
        rows = int(shape[0]) if len(shape) >= 2 else 1
        cols = n // rows if rows else 0
        h, w = chunk_side(rows, self.chunk), chunk_side(cols, self.chunk)
        k = min(h * w, max(1, round(self.density * h * w)))
        return Tiling(rows, cols, h, w, k)

    def header_nbytes(self) -> int:
        """Bytes of a tensor's shift and codebook."""
        return 0 if self.bits == 32 else 4 * (1 + (1 << self.bits))

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        t = self.tiling(shape)
        return self.header_nbytes() + -(-t.kept * t.index_bits // 8) + -(-t.kept * self.bits // 8)

    def encode(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1).float()
        section = SparseSection(self, x.shape, [flat.numel()], [0])
        section.to(flat.device)
        out = torch.empty(section.nbytes, dtype=torch.uint8, device=flat.device)
        section.encode_feedback(flat, None, None, out, None)
        return out

    def decode(self, payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """This one payload's elements, 0 where it kept none."""
        n = math.prod(shape)
        section = SparseSection(self, shape, [n], [0])
        section.to(payload.device)
        out = torch.empty(n, dtype=torch.float32, device=payload.device)
        section.decode_into(out, payload.reshape(1, -1), 1)
        return out.view(shape)


class SparseSection(Section):
    """The tensors of one shape through :class:`Sparse`, as strided views of the bucket
    (:func:`~lowcomm.compress.sections.strided_chains`); their bytes one tensor after the other,
    in the order of the views; decoded as the mean over the ranks that sent each element."""

    def __init__(
        self,
        codec: Sparse,
        shape: torch.Size | tuple[int, ...],
        numels: list[int],
        offsets: list[int],
    ) -> None:
        super().__init__(numels, offsets)
        self.codec = codec
        self.tiling = t = codec.tiling(shape)
        self.n = numels[0]
        self.count = len(numels)
        self.chains = strided_chains(offsets)
        order = [f + i * s for f, s, length in self.chains for i in range(length)]
        self.starts = torch.tensor(order, dtype=torch.long)
        """Each tensor's first element in the bucket, in the section's order."""
        self.tile_starts = t.tile_starts()
        self.head = codec.header_nbytes()
        self.index_nbytes = -(-t.kept * t.index_bits // 8)
        self.per_tensor = codec.encoded_nbytes(shape)
        self.nbytes = self.count * self.per_tensor

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each chain of tensors as a (length × n) strided view of the bucket ``flat``."""
        base = flat.storage_offset()
        return [
            flat.as_strided((length, self.n), (stride, 1), base + first)
            for first, stride, length in self.chains
        ]

    def _tiles(self, flat: torch.Tensor) -> torch.Tensor:
        """Every tensor's tiles (count × tiles × h·w), in the section's order."""
        t = self.tiling
        ty, tx = t.rows // t.h, t.cols // t.w
        base = flat.storage_offset()
        parts = []
        for first, stride, length in self.chains:
            grid = flat.as_strided(
                (length, ty, t.h, tx, t.w), (stride, t.h * t.cols, t.cols, t.w, 1), base + first
            )
            parts.append(grid.permute(0, 1, 3, 2, 4).reshape(length, t.tiles, t.h * t.w))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _local(self, idx: torch.Tensor) -> torch.Tensor:
        """Positions within each tensor of (… × count × tiles × k) indices within tiles."""
        return self.tile_starts.unsqueeze(1) + self.tiling.offsets(idx)

    def encode_feedback(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        mine: torch.Tensor | None,
        out: torch.Tensor,
        generator: torch.Generator | None,
    ) -> None:
        t = self.tiling
        if residual is not None:  # M = x + e, in e's memory
            for e, xs in zip(self._views(residual), self._views(x)):
                e.add_(xs)
        rows = self._tiles(x if residual is None else residual)
        idx = torch.topk(rows.abs(), t.k, dim=2, sorted=False).indices.sort(dim=2).values
        kept = rows.gather(2, idx).reshape(self.count, t.kept)
        parts = []
        if self.codec.bits == 32:
            decoded = kept
            tail = kept.contiguous().view(torch.uint8)
        else:
            codes, shift, book = quantise_rows(kept, self.codec.bits)
            decoded = book.gather(1, codes.long()) + shift.unsqueeze(1)
            parts.append(torch.cat([shift.unsqueeze(1), book], dim=1).view(torch.uint8))
            tail = pack_rows(codes, self.codec.bits)
        parts += [pack_rows(idx.reshape(self.count, t.kept), t.index_bits), tail]
        out.copy_(torch.cat(parts, dim=1).reshape(-1))
        pos = (self.starts.view(-1, 1, 1) + self._local(idx)).reshape(-1)
        values = decoded.reshape(-1)
        if mine is not None:
            for own in self._views(mine):
                own.zero_()
            mine.index_put_((pos,), values)
        if residual is not None:  # e ← M − C(M): M where nothing was kept
            residual.index_put_((pos,), values.neg(), accumulate=True)
            for e in self._views(residual):
                torch.nan_to_num_(e, nan=0.0, posinf=0.0, neginf=0.0)

    def decode_into(
        self,
        flat: torch.Tensor,
        data: torch.Tensor,
        world: int,
        *,
        senders: torch.Tensor | None = None,
    ) -> None:
        """Each element's mean over the ranks that sent it (their values summed in rank
        order; divided by n^γ with ``power`` γ ≠ 1), 0 where none did, into the section's
        elements of ``flat``. ``senders``: a weight per rank, 0 for a rank whose payload does
        not count (a replica healed at an elastic sync's quorum sends zeros, whose top-k would
        otherwise count as sent)."""
        t = self.tiling
        rows = data.reshape(world * self.count, self.per_tensor)
        at = self.head + self.index_nbytes
        idx = unpack_rows(rows[:, self.head : at], t.index_bits, t.kept)
        if self.codec.bits == 32:
            values = as_type(rows[:, at:], torch.float32)
        else:
            floats = as_type(rows[:, : self.head], torch.float32)
            codes = unpack_rows(rows[:, at:], self.codec.bits, t.kept)
            values = floats[:, 1:].gather(1, codes) + floats[:, :1]
        tensor = torch.arange(self.count, device=data.device).view(-1, 1, 1) * self.n
        local = tensor + self._local(idx.view(world, self.count, t.tiles, t.k))
        local = local.view(world, -1)
        values = values.view(world, -1)
        total = torch.zeros(self.count * self.n, dtype=torch.float32, device=data.device)
        count = torch.zeros_like(total)
        ones = torch.ones_like(values[0]).expand(world, -1)
        if senders is not None:  # (on the device: no host read of who counts)
            ones = senders.to(values.dtype).view(world, 1).expand_as(values)
            values = values * ones
        for r in range(world):  # the sum in rank order
            total.index_put_((local[r],), values[r], accumulate=True)
            count.index_put_((local[r],), ones[r], accumulate=True)
        count.clamp_(min=1.0)
        if self.codec.power != 1:
            count.pow_(float(self.codec.power))
        total.div_(count)
        row = 0
        for view, (_, _, length) in zip(self._views(flat), self.chains):
            view.copy_(total[row * self.n : (row + length) * self.n].view(length, self.n))
            row += length
