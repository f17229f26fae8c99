"""ZO2's offloading (Wang et al. 2025) for :class:`~lowcomm.zo.MeZO`'s blockwise steps: the
parameters of the model's blocks live in host memory (pinned when the compute device is a GPU)
and each block is uploaded into a small pool of device buffers just before its stage, so the
device holds a few blocks at a time, not the model.

Per pass over the stages (a step's fused dual forward, :meth:`MeZO.flush`, an evaluation):

* the first ``buffers`` offloaded stages are uploaded before the pass starts, on a copy stream;
* a stage waits for its upload (an event on the compute stream), its parameters are bound to
  their views in the buffer, and MeZO runs the pending update, +εz, the + forward, −2εz, the −
  forward and +εz there, on the compute device (where ZO2 applies its update, and where the
  generator that draws z lives: the same numbers as without offloading);
* the changed parameters are copied back to host memory on a second stream once the stage's
  compute is done (an event), the parameters are bound to their host copies again, and the next
  stage to use that buffer is uploaded once the copy back has left it (an event);
* the pass ends by waiting for the last copies back, so host memory holds the model between
  passes (a checkpoint written then reads finished values).

Events, not synchronisation, order the three streams inside a pass. Stages that share a tensor
with another stage (the embedding that is also the head) stay resident on the device, as ZO2
keeps its embeddings and head there; so does a stage without trainable parameters. On the CPU
(host and compute device the same) the schedule, the buffers and their reuse are the same and
every copy is synchronous: a buffer reused too early or an update in the wrong place changes
bits there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ALIGN", "StageOffloader"]

ALIGN = 512
"""Byte alignment of every tensor in a device buffer (the CUDA caching allocator's)."""


@dataclass
class _Offloaded:
    """One offloaded stage: its tensors, their host copies and their offsets in a buffer."""

    stage: int
    order: int
    """Its place among the offloaded stages (its buffer is ``order % buffers``)."""
    trainable: list[torch.Tensor]
    """MeZO's parameters the stage owns: changed by each pass, copied back after it."""
    fixed: list[torch.Tensor]
    """The stage's frozen parameters and buffers: uploaded, never copied back."""
    host: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    uploaded: Any = None
    copied_back: Any = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.trainable + self.fixed


def _tensors(modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StageOffloader:
    """The stages' placement, the device buffers and the copy schedule of one
    :class:`~lowcomm.zo.MeZO` (``offload=True``); see the module docstring.

    ``record`` (default off): append ``(action, stage, buffer)`` to :attr:`timeline` for every
    upload, compute and copy back, in the order they are issued. :attr:`max_resident` counts,
    always, the most offloaded stages held by buffers at once (uploaded and not yet released).
    """

    def __init__(self, device: torch.device, buffers: int = 2) -> None:
        if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 2:
            raise ValueError(
                f"offload_buffers must be an integer >= 2 (one stage computes while the next "
                f"uploads), got {buffers!r}"
            )
        self.device = device
        self.buffers = buffers
        self.cuda = device.type == "cuda"
        self.stages: list[_Offloaded] = []
        self.resident_stages: list[int] = []
        self._by_stage: dict[int, _Offloaded] = {}
        self._signature: list[tuple[int, ...]] | None = None
        self.pool: torch.Tensor | None = None
        self.slot_bytes = 0
        self.record = False
        self.timeline: list[tuple[str, int, int]] = []
        self.max_resident = 0
        self._held: set[int] = set()
        self._free: list[Any] = [None] * buffers
        self.uploaded_bytes = 0
        self.copied_back_bytes = 0
        if self.cuda:
            self._upload_stream = torch.cuda.Stream(device)
            self._offload_stream = torch.cuda.Stream(device)

    # -- placement ------------------------------------------------------------------------

    @torch.no_grad()
    def place(
        self,
        modules: Sequence[Sequence[nn.Module]],
        owned: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        """On the first pass: decide which stages are offloaded, move the others to the device
        and the offloaded ones to (pinned) host memory, and allocate the buffers. On later
        passes: check the stages are the same modules."""
        signature = [tuple(id(m) for m in ms) for ms in modules]
        if self._signature is not None:
            if signature != self._signature:
                raise ValueError(
                    "MeZO(offload=True) needs the same stages (the same modules, in the same "
                    "order) at every step: build them with the same model's zo_stages()"
                )
            return
        per_stage = [_tensors(ms) for ms in modules]
        count: dict[int, int] = {}
        for tensors in per_stage:
            for t in tensors:
                count[id(t)] = count.get(id(t), 0) + 1
        for k, tensors in enumerate(per_stage):
            trainable_ids = {id(t) for t in owned[k]}
            shared = any(count[id(t)] > 1 for t in tensors)
            if shared or not owned[k]:
                self.resident_stages.append(k)
                for t in tensors:
                    if t.device != self.device:
                        t.data = t.data.to(self.device)
                continue
            stage = _Offloaded(
                stage=k,
                order=len(self.stages),
                trainable=list(owned[k]),
                fixed=[t for t in tensors if id(t) not in trainable_ids],
            )
            offset = 0
            for t in stage.tensors:
                host = t.data if t.device.type == "cpu" else t.data.cpu()
                if self.cuda:
                    host = host.pin_memory()
                t.data = host
                stage.host.append(host)
                stage.offsets.append(offset)
                offset += _aligned(host.numel() * host.element_size())
            stage.nbytes = offset
            self.stages.append(stage)
            self._by_stage[k] = stage
        self.slot_bytes = max((s.nbytes for s in self.stages), default=0)
        if self.stages:
            self.pool = torch.empty(
                (self.buffers, self.slot_bytes), dtype=torch.uint8, device=self.device
            )
        self._signature = signature

    def _views(self, j: int) -> list[torch.Tensor]:
        """Offloaded stage ``j``'s tensors as views of its buffer."""
        assert self.pool is not None
        stage = self.stages[j]
        slot = self.pool[j % self.buffers]
        views = []
        for host, offset in zip(stage.host, stage.offsets):
            n = host.numel() * host.element_size()
            views.append(slot[offset : offset + n].view(host.dtype).view(host.shape))
        return views

    # -- a pass ---------------------------------------------------------------------------

    def begin(self) -> None:
        """Before a pass: upload the first stages into the buffers."""
        for j in range(min(self.buffers, len(self.stages))):
            self._upload(j)

    @torch.no_grad()
    def _upload(self, j: int) -> None:
        stage = self.stages[j]
        slot = j % self.buffers
        views = self._views(j)
        if self.cuda:
            stream = self._upload_stream
            if self._free[slot] is not None:
                stream.wait_event(self._free[slot])  # the buffer's last stage has left it
            if stage.copied_back is not None:
                stream.wait_event(stage.copied_back)  # the host copy is the latest
            with torch.cuda.stream(stream):
                for view, host in zip(views, stage.host):
                    view.copy_(host, non_blocking=True)
                stage.uploaded = torch.cuda.Event()
                stage.uploaded.record(stream)
        else:
            for view, host in zip(views, stage.host):
                view.copy_(host)
        self._held.add(j)
        self.max_resident = max(self.max_resident, len(self._held))
        self.uploaded_bytes += stage.nbytes
        if self.record:
            self.timeline.append(("upload", stage.stage, slot))

    def enter(self, k: int) -> None:
        """Before stage ``k`` computes: wait for its upload and bind its tensors to the
        buffer (nothing for a resident stage)."""
        stage = self._by_stage.get(k)
        if stage is None:
            return
        j = stage.order
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(stage.uploaded)
        for t, view in zip(stage.tensors, self._views(j)):
            t.data = view
        if self.record:
            self.timeline.append(("compute", k, j % self.buffers))

    @torch.no_grad()
    def leave(self, k: int, *, changed: bool = True) -> None:
        """After stage ``k`` computed: copy its changed parameters back to host memory, bind
        its tensors to the host copies, and upload the next stage that uses the buffer."""
        stage = self._by_stage.get(k)
        if stage is None:
            return
        j = stage.order
        slot = j % self.buffers
        views = self._views(j)
        trained = len(stage.trainable)
        if self.cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            if changed:
                stream = self._offload_stream
                stream.wait_event(done)
                with torch.cuda.stream(stream):
                    for host, view in zip(stage.host[:trained], views[:trained]):
                        host.copy_(view, non_blocking=True)
                    stage.copied_back = torch.cuda.Event()
                    stage.copied_back.record(stream)
                self._free[slot] = stage.copied_back
            else:
                self._free[slot] = done
        elif changed:
            for host, view in zip(stage.host[:trained], views[:trained]):
                host.copy_(view)
        if changed:
            self.copied_back_bytes += sum(
                h.numel() * h.element_size() for h in stage.host[:trained]
            )
        for t, host in zip(stage.tensors, stage.host):
            t.data = host
        self._held.discard(j)
        if self.record and changed:
            self.timeline.append(("copy back", k, slot))
        if j + self.buffers < len(self.stages):
            self._upload(j + self.buffers)

    def end(self) -> None:
        """After a pass, or a pass that raised: wait for the copies back (host memory holds the
        model again) and bind every offloaded tensor to its host copy."""
        for stage in self.stages:
            for t, host in zip(stage.tensors, stage.host):
                if t.data_ptr() != host.data_ptr():
                    t.data = host
        self._held.clear()
        if self.cuda:
            for stage in self.stages:
                if stage.copied_back is not None:
                    stage.copied_back.synchronize()
        self._free = [None] * self.buffers

    def summary(self) -> dict[str, Any]:
        """What is offloaded, and the copies so far."""
        return {
            "offloaded_stages": len(self.stages),
            "resident_stages": len(self.resident_stages),
            "buffers": self.buffers,
            "buffer_bytes": self.slot_bytes,
            "max_resident": self.max_resident,
            "uploaded_bytes": self.uploaded_bytes,
            "copied_back_bytes": self.copied_back_bytes,
        }
