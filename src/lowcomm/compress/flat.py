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

:meth:`FlatLayout.encode_feedback` does a compressed sync's encoding with its error feedback
(M = x + e in e's memory, the payload, e ← M − C(M)) section by section, and a quantiser's or
the sign codec's section that is one run of the bucket with no padding chunk by chunk of rows
(:data:`lowcomm.compress.blocked.CPU_CHUNK` elements on the CPU, where its dozen passes then
stay in the cache; the whole run on a GPU); top-k's residual is M with its kept values zeroed,
no subtraction. Stochastic rounding draws a section's noise block row after block row: with a
CPU generator the same numbers as drawing it tensor by tensor in bucket order (the CPU's
generator fills a tensor element by element), hence the same codes. The sections live in
:mod:`lowcomm.compress.sections` and :mod:`lowcomm.compress.blocked`. A codec this module
does not know (one defined outside lowcomm) is encoded tensor by tensor through its own
``encode`` and ``decode``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lowcomm.compress.blocked import QuantizeSection, SignSection
from lowcomm.compress.formats import BF16, ElementwiseCodec, Quantize, Raw, Sign, TopK
from lowcomm.compress.sections import BF16Section, RawSection, Section, SingleSection, TopKSection
from lowcomm.compress.sparse import Sparse, SparseSection

__all__ = ["FlatLayout"]


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
            if isinstance(codec, Sparse):
                key = (codec, self.shapes[j])
            elif not isinstance(codec, (Raw, BF16, Quantize, Sign, TopK)):
                key = ("single", j)
            groups.setdefault(key, []).append(j)
        self.sections: list[Section] = []
        for js in groups.values():
            codec = self.codecs[js[0]]
            sizes, starts = [numels[j] for j in js], [offsets[j] for j in js]
            section: Section
            if isinstance(codec, Raw):
                section = RawSection(sizes, starts)
            elif isinstance(codec, BF16):
                section = BF16Section(sizes, starts)
            elif isinstance(codec, Quantize):
                section = QuantizeSection(codec, sizes, starts)
            elif isinstance(codec, Sign):
                section = SignSection(codec, sizes, starts)
            elif isinstance(codec, TopK):
                section = TopKSection(codec, sizes, starts)
            elif isinstance(codec, Sparse):
                section = SparseSection(codec, self.shapes[js[0]], sizes, starts)
            else:
                section = SingleSection(codec, self.shapes[js[0]], sizes[0], starts[0])
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
            and not isinstance(self.sections[0], (TopKSection, SparseSection))
        )

    def encode(
        self, flat: torch.Tensor, *, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's payload for ``flat`` (its fp32 values, :attr:`numel`), and this rank's
        decoded contribution C(x) in the bucket's layout (what every rank decodes from it). On
        the CPU the contribution may be a view of the layout's working memory, which the next
        encoding of the layout overwrites: clone it to keep it."""
        if self._whole:  # one section, the whole bucket: its contribution as it comes
            data, mine = self.sections[0].encode(flat, generator)
            return data.reshape(-1), mine
        mine = torch.empty_like(flat)
        return self.encode_feedback(flat, residual=None, mine=mine, generator=generator), mine

    def encode_feedback(
        self,
        x: torch.Tensor,
        *,
        residual: torch.Tensor | None,
        mine: torch.Tensor | None = None,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """The bucket's payload for M = ``x`` + ``residual`` (fp32, :attr:`numel` each; M is
        ``x`` when ``residual`` is ``None``), with error feedback: ``residual`` ← M − C(M), a
        NaN or Inf not carried over but 0, and this rank's decoded contribution C(M) into
        ``mine`` if given. The same payload, contribution and residual as :meth:`encode` of M
        and the subtraction after it, computed run by run of the bucket where a section is
        one (on the CPU in cache-sized chunks)."""
        payload = torch.empty(self.size, dtype=torch.uint8, device=x.device)
        for section, (a, b) in zip(self.sections, self.section_spans):
            section.encode_feedback(x, residual, mine, payload[a:b], generator)
        return payload

    def decode_mean(
        self,
        gathered: torch.Tensor,
        world_size: int,
        *,
        out: torch.Tensor,
        senders: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> None:
        """The mean over ranks of every element into ``out`` (the bucket, fp32), from
        ``gathered`` (the ranks' payloads in rank order, ``world_size × size`` bytes): every
        payload decoded, summed in rank order in fp32 and divided by N.

        Over a quorum where some replicas send zeros and do not count (elastic syncs):
        ``senders``, one weight a rank (1 for a replica that contributes, 0 for one that does
        not), and ``scale`` = N / the contributors. The means over N are multiplied by
        ``scale``; a sparse section's mean over the ranks that sent each element
        (:class:`~lowcomm.compress.sparse.SparseSection`) leaves out the ranks of weight 0
        instead, and is not scaled."""
        rows = gathered.view(world_size, self.size)
        over_senders = []
        for section, (a, b) in zip(self.sections, self.section_spans):
            if isinstance(section, SparseSection):
                over_senders.append((section, rows[:, a:b]))
            else:
                section.decode_into(out, rows[:, a:b], world_size)
        if scale != 1.0:
            out.mul_(scale)  # (the sparse sections' elements are written after it)
        for sparse, data in over_senders:
            sparse.decode_into(out, data, world_size, senders=senders)
