"""A bucket's compressed payload encoded and decoded as one flat vector (:class:`FlatLayout`):
a fixed number of tensor operations per bucket and codec, none per parameter tensor.

The tensors of a bucket lie one after the other in its flat fp32 buffer. The tensors that share
a codec form a *section* (top-k: a codec and a tensor size), encoded at once from the buffer
through precomputed index tensors: a quantiser's or sign codec's blocks are gathered into one
padded block matrix (blocks never cross tensors; a tensor's last block is padded with zeros,
which change no absmax and no magnitude sum), a top-k section's tensors are the rows of one
matrix; where no tensor needs padding (a model's usual sizes) the blocks are the buffer itself,
with no copy. A bucket's payload is its sections' bytes one after the other, in the order their
first tensor comes in the bucket; a section's bytes are, for a quantiser or sign codec, every
block's fp32 scale, then each tensor's codes packed as
:func:`~lowcomm.compress.formats.pack_bits` packs them (its last byte padded with zero fields);
for top-k, each tensor's int32 indices (ascending), then each tensor's fp32 values; for bf16
and raw fp32, the values. The same bytes as encoding each tensor on its own, in another order:
a bucket of one tensor is that tensor's payload. Decoding takes each section's bytes from
the ranks' payloads, decodes them, sums the ranks' values in rank order in fp32 and divides by
N, as :mod:`lowcomm.compress.collectives` specifies: the means are bit for bit those of
decoding tensor by tensor. Packing reinterprets the 8/b codes of a byte as one little-endian
word (b the bits), the byte order the wire format is written in.

Stochastic rounding draws a section's noise over its whole block matrix at once: with a CPU
generator the same numbers as drawing it tensor by tensor in bucket order (the CPU's generator
fills a tensor element by element), hence the same codes. A codec this module does not know
(one defined outside lowcomm) is encoded tensor by tensor through its own ``encode`` and
``decode``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from lowcomm.compress.formats import BF16, ElementwiseCodec, Quantize, Raw, Sign, TopK, divisor

__all__ = ["FlatLayout"]

assert sys.byteorder == "little", "lowcomm's packed codes are read as little-endian words"


def _ranges(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    parts = [torch.arange(s, s + n) for s, n in zip(starts, lengths) if n]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, bytes) uint8 rows read as (N, values) of ``dtype`` (copied when not contiguous or
    not aligned to the type)."""
    flat = data.reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).view(data.shape[0], -1)


def _sum_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values`` (N, …): summed over the ranks in rank order, divided by N."""
    if world == 1:
        return values[0]
    total = values[0].clone()
    for r in range(1, world):
        total.add_(values[r])
    return total.div_(float(world))


_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}
"""The integer type holding the 8/b codes of one packed byte, one code per byte of it."""


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each < 2^bits, a multiple of 8/bits of them) packed 8/bits to a byte as
    :func:`~lowcomm.compress.formats.pack_bits` packs them: the 8/bits codes of a byte, one per
    byte of a little-endian word, shifted together (a few operations on words, not one per
    field)."""
    if bits == 8:
        return codes
    word = codes.view(_WORD[bits])
    out = word.clone()
    for k in range(1, 8 // bits):
        out.bitwise_or_(word >> (k * (8 - bits)))
    return out.bitwise_and_(0xFF).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of ``packed`` (…, m bytes) as (…, m·8/bits) uint8: each byte spread over a
    little-endian word, one code per byte."""
    if bits == 8:
        return packed
    word = packed.to(_WORD[bits])
    out = word.clone()
    for k in range(1, 8 // bits):
        out.bitwise_or_(word << (k * (8 - bits)))
    mask = int.from_bytes(bytes([(1 << bits) - 1] * (8 // bits)), "little")
    if bits == 1:  # (0x0101…01 as a signed 64-bit word)
        mask = mask - (1 << 64) if mask >= 1 << 63 else mask
    return out.bitwise_and_(mask).view(torch.uint8).reshape(*packed.shape[:-1], -1)


class _Section:
    """Tensors of one bucket that are encoded together."""

    def __init__(self, numels: list[int], offsets: list[int]) -> None:
        self.numel = sum(numels)
        self.span: tuple[int, int] | None = None
        """Where the section lies in the bucket when its elements are one run of it."""
        if all(offsets[i] + numels[i] == offsets[i + 1] for i in range(len(offsets) - 1)):
            self.span = (offsets[0], offsets[0] + self.numel)
        self.elems = _ranges(offsets, numels)
        """The bucket elements of this section, in its order."""
        self.nbytes = 0
        """Bytes of the section's output (:meth:`encode`): its part of the payload."""

    def to(self, device: torch.device) -> None:
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """The section's elements of the bucket ``flat`` (a view when they are one run)."""
        return flat[self.span[0] : self.span[1]] if self.span else flat[self.elems]

    def put(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """The section's elements of ``flat`` ← ``values``."""
        if self.span:
            flat[self.span[0] : self.span[1]].copy_(values)
        else:
            flat.index_copy_(0, self.elems, values)

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes (1-D uint8, :attr:`nbytes`) and this rank's decoded contribution (fp32, in the
        order of :attr:`elems`) of ``values`` (the section's elements, in that order)."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        """The mean over the ranks, in the order of :attr:`elems`, from ``data`` (N × nbytes:
        every rank's section bytes)."""
        raise NotImplementedError

    def encode_into(
        self, flat: torch.Tensor, mine: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        """:meth:`encode` of the section's elements of the bucket ``flat``, its contribution
        into those of ``mine``; returns the bytes."""
        data, contribution = self.encode(self.take(flat), generator)
        self.put(mine, contribution)
        return data

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        """:meth:`decode` into the section's elements of the bucket ``flat``."""
        self.put(flat, self.decode(data, world))


class _Raw(_Section):
    def __init__(self, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.nbytes = 4 * self.numel

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values = values.clone()  # (sent as it is: the payload must not alias the bucket)
        return values.view(torch.uint8), values

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        return _sum_ranks(_as(data, torch.float32), world)


class _BF16(_Section):
    def __init__(self, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.nbytes = 2 * self.numel

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        low = values.to(torch.bfloat16)
        return low.view(torch.uint8), low.float()

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        return _sum_ranks(_as(data, torch.bfloat16).float(), world)


class _Blocked(_Section):
    """Blocks of ``block`` elements, one fp32 scale each, and ``bits``-bit codes packed per
    tensor: ``[scales of every block][each tensor's packed codes]``. Index tensors place the
    values in the block matrix and the codes in the packed bytes; where no tensor needs
    padding (its size a multiple of the block and of 8/bits) they are the identity, and
    nothing is gathered."""

    def __init__(self, numels: list[int], offsets: list[int], *, block: int, bits: int) -> None:
        super().__init__(numels, offsets)
        self.block, self.bits, per = block, bits, 8 // bits
        nbs = [-(-n // block) for n in numels]
        self.rows = sum(nbs)
        self.aligned = all(n % block == 0 and n % per == 0 for n in numels)
        """No tensor needs padding: the block matrix is the values, the codes are packed as
        they lie."""
        size = self.rows * block
        gather = torch.full((size,), self.numel, dtype=torch.long)  # pads: the zero past them
        real, pack, unpack = [], [], torch.zeros(size, dtype=torch.long)
        counts = torch.full((self.rows,), float(block))
        row = elem = packed = 0
        for n, nb in zip(numels, nbs):
            first = row * block
            gather[first : first + n] = torch.arange(elem, elem + n)
            real.append(torch.arange(first, first + n))
            fields = -(-n // per) * per
            pack.append(torch.arange(first, first + n))
            pack.append(torch.full((fields - n,), size, dtype=torch.long))  # a zero code
            unpack[first : first + n] = torch.arange(packed * per, packed * per + n)
            counts[row + nb - 1] = float(n - (nb - 1) * block)
            row, elem, packed = row + nb, elem + n, packed + fields // per
        self.gather = gather
        self.real = torch.cat(real) if real else torch.zeros(0, dtype=torch.long)
        self.pack = torch.cat(pack) if pack else torch.zeros(0, dtype=torch.long)
        self.unpack = unpack
        self.counts = counts
        self.nbytes = 4 * self.rows + packed

    def _blocks(self, values: torch.Tensor) -> torch.Tensor:
        if self.aligned:
            return values.view(self.rows, self.block)
        padded = torch.cat([values, values.new_zeros(1)])
        return padded[self.gather].view(self.rows, self.block)

    def _real(self, blocks: torch.Tensor) -> torch.Tensor:
        """The section's elements of a block matrix, in order."""
        return blocks.view(-1) if self.aligned else blocks.view(-1)[self.real]

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Each tensor's codes (``codes``: the block matrix's, uint8) packed 8/bits to a byte,
        its last byte padded with zero fields."""
        if self.aligned:
            ordered = codes.reshape(-1)
        else:
            ordered = torch.cat([codes.reshape(-1), codes.new_zeros(1)])[self.pack]
        return _pack(ordered, self.bits)

    def _codes(self, data: torch.Tensor) -> torch.Tensor:
        """(N, rows, block) codes (uint8) from the ranks' section bytes (padding: any)."""
        world = data.shape[0]
        wire = _unpack(data[:, 4 * self.rows :], self.bits)
        if not self.aligned:
            wire = wire[:, self.unpack]
        return wire.reshape(world, self.rows, self.block)

    def _scales(self, data: torch.Tensor) -> torch.Tensor:
        return _as(data[:, : 4 * self.rows], torch.float32)


class _Quantize(_Blocked):
    def __init__(self, codec: Quantize, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets, block=codec.block, bits=codec.bits)
        self.codec = codec
        self._y: torch.Tensor | None = None

    def _scratch(self, like: torch.Tensor) -> torch.Tensor | None:
        """The block matrix's working copy: kept from launch to launch on the CPU, where a
        fresh bucket-sized tensor costs more than the arithmetic on it (the memory is new to
        the process each time); on a GPU the caching allocator already reuses it (``None``:
        allocated)."""
        if like.device.type != "cpu":
            return None
        if self._y is None or self._y.shape != like.shape:
            self._y = torch.empty_like(like)
        return self._y

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qmax = self.codec.qmax
        blocks = self._blocks(values)
        # max |x| without materialising |x|; + 0.0 turns an all-(−0.0) block's −0.0 into 0.0
        scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).add_(0.0)
        scale.div_(divisor(qmax, scale.device))  # the CPU's division on a GPU too
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = torch.div(blocks, safe.unsqueeze(1), out=self._scratch(blocks))
        if self.codec.stochastic:
            device = y.device if generator is None else generator.device
            noise = torch.rand(y.shape, generator=generator, device=device, dtype=y.dtype)
            y = torch.floor_(y.add_(noise.to(y.device)))
        else:
            y = y.round_()
        y.clamp_(-qmax, qmax)  # y is now code − qmax (an integer; NaN where the block is)
        # the codes: y as int8, seen as bytes, + qmax (wrapping: the same byte as y + qmax)
        codes = y.to(torch.int8).view(torch.uint8).add_(qmax)
        decoded = y.mul_(scale.unsqueeze(1))  # (code − qmax)·scale where finite
        out = torch.cat([scale.view(torch.uint8), self._pack(codes)])
        return out, self._real(decoded)

    def _signed(self, data: torch.Tensor) -> torch.Tensor:
        # code − qmax as a byte wraps to the signed value: read as int8
        return self._codes(data).sub(self.codec.qmax).view(torch.int8)

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        values = self._signed(data).float().mul_(self._scales(data).unsqueeze(2))
        return self._real(_sum_ranks(values, world))

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        if not (self.aligned and self.span):
            super().decode_into(flat, data, world)
            return
        # straight into the bucket: (code − qmax)·scale per rank (int8 times fp32 is computed
        # in fp32: the same bits as converting first), summed in rank order, divided by N
        out = flat[self.span[0] : self.span[1]].view(self.rows, self.block)
        signed, scales = self._signed(data), self._scales(data).unsqueeze(2)
        out.copy_(signed[0]).mul_(scales[0])  # (int8 to fp32: exact)
        for r in range(1, world):
            out.add_(signed[r].float().mul_(scales[r]))
        if world > 1:
            out.div_(float(world))


class _Sign(_Blocked):
    def __init__(self, codec: Sign, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets, block=codec.block, bits=1)

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._blocks(values.abs()).sum(dim=1) / self.counts
        bits = self._blocks((values >= 0).to(torch.float32)).to(torch.uint8)
        decoded = (2.0 * bits.float() - 1.0).mul_(scale.unsqueeze(1))
        out = torch.cat([scale.view(torch.uint8), self._pack(bits)])
        return out, self._real(decoded)

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        signs = 2.0 * self._codes(data).float() - 1.0
        signs.mul_(self._scales(data).unsqueeze(2))
        return self._real(_sum_ranks(signs, world))


def _chains(offsets: list[int]) -> list[tuple[int, int, int]]:
    """``offsets`` (ascending) cut into arithmetic progressions ``(first, stride, length)``:
    tensors of one size that a model repeats layer after layer lie a layer apart, so a few
    progressions (one per role in a layer, whatever the depth) cover them, each a strided view
    of the bucket. Greedy: from the first offset left, the stride whose progression runs
    longest (among the next 64 offsets)."""
    left = sorted(offsets)
    free = set(left)
    out: list[tuple[int, int, int]] = []
    while left:
        first = left[0]
        best, best_len = 1, 1
        for nxt in left[1:65]:
            stride, length = nxt - first, 1
            while first + length * stride in free:
                length += 1
            if length > best_len:
                best, best_len = stride, length
        chain = [first + i * best for i in range(best_len)]
        out.append((first, best, best_len))
        free.difference_update(chain)
        left = [o for o in left if o in free]
    return out


class _TopK(_Section):
    """Tensors of one size n, as the rows of strided views of the bucket (:func:`_chains`: no
    copy), k = k(n) kept per row; the bytes: every row's k int32 indices (ascending), then
    every row's k fp32 values, rows in the order of the views."""

    def __init__(self, codec: TopK, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.n = numels[0]
        self.count = len(numels)
        self.k = codec.k(self.n)
        self.nbytes = 8 * self.count * self.k
        self.chains = _chains(offsets)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        base = flat.storage_offset()
        return [
            flat.as_strided((length, self.n), (stride, 1), base + first)
            for first, stride, length in self.chains
        ]

    def encode_into(
        self, flat: torch.Tensor, mine: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        indices, kept = [], []
        for rows, own in zip(self._views(flat), self._views(mine)):
            idx = torch.topk(rows.abs(), self.k, dim=1, sorted=False).indices.sort(dim=1).values
            values = rows.gather(1, idx)
            own.zero_().scatter_(1, idx, values)
            indices.append(idx.to(torch.int32).view(-1))
            kept.append(values.view(-1))
        return torch.cat([torch.cat(indices).view(torch.uint8), torch.cat(kept).view(torch.uint8)])

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        half = self.count * 4 * self.k
        idx = _as(data[:, :half], torch.int32).view(world, self.count, self.k)
        kept = _as(data[:, half:], torch.float32).view(world, self.count, self.k)
        row = 0
        for out, (_, _, length) in zip(self._views(flat), self.chains):
            rows = slice(row, row + length)
            # rank 0's values, then each other rank's added where it sent any (the sum in rank
            # order; an element no rank sent stays 0), divided by N
            out.zero_().scatter_(1, idx[0, rows].long(), kept[0, rows])
            for r in range(1, world):
                out.scatter_add_(1, idx[r, rows].long(), kept[r, rows])
            if world > 1:
                out.div_(float(world))
            row += length


class _Single(_Section):
    """One tensor through its codec's own ``encode`` and ``decode`` (a codec defined outside
    lowcomm)."""

    def __init__(self, codec: ElementwiseCodec, shape: torch.Size, numel: int, offset: int) -> None:
        super().__init__([numel], [offset])
        self.codec, self.shape = codec, shape
        self.nbytes = codec.wire_nbytes(shape)

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gen = generator if self.codec.stochastic else None
        payload = self.codec.encode(values.reshape(self.shape), generator=gen)
        return payload, self.codec.decode(payload, self.shape).reshape(-1)

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        each = [self.codec.decode(data[r], self.shape).reshape(-1) for r in range(world)]
        return _sum_ranks(torch.stack(each), world)


class FlatLayout:
    """How one bucket's tensors (``codecs[j]`` for the tensor of ``shapes[j]``, one after the
    other in the bucket's flat buffer) are encoded, and lie in its payload (see the module
    docstring).

    Example::

        layout = FlatLayout(codecs, shapes, device)
        payload, contribution = layout.encode(flat, generator=None)   # flat: the bucket, fp32
        layout.decode_mean(gathered, world_size, out=flat)             # N payloads, rank order
    """

    def __init__(
        self,
        codecs: Sequence[ElementwiseCodec],
        shapes: Sequence[torch.Size | tuple[int, ...]],
        device: torch.device | str,
    ) -> None:
        self.codecs = list(codecs)
        self.shapes = [torch.Size(s) for s in shapes]
        self.device = torch.device(device)
        numels = [math.prod(s) for s in self.shapes]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        self.numel = sum(numels)
        groups: dict[object, list[int]] = {}
        for j, codec in enumerate(self.codecs):
            if numels[j] == 0:
                continue
            key: object = (codec, numels[j]) if isinstance(codec, TopK) else codec
            if not isinstance(codec, (Raw, BF16, Quantize, Sign, TopK)):
                key = ("single", j)
            groups.setdefault(key, []).append(j)
        self.sections: list[_Section] = []
        for js in groups.values():
            codec = self.codecs[js[0]]
            sizes, starts = [numels[j] for j in js], [offsets[j] for j in js]
            section: _Section
            if isinstance(codec, Raw):
                section = _Raw(sizes, starts)
            elif isinstance(codec, BF16):
                section = _BF16(sizes, starts)
            elif isinstance(codec, Quantize):
                section = _Quantize(codec, sizes, starts)
            elif isinstance(codec, Sign):
                section = _Sign(codec, sizes, starts)
            elif isinstance(codec, TopK):
                section = _TopK(codec, sizes, starts)
            else:
                section = _Single(codec, self.shapes[js[0]], sizes[0], starts[0])
            section.to(self.device)
            self.sections.append(section)
        self.section_spans: list[tuple[int, int]] = []
        """Each section's bytes in the payload."""
        at = 0
        for section in self.sections:
            self.section_spans.append((at, at + section.nbytes))
            at += section.nbytes
        self.size = at
        """Bytes of one rank's payload for the bucket."""
        wire = sum(c.wire_nbytes(s) for c, s in zip(self.codecs, self.shapes))
        assert self.size == wire, (self.size, wire)
        self._whole = (
            len(self.sections) == 1
            and self.sections[0].span == (0, self.numel)
            and not isinstance(self.sections[0], _TopK)
        )

    def encode(
        self, flat: torch.Tensor, *, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's payload for ``flat`` (its fp32 values, :attr:`numel`), and this rank's
        decoded contribution C(x) in the bucket's layout (what every rank decodes from it)."""
        if self._whole:  # one section, the whole bucket: its contribution as it comes
            data, mine = self.sections[0].encode(flat, generator)
            return data.reshape(-1), mine
        mine = torch.empty_like(flat)
        outputs = [s.encode_into(flat, mine, generator).reshape(-1) for s in self.sections]
        payload = torch.cat(outputs) if outputs else flat.new_zeros(0, dtype=torch.uint8)
        return payload, mine

    def decode_mean(self, gathered: torch.Tensor, world_size: int, *, out: torch.Tensor) -> None:
        """The mean over ranks of every element into ``out`` (the bucket, fp32), from
        ``gathered`` (the ranks' payloads in rank order, ``world_size × size`` bytes): every
        payload decoded, summed in rank order in fp32 and divided by N."""
        rows = gathered.view(world_size, self.size)
        for section, (a, b) in zip(self.sections, self.section_spans):
            section.decode_into(out, rows[:, a:b], world_size)
