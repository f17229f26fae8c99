"""Flat fp32 buckets (:class:`FlatBuckets`): the contiguous buffers every collective of
:mod:`lowcomm.comm` sends, with one view per tensor, and the bytes of the distinct storages
behind a set of tensors (:func:`storage_nbytes`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FlatBuckets", "storage_nbytes"]

DEFAULT_BUCKET_CAP_MB = 25.0


class FlatBuckets:
    """Contiguous fp32 buffers holding a list of tensors, with one view per tensor.

    Tensors are packed in order into buckets of at most ``bucket_cap_mb`` (a tensor larger than
    the cap gets a bucket of its own). ``views[i]`` has the shape of tensor ``i`` and aliases its
    bucket, so ``torch._foreach_*`` over ``views`` and one collective per ``buffers`` entry see
    the same memory.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        pad_to: int = 1,
    ) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb must be > 0, got {bucket_cap_mb}; 25 is a good default"
            )
        self.shapes = [torch.Size(s) for s in shapes]
        self.bucket_cap_mb = bucket_cap_mb
        self.device = torch.device(device)
        self.dtype = dtype
        cap = max(1, int(bucket_cap_mb * 1024 * 1024) // torch.finfo(dtype).bits * 8)
        # layout: list of (bucket index, offset, numel) per tensor
        self.layout: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        for shape in self.shapes:
            n = shape.numel()
            if not sizes or (sizes[-1] > 0 and sizes[-1] + n > cap):
                sizes.append(0)
            self.layout.append((len(sizes) - 1, sizes[-1], n))
            sizes[-1] += n
        self.pad_to = pad_to
        # Each bucket rounded up to a multiple of pad_to (sharded state: N equal chunks); the
        # padding lies after the views and stays 0.
        self.buffers: list[torch.Tensor] = [
            torch.zeros(-(-n // pad_to) * pad_to, device=self.device, dtype=dtype) for n in sizes
        ]
        self.views: list[torch.Tensor] = [
            self.buffers[b].narrow(0, off, n).view(shape)
            for (b, off, n), shape in zip(self.layout, self.shapes)
        ]

    @classmethod
    def for_tensors(
        cls, tensors: Sequence[torch.Tensor], *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    ) -> FlatBuckets:
        device = tensors[0].device if tensors else torch.device("cpu")
        return cls([t.shape for t in tensors], bucket_cap_mb=bucket_cap_mb, device=device)

    def like(self) -> FlatBuckets:
        """New zeroed buckets with the same layout."""
        return FlatBuckets(
            self.shapes,
            bucket_cap_mb=self.bucket_cap_mb,
            device=self.device,
            dtype=self.dtype,
            pad_to=self.pad_to,
        )

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> None:
        """The views ← ``tensors`` (one ``_foreach_copy_``, casting to the buckets' dtype)."""
        assert len(tensors) == len(self.views)
        with torch.no_grad():
            torch._foreach_copy_(self.views, list(tensors))

    def copy_to(self, tensors: Sequence[torch.Tensor]) -> None:
        assert len(tensors) == len(self.views)
        with torch.no_grad():
            torch._foreach_copy_(list(tensors), self.views)

    def groups(self) -> list[list[int]]:
        """Indices of the tensors in each bucket, in order (one collective per group)."""
        out: list[list[int]] = [[] for _ in self.buffers]
        for i, (b, _, _) in enumerate(self.layout):
            out[b].append(i)
        return out


def storage_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
