"""Error feedback: one rank's compression state for a fixed list of tensors.

A :class:`Compressor` belongs to one worker and one set of tensors (an algorithm's fragment, or a
DDP bucket). It holds, per tensor: the codec in use (fixed, or chosen by L-GreCo), the
error-feedback residual e, and PowerSGD's warm-start Q; plus the random generator of stochastic
rounding and the L-GreCo bookkeeping. Everything is in :meth:`Compressor.state_dict`.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"):
each round the tensor sent is M = x + e and the residual becomes e ← M − C(M), C(M) this rank's
decoded contribution. Summed over rounds, Σ C(M_t) + e_T = Σ x_t on every rank (fp32 rounding
aside): nothing is lost, only delayed. A tensor sent raw has C(M) = M and e = 0. With a decay β
(``feedback_decay``, SparseLoCo's accumulator) M = x + β·e: what is not sent fades, and e is a
momentum of the pseudo-gradients that sends its largest parts.

At most one compressed mean per compressor is in flight: a new launch first finishes the
previous one (for CO2 the previous round is due at that very step anyway). That keeps the
residual and PowerSGD's warm start in a fixed order, so a run resumed from a checkpoint gives the
same numbers as one that was not stopped.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import record_function

from lowcomm.comm import Communicator
from lowcomm.compress.codecs import parse_codec, parse_compression
from lowcomm.compress.collectives import CompressedHandle, GatherGroup, LowRankGroup, time_launch
from lowcomm.compress.flat import FlatLayout
from lowcomm.compress.formats import Codec, ElementwiseCodec, PowerSGD, Raw
from lowcomm.compress.lgreco import LGreCo, candidate_errors, decide
from lowcomm.device import CollectiveTimer, collective_device
from lowcomm.guard import all_finite, zero_non_finite_

__all__ = ["Compressor", "generator_resumes", "load_compression_state", "worker_generator"]

logger = logging.getLogger(__name__)

RAW = Raw()


def worker_generator(
    rank: int, stream: int = 0, device: torch.device | str = "cpu", *, launches: int = 0
) -> torch.Generator:
    """The stochastic-rounding generator of worker ``rank`` for compressor ``stream``: different
    on every rank (independent rounding noise), reproducible from run to run. ``launches`` > 0:
    the generator a compressor restarts from after that many launches when its saved one
    cannot be restored (saved on another device type: :func:`generator_resumes`), seeded
    apart from every worker's first seed."""
    g = torch.Generator(device=device)
    g.manual_seed(1_000_003 * (stream + 1) + 7919 * rank + (launches << 32))
    return g


def generator_resumes(saved_device: str | None, saved: torch.Tensor, into: torch.Generator) -> bool:
    """Whether the generator state ``saved`` (from a generator on ``saved_device``, a device
    type; ``None``: not recorded, a checkpoint from before it was) can be restored into
    ``into``. States are device-specific (the CPU's Mersenne Twister, CUDA's Philox seed and
    offset): a CPU checkpoint resumed on GPUs, or the other way round, cannot carry its
    rounding noise over. Unrecorded, the state's size decides."""
    if saved_device is not None:
        return saved_device == into.device.type
    return saved.numel() == into.get_state().numel()


_LAYOUTS_KEPT = 64
"""Bucket layouts a :class:`Compressor` keeps (one per bucket and assignment of codecs)."""


class Compressor:
    """One rank's compression state for a fixed list of tensor shapes (see the module docstring).

    Args:
        compression: a codec, an :class:`~lowcomm.compress.lgreco.LGreCo` setting or a spec
            string (:func:`~lowcomm.compress.codecs.parse_compression`).
        shapes: the shapes of the tensors, in the order they are passed to :meth:`launch`.
        rank: this rank (seeds stochastic rounding).
        device: where residuals and factors live.
        error_feedback: keep residuals (default); without, compression error is dropped.
        stream: distinguishes the compressors of one rank (fragments, DDP buckets) so that
            their rounding noise is independent.
        feedback_decay: β, the residual's decay before each launch (M = x + β·e); 1 keeps it
            whole (error feedback), 0 drops it.
    """

    def __init__(
        self,
        compression: Codec | LGreCo | str,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        *,
        rank: int = 0,
        device: torch.device | str = "cpu",
        error_feedback: bool = True,
        stream: int = 0,
        feedback_decay: float = 1.0,
    ) -> None:
        setting = parse_compression(compression)
        if not 0.0 <= float(feedback_decay) <= 1.0:
            raise ValueError(f"feedback_decay must be in [0, 1], got {feedback_decay!r}")
        self.feedback_decay = float(feedback_decay)
        if setting is None:
            raise ValueError("a Compressor needs a codec, e.g. 'int8'; for none pass no compressor")
        self.setting: Codec | LGreCo = setting
        self.shapes = [torch.Size(s) for s in shapes]
        self.device = torch.device(device)
        self.error_feedback = bool(error_feedback)
        self.rank = int(rank)
        self.stream = int(stream)
        if isinstance(setting, LGreCo):
            self.candidates: list[Codec] = setting.codecs()
            self.low_rank = setting.family == "powersgd"
            default = self.candidates[setting.default_index]
            self.eligible = [
                i
                for i, s in enumerate(self.shapes)
                if s.numel() >= setting.min_numel and any(c.compresses(s) for c in self.candidates)
            ]
            self.assignment: list[Codec] = [RAW] * len(self.shapes)
            for i in self.eligible:
                self.assignment[i] = default if default.compresses(self.shapes[i]) else RAW
        else:
            self.candidates = [setting]
            self.low_rank = isinstance(setting, PowerSGD)
            self.eligible = []
            self.assignment = [setting if setting.compresses(s) else RAW for s in self.shapes]
        numels = [s.numel() for s in self.shapes]
        self._offsets = [sum(numels[:i]) for i in range(len(numels))]
        # one flat buffer: a bucket's residuals are one slice of it (views per tensor)
        self._residual_flat = torch.zeros(sum(numels), device=self.device)
        self.residuals = [
            self._residual_flat.narrow(0, off, n).view(s)
            for off, n, s in zip(self._offsets, numels, self.shapes)
        ]
        self.q: dict[int, torch.Tensor] = {}
        """PowerSGD's warm-start Q per tensor index (the previous round's mean Q)."""
        self.generator = worker_generator(self.rank, self.stream, self.device)
        self.launches = 0
        """Compressed means launched so far."""
        self.decisions = 0
        """L-GreCo decisions taken so far."""
        self._pending: CompressedHandle | None = None
        self._layouts: dict[tuple[tuple[int, ...], tuple[Codec, ...]], FlatLayout] = {}

    @property
    def spec(self) -> str:
        return self.setting.spec

    def wire_nbytes(self) -> int:
        """Bytes this rank contributes per launch with the current assignment (its payload)."""
        return sum(c.wire_nbytes(s) for c, s in zip(self.assignment, self.shapes))

    # -- launching ---------------------------------------------------------------------------

    def launch(
        self,
        comm: Communicator,
        views: Sequence[torch.Tensor],
        groups: Sequence[Sequence[int]],
        *,
        own: Sequence[torch.Tensor] | None = None,
        flat: Sequence[torch.Tensor] | None = None,
        own_flat: Sequence[torch.Tensor] | None = None,
    ) -> CompressedHandle:
        """Compress ``views`` (with error feedback) and launch one collective per group (two
        for PowerSGD); the handle's ``wait()`` writes the mean over ranks into ``views``.

        ``flat``, if given, holds one buffer per group whose first elements are that group's
        views one after the other (a bucket: :class:`~lowcomm.buckets.FlatBuckets`, DDP's
        bucket): a single-phase codec then encodes, feeds back and decodes the bucket as a
        whole (:class:`~lowcomm.compress.flat.FlatLayout`), a fixed number of operations
        whatever the number of tensors. ``own`` (views) or ``own_flat`` (buffers like
        ``flat``), if given, receive this rank's decoded contribution at once (single-phase
        codecs only)."""
        if self._pending is not None:
            self._pending.wait()
        if (own is not None or own_flat is not None) and self.low_rank:
            raise ValueError(
                f"{self.spec!r} decodes this rank's contribution only after its second "
                "all-reduce, which eager updates cannot wait for; use eager=False or a "
                "single-phase codec such as 'int8'"
            )
        assert len(views) == len(self.shapes)
        deciding = isinstance(self.setting, LGreCo) and self.launches % self.setting.every == 0
        if self.error_feedback and self.feedback_decay != 1.0:
            self._residual_flat.mul_(self.feedback_decay)  # e ← β·e, then M = x + e
        m: list[torch.Tensor] = []
        if self.low_rank or deciding:  # per tensor: PowerSGD's matrices, L-GreCo's table
            x = [v.detach().float() for v in views]
            m = list(torch._foreach_add(x, self.residuals)) if self.error_feedback else x
        if deciding:
            self._decide(comm, m)
        gather: list[GatherGroup] = []
        low_rank: list[LowRankGroup] = []
        t_launch = time.perf_counter()
        # each collective marked as it goes out, the next group's encoding queued after it
        timer = CollectiveTimer(views[0].device if views else self.device)
        with record_function("lowcomm::compress::encode"):
            for b, idx in enumerate(groups):
                if not idx:
                    continue
                if self.low_rank:
                    low_rank.append(self._launch_low_rank(comm, list(idx), m))
                    time_launch(timer, low_rank[-1].work_p)
                else:
                    into = None if flat is None else flat[b]
                    own_into = None if own_flat is None else own_flat[b]
                    group = self._launch_gather(comm, list(idx), views, into, own, own_into)
                    gather.append(group)
                    time_launch(timer, group.work)
        self.launches += 1
        handle = CompressedHandle(
            comm, self, views, gather, low_rank, t_launch=t_launch, timer=timer
        )
        self._pending = handle
        return handle

    def record_contribution(self, i: int, m: torch.Tensor, contribution: torch.Tensor) -> None:
        """Error feedback for tensor ``i``: e ← M − C(M), C(M) this rank's decoded
        contribution (called at encoding, or by PowerSGD's second phase). A NaN or Inf (a
        diverged rank: the average that carries it is skipped) is not carried over: 0."""
        if self.error_feedback:
            e = self.residuals[i]
            torch.sub(m.reshape(self.shapes[i]), contribution.reshape(self.shapes[i]), out=e)
            torch.nan_to_num_(e, nan=0.0, posinf=0.0, neginf=0.0)

    def _launch_gather(
        self,
        comm: Communicator,
        idx: list[int],
        views: Sequence[torch.Tensor],
        flat: torch.Tensor | None,
        own: Sequence[torch.Tensor] | None,
        own_flat: torch.Tensor | None,
    ) -> GatherGroup:
        layout = self._layout(idx)
        n = layout.numel
        start = self._offsets[idx[0]]
        target: torch.Tensor | None = None
        if flat is not None and flat.dtype == torch.float32:
            out = flat[:n]  # the mean is decoded into the bucket itself
            x = out.detach()
        elif flat is not None:  # (a bf16 DDP bucket: decoded in fp32, then cast into it)
            target = flat[:n]
            out = x = target.detach().float()
        else:  # views that are not one bucket: gathered into one, the mean copied back
            out = x = torch.cat([views[i].detach().reshape(-1).float() for i in idx])
        residual = self._residual_flat.narrow(0, start, n) if self.error_feedback else None
        mine = None
        if own_flat is not None and own_flat.dtype == torch.float32:
            mine = own_flat[:n]
        elif own_flat is not None or own is not None:
            mine = torch.empty_like(x)
        # M = x + e in e's memory, encoded; e ← M − C(M) (a NaN or Inf is not carried over: 0)
        payload = layout.encode_feedback(x, residual=residual, mine=mine, generator=self.generator)
        if own_flat is not None and mine is not None and mine.dtype != own_flat.dtype:
            own_flat[:n].copy_(mine)
        elif own is not None and own_flat is None:
            assert mine is not None
            parts = mine.split([self.shapes[i].numel() for i in idx])
            torch._foreach_copy_(
                [own[i] for i in idx], [p.view_as(own[i]) for p, i in zip(parts, idx)]
            )
        gathered = torch.empty(
            payload.numel() * comm.world_size, dtype=torch.uint8, device=payload.device
        )
        work = comm.all_gather_async(payload, gathered)
        copy_back = flat is None
        return GatherGroup(idx, layout, payload, gathered, work, out, target, copy_back)

    def _layout(self, idx: list[int]) -> FlatLayout:
        """The payload layout of the bucket of tensors ``idx`` under the current assignment
        (kept while it holds: L-GreCo may change it)."""
        codecs = []
        for i in idx:
            codec = self.assignment[i]
            assert isinstance(codec, ElementwiseCodec)
            codecs.append(codec)
        key = (tuple(idx), tuple(codecs))
        layout = self._layouts.get(key)
        if layout is None:
            if idx != list(range(idx[0], idx[0] + len(idx))):
                raise ValueError(
                    f"a compressed group must be consecutive tensors (a bucket's), got {idx}; "
                    "pass groups such as FlatBuckets.groups() gives"
                )
            if len(self._layouts) >= _LAYOUTS_KEPT:  # L-GreCo's earlier assignments
                self._layouts.clear()
            layout = FlatLayout(codecs, [self.shapes[i] for i in idx], self.device)
            self._layouts[key] = layout
        return layout

    def _launch_low_rank(
        self, comm: Communicator, idx: list[int], m: list[torch.Tensor]
    ) -> LowRankGroup:
        compressed = [i for i in idx if isinstance(self.assignment[i], PowerSGD)]
        raw = [i for i in idx if not isinstance(self.assignment[i], PowerSGD)]
        mats: dict[int, torch.Tensor] = {}
        qs: dict[int, torch.Tensor] = {}
        codecs: dict[int, PowerSGD] = {}
        pieces: list[torch.Tensor] = []
        for i in compressed:
            codec = self.assignment[i]
            assert isinstance(codec, PowerSGD)
            rows, cols = codec.matrix_shape(self.shapes[i])
            mats[i] = m[i].reshape(rows, cols)
            qs[i] = self._start_q(i, codec)
            codecs[i] = codec
            pieces.append((mats[i] @ qs[i]).reshape(-1))
        for i in raw:
            pieces.append(m[i].reshape(-1))
            if self.error_feedback:
                self.residuals[i].zero_()  # sent exactly
        flat = torch.cat(pieces)
        work = comm.all_reduce_sum_async(flat)
        return LowRankGroup(compressed, raw, codecs, mats, qs, flat, work)

    def _start_q(self, i: int, codec: PowerSGD) -> torch.Tensor:
        q = codec.start_q(self.shapes[i], i, self.q.get(i), draw=self.launches)
        return q.to(self.device)

    def set_warm_start(self, i: int, q_mean: torch.Tensor) -> None:
        """PowerSGD: the mean Q of tensor ``i`` starts its next round (with warm start)."""
        codec = self.assignment[i]
        if isinstance(codec, PowerSGD) and codec.warm_start:
            self.q[i] = q_mean.clone()

    def release(self, handle: CompressedHandle) -> None:
        """Called by ``handle`` once it is finished: no mean is in flight any more."""
        if self._pending is handle:
            self._pending = None

    # -- L-GreCo -----------------------------------------------------------------------------

    def _decide(self, comm: Communicator, m: list[torch.Tensor]) -> None:
        """Measure every candidate on every eligible tensor, average the table across ranks and
        choose (the same on every rank)."""
        setting = self.setting
        assert isinstance(setting, LGreCo)
        if not self.eligible:
            return
        table = torch.tensor(
            [
                candidate_errors(self.candidates, m[i], index=i, warm_q=self.q.get(i))
                for i in self.eligible
            ],
            dtype=torch.float64,
            device=collective_device(comm),  # NCCL takes GPU tensors only
        )
        comm.all_reduce_mean([table])  # every rank now holds the same table
        errors = table.tolist()
        sizes = [[c.wire_nbytes(self.shapes[i]) for c in self.candidates] for i in self.eligible]
        d = setting.default_index
        picks = decide(errors, sizes, d, resolution=setting.resolution)
        for i, c in zip(self.eligible, picks):
            codec = self.candidates[c]
            self.assignment[i] = codec if codec.compresses(self.shapes[i]) else RAW
        self.decisions += 1
        logger.debug(
            "L-GreCo decision %d (%s): %s; %d bytes (uniform %d)",
            self.decisions,
            setting.spec,
            [self.candidates[c].spec for c in picks],
            sum(s[c] for s, c in zip(sizes, picks)),
            sum(s[d] for s in sizes),
        )

    def drop_non_finite(self) -> int:
        """After a non-finite average: zero the NaN/Inf values of the residuals and forget a
        non-finite warm-start Q (the next launch starts from a fresh seeded one, alike on every
        rank since Q is the mean). Returns how many tensors were affected."""
        fixed = zero_non_finite_(self.residuals)
        for i in [i for i, q in self.q.items() if not all_finite([q])]:
            del self.q[i]
            fixed += 1
        return fixed

    def reset_residuals(self) -> None:
        """Forget the error not yet sent (every residual 0)."""
        self._residual_flat.zero_()

    def restart(self, rank: int) -> None:
        """A replica that joins an elastic job as rank ``rank`` (healed, or at the job's start):
        no error of its own yet (residuals 0; a donor's are the donor's error), and rounding
        noise of its own (the generator of ``rank``, from this launch count). PowerSGD's
        warm-start Q, the mean of every replica's, stays."""
        self.reset_residuals()
        self.rank = int(rank)
        self.generator = worker_generator(
            self.rank, self.stream, self.device, launches=self.launches
        )

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Residuals, assignment, warm-start factors, generator and counters (finishes an
        in-flight mean first, so its warm start is included)."""
        if self._pending is not None:
            self._pending.wait()
        return {
            "codec": self.spec,
            "error_feedback": self.error_feedback,
            "assignment": [c.spec for c in self.assignment],
            "residuals": [r.detach().clone() for r in self.residuals],
            "q": {str(i): q.detach().clone() for i, q in self.q.items()},
            "generator": self.generator.get_state(),
            "generator_device": self.generator.device.type,
            "launches": self.launches,
            "decisions": self.decisions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("codec", "assignment", "residuals", "q", "generator", "launches"):
            if key not in state:
                raise ValueError(f"compression state_dict is missing {key!r}")
        if state["codec"] != self.spec:
            raise ValueError(
                f"state_dict was saved with compression={state['codec']!r} but this run has "
                f"{self.spec!r}; resume with the same compression"
            )
        if len(state["residuals"]) != len(self.shapes) or any(
            tuple(r.shape) != tuple(s) for r, s in zip(state["residuals"], self.shapes)
        ):
            raise ValueError("compression state_dict holds residuals of other shapes")
        self.assignment = [parse_codec(s) for s in state["assignment"]]
        for r, saved in zip(self.residuals, state["residuals"]):
            r.copy_(saved)
        self.q = {int(i): q.to(self.device) for i, q in state["q"].items()}
        self.launches = int(state["launches"])
        saved_device = state.get("generator_device")
        if generator_resumes(saved_device, state["generator"], self.generator):
            self.generator.set_state(state["generator"])
        else:
            # the same restart on every resume of this checkpoint on this device type
            here = self.generator.device.type
            self.generator = worker_generator(
                self.rank, self.stream, self.device, launches=self.launches
            )
            warnings.warn(
                "compression state_dict holds the stochastic-rounding generator of another "
                f"device type ({saved_device or 'not recorded'}) than this run's ({here}): "
                "rounding continues from a fresh seed (the same on every resume of this "
                "checkpoint), not where it stopped",
                stacklevel=2,
            )
        self.decisions = int(state.get("decisions", 0))
        self._pending = None


def load_compression_state(compressor: Compressor | None, state: dict[str, Any]) -> None:
    """Restore a compressor from ``state["compression"]``; refuses a mismatch either way."""
    saved = state.get("compression")
    if compressor is None:
        if saved is not None:
            raise ValueError(
                f"state_dict was saved with compression={saved.get('codec')!r} but this run "
                "has none; resume with the same compression"
            )
        return
    if saved is None:
        raise ValueError(
            f"state_dict was saved without compression but this run has "
            f"compression={compressor.spec!r}; resume with the same compression"
        )
    compressor.load_state_dict(saved)
