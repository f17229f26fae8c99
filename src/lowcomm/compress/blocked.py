"""The quantisers' and the sign codec's sections of a bucket's flat payload
(:mod:`lowcomm.compress.flat`): blocks of values with one fp32 scale each, and codes of b bits
packed 8/b to a byte. Where a section is one run of the bucket and no tensor pads, the blocks
are the bucket itself, encoded, fed back and decoded a chunk of rows at a time (on the CPU,
:data:`CPU_CHUNK` elements: the codec's passes then run in the cache). Packing reinterprets the
8/b codes of a byte as one little-endian word, the byte order the wire format is written in."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from lowcomm.compress import formats
from lowcomm.compress.formats import Quantize, Sign, divisor
from lowcomm.compress.sections import Section, as_type, left_over_

assert sys.byteorder == "little", "lowcomm's packed codes are read as little-endian words"

_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}
"""The integer type holding the 8/b codes of one packed byte, one code per byte of it."""


_NP_WORD = {1: np.uint64, 2: np.uint32, 4: np.uint16}
_GATHER = {1: 0x0102040810204080, 2: 0x01041040, 4: 0x0110}
"""Multiplying an unsigned word of 8/b codes (one a byte) by this puts code i at bit
8(w − 1) + b·i (w the word's bytes) and every other product below or above those bits, with no
carry between them: the word's top byte is then the codes packed."""


def _spread(bits: int) -> Any:
    """The codes of each byte value as one word of 8/bits bytes, one code a byte: a NumPy table
    of 256 words."""
    values = np.arange(256, dtype=np.uint8)[:, None]
    shifts = (bits * np.arange(8 // bits, dtype=np.uint8))[None, :]
    codes = (values >> shifts) & np.uint8((1 << bits) - 1)
    return np.ascontiguousarray(codes).view(_NP_WORD[bits]).reshape(-1)


_SPREAD = {b: _spread(b) for b in (1, 2)}


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each < 2^bits, a multiple of 8/bits of them) packed 8/bits to a byte as
    :func:`~lowcomm.compress.formats.pack_bits` packs them: the 8/bits codes of a byte, one per
    byte of a little-endian word, gathered into its top byte by one multiplication on the CPU
    (NumPy's unsigned words wrap; :data:`~lowcomm.compress.formats.NUMPY_ON_CPU`), shifted
    together elsewhere (a few operations on words, not one per field)."""
    if bits == 8:
        return codes
    if codes.device.type == "cpu" and formats.NUMPY_ON_CPU and codes.is_contiguous():
        kind = _NP_WORD[bits]
        words = codes.numpy().view(kind)
        top = 8 * (np.dtype(kind).itemsize - 1)
        return torch.from_numpy(((words * kind(_GATHER[bits])) >> kind(top)).astype(np.uint8))
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
    if bits < 4 and packed.device.type == "cpu" and formats.NUMPY_ON_CPU:  # a lookup a byte
        # (4-bit codes: torch's one shift of the words is faster than a lookup a byte)
        words = np.take(_SPREAD[bits], packed.numpy())
        return torch.from_numpy(words.view(np.uint8))
    word = packed.to(_WORD[bits])
    out = word.clone()
    for k in range(1, 8 // bits):
        out.bitwise_or_(word << (k * (8 - bits)))
    mask = int.from_bytes(bytes([(1 << bits) - 1] * (8 // bits)), "little")
    if bits == 1:  # (0x0101…01 as a signed 64-bit word)
        mask = mask - (1 << 64) if mask >= 1 << 63 else mask
    return out.bitwise_and_(mask).view(torch.uint8).reshape(*packed.shape[:-1], -1)


class BlockedSection(Section):
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
        self._work: torch.Tensor | None = None
        self._chunks: tuple[tuple[str, int, int], list[tuple[int, int, int, int, int, int]]] | None
        self._chunks = None

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
        return as_type(data[:, : 4 * self.rows], torch.float32)

    # -- a codec's arithmetic on rows of blocks ----------------------------------------------

    def _encode_rows(
        self, blocks: torch.Tensor, generator: torch.Generator | None, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scales (rows,), codes (rows × block, uint8) and decoded values (rows × block,
        fp32; in ``scratch`` if given) of ``blocks``."""
        raise NotImplementedError

    def _decode_rows(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (rows × block) ← the mean over ranks of ``codes`` (N × rows × block, uint8)
        with ``scales`` (N × rows × 1): decoded in fp32, summed in rank order, divided by N."""
        raise NotImplementedError

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self._blocks(values)
        scale, codes, decoded = self._encode_rows(blocks, generator, self._scratch(blocks, 0))
        out = torch.cat([scale.view(torch.uint8), self._pack(codes)])
        return out, self._real(decoded)

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        out = data.new_empty((self.rows, self.block), dtype=torch.float32)
        self._decode_rows(self._codes(data), self._scales(data).unsqueeze(2), out)
        return self._real(out)

    # -- a bucket's run of blocks, chunk by chunk --------------------------------------------

    def _scratch(self, like: torch.Tensor, rows: int) -> torch.Tensor | None:
        """A working block matrix of ``rows`` rows (0: ``like``'s), kept from launch to launch
        on the CPU, where a fresh bucket-sized tensor costs more than the arithmetic on it
        (the memory is new to the process each time); on a GPU the caching allocator already
        reuses it (``None``: allocated)."""
        if like.device.type != "cpu":
            return None
        shape = (rows or like.shape[0], self.block)
        if self._work is None or tuple(self._work.shape) != shape:
            self._work = torch.empty(shape, dtype=torch.float32)
        return self._work

    def _chunk_rows(self, device: torch.device) -> int:
        """Rows encoded or decoded at once along a run of the bucket: on the CPU about
        :data:`CPU_CHUNK` elements (a whole number of packed bytes), so that the codec's
        passes over them run in the cache instead of memory; on a GPU all of them."""
        if device.type != "cpu":
            return self.rows
        per = 8 // self.bits
        rows = max(per, CPU_CHUNK // self.block // per * per)
        return min(rows, self.rows)

    def _runs(self, device: torch.device) -> list[tuple[int, int, int, int, int, int]]:
        """The chunks of a run: rows ``r0:r1``, their elements ``a:b`` in the bucket, their
        packed codes' bytes ``c:d`` in the section's bytes."""
        step = self._chunk_rows(device)
        key = (device.type, step, CPU_CHUNK)
        if self._chunks is None or self._chunks[0] != key:
            start, per = (self.span or (0, 0))[0], 8 // self.bits
            runs = []
            for r0 in range(0, self.rows, step):
                r1 = min(self.rows, r0 + step)
                c = 4 * self.rows + r0 * self.block // per
                a, b = start + r0 * self.block, start + r1 * self.block
                runs.append((r0, r1, a, b, c, c + (r1 - r0) * self.block // per))
            self._chunks = (key, runs)
        return self._chunks[1]

    def encode_feedback(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        mine: torch.Tensor | None,
        out: torch.Tensor,
        generator: torch.Generator | None,
    ) -> None:
        if not (self.aligned and self.span):
            super().encode_feedback(x, residual, mine, out, generator)
            return
        runs = self._runs(x.device)
        for r0, r1, a, b, c, d in runs:
            m = x[a:b] if residual is None else residual[a:b].add_(x[a:b])
            blocks = m.view(r1 - r0, self.block)
            # the working rows are this rank's contribution's own memory where it is kept
            # (the decoded values end there: no copy), else a scratch matrix
            scratch = None if mine is None else mine[a:b].view(r1 - r0, self.block)
            if scratch is None:
                scratch = self._scratch(blocks, runs[0][1])
                if scratch is not None:
                    scratch = scratch[: r1 - r0]
            scale, codes, decoded = self._encode_rows(blocks, generator, scratch)
            out[4 * r0 : 4 * r1].copy_(scale.view(torch.uint8))
            out[c:d].copy_(_pack(codes.view(-1), self.bits))
            decoded = decoded.view(-1)
            if mine is not None and decoded.data_ptr() != mine[a:b].data_ptr():
                mine[a:b].copy_(decoded)
            if residual is not None:
                left_over_(m, decoded)

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        if not (self.aligned and self.span):
            super().decode_into(flat, data, world)
            return
        scales = self._scales(data).unsqueeze(2)
        for r0, r1, a, b, c, d in self._runs(flat.device):
            codes = _unpack(data[:, c:d], self.bits).view(world, r1 - r0, self.block)
            self._decode_rows(codes, scales[:, r0:r1], flat[a:b].view(r1 - r0, self.block))


CPU_CHUNK = 1 << 19
"""Elements of a bucket a quantiser or the sign codec works on at once on the CPU (2 MB of
fp32): its dozen passes over them then stay in the cache (a pass over a 10 M-parameter bucket
in memory costs about four times one in the cache), and the chunk's operations are few enough
that their dispatch does not dominate (at 2^18 elements a 10 M-parameter int8 mean took 15-20%
longer on a 2-core AMD EPYC: 38 chunks of about 25 operations); fixed, so the operations of a
sync still do not grow with the number of tensors."""


class QuantizeSection(BlockedSection):
    def __init__(self, codec: Quantize, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets, block=codec.block, bits=codec.bits)
        self.codec = codec

    def _encode_rows(
        self, blocks: torch.Tensor, generator: torch.Generator | None, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qmax = self.codec.qmax
        # max |x| without materialising |x|; + 0.0 turns an all-(−0.0) block's −0.0 into 0.0
        scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).add_(0.0)
        scale.div_(divisor(qmax, scale.device))  # the CPU's division on a GPU too
        safe = torch.where(scale > 0, scale, 1.0)
        y = torch.div(blocks, safe.unsqueeze(1), out=scratch)
        if self.codec.stochastic:
            device = y.device if generator is None else generator.device
            noise = torch.rand(y.shape, generator=generator, device=device, dtype=y.dtype)
            y = torch.floor_(y.add_(noise.to(y.device)))
        else:
            y = y.round_()
        y.clamp_(-qmax, qmax)  # y is now code − qmax (an integer; NaN where the block is)
        # the codes: y as int8, seen as bytes, + qmax (wrapping: the same byte as y + qmax)
        codes = y.to(torch.int8).view(torch.uint8).add_(qmax)
        return scale, codes, y.mul_(scale.unsqueeze(1))  # (code − qmax)·scale where finite

    def _decode_rows(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        # code − qmax as a byte wraps to the signed value: read as int8; times the fp32 scale
        # (int8 to fp32 is exact: the same bits as converting first), summed in rank order
        signed = codes.sub(self.codec.qmax).view(torch.int8)
        out.copy_(signed[0]).mul_(scales[0])
        for r in range(1, codes.shape[0]):
            out.add_(signed[r].float().mul_(scales[r]))
        if codes.shape[0] > 1:
            out.div_(float(codes.shape[0]))


class SignSection(BlockedSection):
    def __init__(self, codec: Sign, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets, block=codec.block, bits=1)

    def _encode_rows(
        self, blocks: torch.Tensor, generator: torch.Generator | None, scratch: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the mean |x| of a block's real elements (its padding adds zeros)
        counts = self.counts if blocks.shape[0] == self.rows else self.block
        scale = torch.abs(blocks, out=scratch).sum(dim=1).div_(counts)
        bits = blocks >= 0
        decoded = torch.mul(bits, 2.0, out=scratch).sub_(1.0).mul_(scale.unsqueeze(1))
        return scale, bits.view(torch.uint8), decoded

    def _decode_rows(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        # ±1 times the scale, summed in rank order
        out.copy_(codes[0]).mul_(2.0).sub_(1.0).mul_(scales[0])
        for r in range(1, codes.shape[0]):
            out.add_((2.0 * codes[r].float() - 1.0).mul_(scales[r]))
        if codes.shape[0] > 1:
            out.div_(float(codes.shape[0]))
