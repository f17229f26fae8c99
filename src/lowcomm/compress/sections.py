"""The sections of a bucket's flat payload (:mod:`lowcomm.compress.flat`): tensors encoded
together, their bytes one part of the bucket's payload. Here the base class, raw fp32, bf16,
top-k (tensors of one size as strided views of the bucket) and a codec defined outside lowcomm;
the quantisers and the sign codec, blocks of values with one scale each, are in
:mod:`lowcomm.compress.blocked`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowcomm.compress.formats import ElementwiseCodec, TopK, largest


def _ranges(starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    parts = [torch.arange(s, s + n) for s, n in zip(starts, lengths) if n]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def as_type(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, bytes) uint8 rows read as (N, values) of ``dtype`` (copied when not contiguous or
    not aligned to the type)."""
    flat = data.reshape(-1)
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype).view(data.shape[0], -1)


def sum_ranks(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values`` (N, …): summed over the ranks in rank order, divided by N."""
    if world == 1:
        return values[0]
    total = values[0].clone()
    for r in range(1, world):
        total.add_(values[r])
    return total.div_(float(world))


def left_over_(m: torch.Tensor, contribution: torch.Tensor) -> torch.Tensor:
    """Error feedback in ``m``'s memory: e ← M − C(M), a NaN or Inf (a diverged rank: the
    average that carries it is skipped) not carried over but 0."""
    torch.sub(m, contribution, out=m)
    return torch.nan_to_num_(m, nan=0.0, posinf=0.0, neginf=0.0)


class Section:
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

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        """:meth:`decode` into the section's elements of the bucket ``flat``."""
        self.put(flat, self.decode(data, world))

    def encode_feedback(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        mine: torch.Tensor | None,
        out: torch.Tensor,
        generator: torch.Generator | None,
    ) -> None:
        """The section's part of :meth:`FlatLayout.encode_feedback` (buckets ``x``,
        ``residual``, ``mine``; its bytes into ``out``)."""
        # M = x + e, in e's memory where the section is one run of the bucket
        m = self.take(x) if residual is None else self.take(residual).add_(self.take(x))
        data, contribution = self.encode(m, generator)
        out.copy_(data.reshape(-1))
        if mine is not None:
            self.put(mine, contribution)
        if residual is not None:
            left_over_(m, contribution)
            if self.span is None:
                self.put(residual, m)


class RawSection(Section):
    def __init__(self, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.nbytes = 4 * self.numel

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values = values.clone()  # (sent as it is: the payload must not alias the bucket)
        return values.view(torch.uint8), values

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        return sum_ranks(as_type(data, torch.float32), world)


class BF16Section(Section):
    def __init__(self, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.nbytes = 2 * self.numel

    def encode(
        self, values: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        low = values.to(torch.bfloat16)
        return low.view(torch.uint8), low.float()

    def decode(self, data: torch.Tensor, world: int) -> torch.Tensor:
        return sum_ranks(as_type(data, torch.bfloat16).float(), world)


def strided_chains(offsets: list[int]) -> list[tuple[int, int, int]]:
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


class TopKSection(Section):
    """Tensors of one size n, as the rows of strided views of the bucket
    (:func:`strided_chains`: no copy), k = k(n) kept per row; the bytes: every row's k int32
    indices (ascending), then every row's k fp32 values, rows in the order of the views."""

    def __init__(self, codec: TopK, numels: list[int], offsets: list[int]) -> None:
        super().__init__(numels, offsets)
        self.n = numels[0]
        self.count = len(numels)
        self.k = codec.k(self.n)
        self.nbytes = 8 * self.count * self.k
        self.chains = strided_chains(offsets)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        base = flat.storage_offset()
        return [
            flat.as_strided((length, self.n), (stride, 1), base + first)
            for first, stride, length in self.chains
        ]

    def _select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k largest magnitudes: their indices (ascending) and values."""
        idx = largest(rows, self.k)
        return idx, rows.gather(1, idx)

    def _bytes(self, indices: list[torch.Tensor], kept: list[torch.Tensor]) -> torch.Tensor:
        wire = [i.to(torch.int32).view(-1).view(torch.uint8) for i in indices]
        return torch.cat(wire + [v.reshape(-1).view(torch.uint8) for v in kept])

    def encode_feedback(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        mine: torch.Tensor | None,
        out: torch.Tensor,
        generator: torch.Generator | None,
    ) -> None:
        indices, kept = [], []
        ms = self._views(x) if residual is None else self._views(residual)
        owns = self._views(mine) if mine is not None else [None] * len(ms)
        for m, xs, own in zip(ms, self._views(x), owns):
            if residual is not None:
                m.add_(xs)  # M = x + e, in e's memory
            idx, values = self._select(m)
            if own is not None:
                own.zero_().scatter_(1, idx, values)
            if residual is not None:  # M − C(M): M where nothing was kept, 0 where it was
                torch.nan_to_num_(m.scatter_(1, idx, 0.0), nan=0.0, posinf=0.0, neginf=0.0)
            indices.append(idx)
            kept.append(values)
        out.copy_(self._bytes(indices, kept))

    def decode_into(self, flat: torch.Tensor, data: torch.Tensor, world: int) -> None:
        half = self.count * 4 * self.k
        idx = as_type(data[:, :half], torch.int32).view(world, self.count, self.k)
        kept = as_type(data[:, half:], torch.float32).view(world, self.count, self.k)
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


class SingleSection(Section):
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
        return sum_ranks(torch.stack(each), world)
