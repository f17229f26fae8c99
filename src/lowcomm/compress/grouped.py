"""A bucket's payload encoded and decoded as a whole: the tensors of a bucket that share one
nearest-rounding :class:`~lowcomm.compress.formats.Quantize` codec go through it as one padded
block matrix, a fixed number of tensor operations for the bucket instead of a dozen per tensor
(per-tensor work dominates a sync's CPU time on models of many small tensors: an int2 mean of
the default 52-tensor model, encoded with error feedback and two ranks' payloads decoded, takes
about 3× longer tensor by tensor on one CPU thread; ``benchmarks/codec_cpu.py``).

The bytes and values are those of encoding each tensor on its own, bit for bit: blocks never
cross tensors (each tensor's last block is padded with zeros, which change no absmax, and the
padding's codes are zeroed before packing, as :func:`~lowcomm.compress.formats.pack_bits` pads),
a bucket's payload is still every tensor's own payload in order (the wire format of
:mod:`lowcomm.compress.formats`), and the ranks' decoded payloads are summed in rank order and
divided by N as :mod:`lowcomm.compress.collectives` specifies. Packing and unpacking reinterpret
8/b codes as one little-endian word (b the bits), the byte order the wire format is written in.

Tensors whose codec is another one (raw fp32 for tensors too small to gain, top-k, sign, a
stochastic-rounding quantiser, whose noise is drawn tensor by tensor) are encoded on their own,
in bucket order, as before.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowcomm.compress.formats import ElementwiseCodec, Quantize

__all__ = ["GroupLayout", "batchable"]

_WORD = {4: torch.int16, 2: torch.int32}
"""The integer type holding the 8/b codes of one packed byte, one code per byte of it."""


def batchable(codec: ElementwiseCodec) -> bool:
    """Whether tensors with ``codec`` are encoded together with the others of their bucket that
    share it: a nearest-rounding quantiser whose blocks hold whole packed bytes."""
    return (
        isinstance(codec, Quantize)
        and not codec.stochastic
        and codec.block % (8 // codec.bits) == 0
        and sys.byteorder == "little"
    )


@dataclass
class _Batch:
    """The tensors of a bucket that share one batchable codec: where each one's blocks sit in
    the padded block matrix, and where its scales and codes sit in the bucket's payload."""

    codec: Quantize
    positions: list[int]  # in the bucket
    numels: list[int]
    offsets: list[int]  # of each tensor's first element in the padded flat matrix
    blocks: int  # rows of the padded matrix
    pads: list[int]  # zeros after each tensor to fill its last block
    pad_index: torch.Tensor | None  # padding positions in the flat matrix
    scale_spans: list[tuple[int, int]]  # each tensor's scale bytes in the payload
    code_spans: list[tuple[int, int, int]]  # its packed codes, and the bytes padding its blocks

    @property
    def packed_per_block(self) -> int:
        return self.codec.block * self.codec.bits // 8


class GroupLayout:
    """How one bucket's tensors (``codecs[j]`` for the tensor of ``shapes[j]``) lie in its
    payload, with what :meth:`encode` and :meth:`decode_mean` need to do each batch of tensors
    that share a batchable codec at once.

    Example::

        layout = GroupLayout(codecs, shapes, device)
        payload, contributions, errors = layout.encode(tensors, generator=None, residuals=True)
        means = layout.decode_mean(gathered, world_size)   # gathered: N payloads, rank order
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
        sizes = [c.wire_nbytes(s) for c, s in zip(self.codecs, self.shapes)]
        self.spans: list[tuple[int, int]] = []
        off = 0
        for size in sizes:
            self.spans.append((off, off + size))
            off += size
        self.size = off
        """Bytes of one rank's payload for the bucket."""
        by_codec: dict[Quantize, list[int]] = {}
        for j, (codec, shape) in enumerate(zip(self.codecs, self.shapes)):
            if batchable(codec) and codec.compresses(shape):
                assert isinstance(codec, Quantize)
                by_codec.setdefault(codec, []).append(j)
        self.batches = [self._batch(codec, js) for codec, js in by_codec.items()]
        batched = {j for b in self.batches for j in b.positions}
        self.singles = [j for j in range(len(self.codecs)) if j not in batched]
        """Tensors encoded on their own, in bucket order."""
        self._recipe = self._assembly()

    def _batch(self, codec: Quantize, positions: list[int]) -> _Batch:
        block, per = codec.block, 8 // codec.bits
        numels = [math.prod(self.shapes[j]) for j in positions]
        offsets, pads, pad_at = [], [], []
        scale_spans, code_spans = [], []
        row = 0
        for j, n in zip(positions, numels):
            start, nb, real = self.spans[j][0], -(-n // block), -(-n // per)
            offsets.append(row * block)
            pads.append(nb * block - n)
            pad_at.append(torch.arange(row * block + n, (row + nb) * block))
            scale_spans.append((start, start + 4 * nb))
            code_spans.append((start + 4 * nb, start + 4 * nb + real, nb * block // per - real))
            row += nb
        pad_index = torch.cat(pad_at)
        return _Batch(
            codec=codec,
            positions=positions,
            numels=numels,
            offsets=offsets,
            blocks=row,
            pads=pads,
            pad_index=pad_index.to(self.device) if pad_index.numel() else None,
            scale_spans=scale_spans,
            code_spans=code_spans,
        )

    def _assembly(self) -> list[tuple[int, int, int]]:
        """The payload as slices ``(source, start, end)`` of the encoding's pieces: every
        batch's scale bytes and packed codes, then each single's payload."""
        by_start: list[tuple[int, int, int, int]] = []  # (payload start, source, start, end)
        source = 0
        for b in self.batches:
            block, per = b.codec.block, 8 // b.codec.bits
            for (a, e), (c, d, _), off in zip(b.scale_spans, b.code_spans, b.offsets):
                row = off // block
                by_start.append((a, source, 4 * row, 4 * row + e - a))
                by_start.append((c, source + 1, off // per, off // per + d - c))
            source += 2
        for j in self.singles:
            a, e = self.spans[j]
            by_start.append((a, source, 0, e - a))
            source += 1
        return [(src, a, e) for _, src, a, e in sorted(by_start)]

    # -- encoding ----------------------------------------------------------------------------

    def encode(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        generator: torch.Generator | None,
        residuals: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor] | None]:
        """The bucket's payload for ``tensors`` (fp32, the layout's shapes), each tensor's
        decoded contribution C(x) (what every rank decodes from this payload), and with
        ``residuals`` x − C(x) with non-finite values as 0 (the error feedback's next
        residual). ``generator`` draws the stochastic singles' noise, in bucket order."""
        count = len(self.codecs)
        contributions: list[torch.Tensor | None] = [None] * count
        errors: list[torch.Tensor | None] = [None] * count
        pieces: list[torch.Tensor] = []
        for b in self.batches:
            scale, packed = self._encode_batch(b, tensors, contributions, errors, residuals)
            pieces += [scale.view(torch.uint8), packed]
        for j in self.singles:
            codec = self.codecs[j]
            x = tensors[j]
            payload = codec.encode(x, generator=generator if codec.stochastic else None)
            # a codec that cannot gain on a tensor is replaced by raw fp32 before it gets here
            assert payload.numel() == self.spans[j][1] - self.spans[j][0], (codec, x.shape)
            c = codec.decode(payload, self.shapes[j])
            contributions[j] = c
            if residuals:
                errors[j] = torch.nan_to_num_(x.reshape(c.shape) - c, 0.0, 0.0, 0.0)
            pieces.append(payload)
        payload = torch.cat([pieces[src][a:e] for src, a, e in self._recipe])
        assert all(c is not None for c in contributions)
        out_errors = [e for e in errors if e is not None] if residuals else None
        return payload, contributions, out_errors  # type: ignore[return-value]

    def _encode_batch(
        self,
        b: _Batch,
        tensors: Sequence[torch.Tensor],
        contributions: list[torch.Tensor | None],
        errors: list[torch.Tensor | None],
        residuals: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        codec = b.codec
        qmax = codec.qmax
        parts: list[torch.Tensor] = []
        zeros = None
        for j, pad in zip(b.positions, b.pads):
            parts.append(tensors[j].reshape(-1))
            if pad:
                if zeros is None:
                    zeros = torch.zeros(max(b.pads), device=self.device)
                parts.append(zeros[:pad])
        blocks = torch.cat(parts).view(b.blocks, codec.block)
        # max |x| without materialising |x|; + 0.0 turns an all-(−0.0) block's −0.0 into 0.0
        scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).add_(0.0)
        scale.div_(qmax)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = (blocks / safe.unsqueeze(1)).round_().clamp_(-qmax, qmax)
        codes = y.add_(qmax).to(torch.uint8)
        # decoded from the codes, as decode computes it (a non-finite block's codes are whatever
        # the conversion made of NaN: the same bits as decoding the payload), in y's memory
        decoded = y.copy_(codes).sub_(qmax).mul_(scale.unsqueeze(1))
        codes = codes.view(-1)
        if b.pad_index is not None:
            codes.index_fill_(0, b.pad_index, 0)
        packed = _pack(codes, codec.bits)
        flat = decoded.view(-1)
        error = None
        if residuals:  # x − C(x), in the input's memory (no longer needed)
            error = torch.nan_to_num_(blocks.view(-1).sub_(flat), 0.0, 0.0, 0.0)
        for j, off, n in zip(b.positions, b.offsets, b.numels):
            contributions[j] = flat[off : off + n].view(self.shapes[j])
            if error is not None:
                errors[j] = error[off : off + n].view(self.shapes[j])
        return scale, packed

    # -- decoding ----------------------------------------------------------------------------

    def decode_mean(self, gathered: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """The mean over ranks of each tensor, from ``gathered`` (the ranks' payloads in rank
        order, ``world_size × size`` bytes): every payload decoded, summed in rank order in
        fp32 and divided by N."""
        n = world_size
        rows = gathered.view(n, self.size)
        out: list[torch.Tensor | None] = [None] * len(self.codecs)
        for b in self.batches:
            codec = b.codec
            scale = torch.cat([rows[:, a:e] for a, e in b.scale_spans], dim=1)
            scale = scale.view(torch.float32)  # (N, blocks)
            packed: list[torch.Tensor] = []
            padding = None
            for a, e, pad in b.code_spans:
                packed.append(rows[:, a:e])
                if pad:  # decoded, then dropped
                    if padding is None:
                        padding = rows.new_zeros(n, max(p for _, _, p in b.code_spans))
                    packed.append(padding[:, :pad])
            codes = _unpack(torch.cat(packed, dim=1), codec.bits)
            values = codes.float().sub_(codec.qmax).view(n, b.blocks, codec.block)
            values.mul_(scale.unsqueeze(2))
            total = values[0].view(-1)
            for r in range(1, n):
                total.add_(values[r].view(-1))
            if n > 1:
                total.div_(float(n))
            for j, off, numel in zip(b.positions, b.offsets, b.numels):
                out[j] = total[off : off + numel].view(self.shapes[j])
        for j in self.singles:
            single, (a, e), shape = self.codecs[j], self.spans[j], self.shapes[j]
            total = single.decode(rows[0, a:e], shape)
            for r in range(1, n):
                total.add_(single.decode(rows[r, a:e], shape))
            if n > 1:
                total.div_(float(n))
            out[j] = total
        return out  # type: ignore[return-value]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`~lowcomm.compress.formats.pack_bits` of codes that fill whole bytes: the 8/b codes
    of a byte, one per byte of a little-endian word, shifted together."""
    if bits == 8:
        return codes
    word = codes.view(_WORD[bits])
    out = word.clone()
    for k in range(1, 8 // bits):
        out.bitwise_or_(word >> (k * (8 - bits)))
    return out.bitwise_and_(0xFF).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of ``packed`` (…, m bytes) as (…, m·8/b) uint8: each byte spread over a
    little-endian word, one code per byte."""
    if bits == 8:
        return packed
    word = packed.to(_WORD[bits])
    out = word.clone()
    for k in range(1, 8 // bits):
        out.bitwise_or_(word << (k * (8 - bits)))
    mask = int.from_bytes(bytes([(1 << bits) - 1] * (8 // bits)), "little")
    return out.bitwise_and_(mask).view(torch.uint8)
