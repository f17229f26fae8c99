"""The reference of compressed means (:class:`RefCompression`), written per worker from the
formulas in one process, and the mean every reference takes (:func:`rank_order_mean`: summed
in rank order, then divided, as SUM all-reduce and divide compute it)."""

from __future__ import annotations

import torch

from lowcomm.compress.codecs import (
    Codec,
    ElementwiseCodec,
    PowerSGD,
    Raw,
    orthogonalize,
    parse_compression,
)
from lowcomm.compress.feedback import worker_generator
from lowcomm.compress.lgreco import LGreCo, candidate_errors, decide

__all__ = ["RefCompression", "rank_order_mean"]


def rank_order_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum in rank order, then divide by N (what SUM all-reduce + divide computes)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total / len(tensors)


class RefCompression:
    """N workers' compression of one list of tensors, in one process: per worker, M = x + e,
    its decoded contribution C(M) and e ← M − C(M); the mean of the contributions summed in
    rank order. PowerSGD: P = M·Q per worker, P̂ = orth(mean P), Qᵢ = Mᵀ·P̂, e ← M − P̂·Qᵢᵀ,
    result P̂·(mean Q)ᵀ, warm start from mean Q. L-GreCo: the workers' error tables are
    averaged and :func:`~lowcomm.compress.lgreco.decide` picks the codecs every K means.
    Written from those formulas, independently of the collective code it checks."""

    def __init__(self, spec: str, shapes: list[torch.Size], workers: int, stream: int = 0):
        setting = parse_compression(spec)
        assert setting is not None
        self.setting = setting
        self.shapes = shapes
        self.n = workers
        self.residuals = [[torch.zeros(s) for s in shapes] for _ in range(workers)]
        self.generators = [worker_generator(w, stream) for w in range(workers)]
        self.q: dict[int, torch.Tensor] = {}
        self.launches = 0
        raw = Raw()
        if isinstance(setting, LGreCo):
            self.candidates = setting.codecs()
            default = self.candidates[setting.default_index]
            self.eligible = [
                i
                for i, s in enumerate(shapes)
                if s.numel() >= setting.min_numel and any(c.compresses(s) for c in self.candidates)
            ]
            self.assignment: list[Codec] = [raw for _ in shapes]
            for i in self.eligible:
                self.assignment[i] = default if default.compresses(shapes[i]) else raw
        else:
            self.assignment = [setting if setting.compresses(s) else raw for s in shapes]

    def mean(
        self, xs: list[list[torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """``xs[w][i]``: worker w's tensor i. Returns the mean and every worker's contribution."""
        ms = [[x + e for x, e in zip(xw, ew)] for xw, ew in zip(xs, self.residuals)]
        setting = self.setting
        if isinstance(setting, LGreCo) and self.launches % setting.every == 0 and self.eligible:
            tables = [
                torch.tensor(
                    [
                        candidate_errors(self.candidates, mw[i], index=i, warm_q=self.q.get(i))
                        for i in self.eligible
                    ],
                    dtype=torch.float64,
                )
                for mw in ms
            ]
            errors = rank_order_mean(tables).tolist()
            sizes = [
                [c.wire_nbytes(self.shapes[i]) for c in self.candidates] for i in self.eligible
            ]
            picks = decide(errors, sizes, setting.default_index, resolution=setting.resolution)
            for i, pick in zip(self.eligible, picks):
                chosen = self.candidates[pick]
                self.assignment[i] = chosen if chosen.compresses(self.shapes[i]) else Raw()
        out: list[torch.Tensor] = []
        contrib: list[list[torch.Tensor]] = [[] for _ in range(self.n)]
        for i, codec in enumerate(self.assignment):
            if isinstance(codec, PowerSGD):
                rows, cols = codec.matrix_shape(self.shapes[i])
                q = self._start_q(i, codec)
                mats = [mw[i].reshape(rows, cols) for mw in ms]
                p_hat = orthogonalize(rank_order_mean([mat @ q for mat in mats]))
                q_own = [mat.t() @ p_hat for mat in mats]
                for w in range(self.n):
                    c = p_hat @ q_own[w].t()
                    contrib[w].append(c.view(self.shapes[i]))
                    self.residuals[w][i] = mats[w] - c
                    self.residuals[w][i] = self.residuals[w][i].view(self.shapes[i])
                q_mean = rank_order_mean(q_own)
                if codec.warm_start:
                    self.q[i] = q_mean
                out.append((p_hat @ q_mean.t()).view(self.shapes[i]))
                continue
            assert isinstance(codec, ElementwiseCodec)
            for w in range(self.n):
                gen = self.generators[w] if codec.stochastic else None
                c = codec.roundtrip(ms[w][i], generator=gen)
                contrib[w].append(c)
                self.residuals[w][i] = ms[w][i] - c
            out.append(rank_order_mean([contrib[w][i] for w in range(self.n)]))
        self.launches += 1
        return out, contrib

    def _start_q(self, i: int, codec: PowerSGD) -> torch.Tensor:
        return codec.start_q(self.shapes[i], i, self.q.get(i), draw=self.launches)
