"""CPU time of one compressed mean of the default GPT's 52 tensors: a bucket encoded and decoded
as one flat vector (``lowcomm.compress.flat``, what every compressed sync and warm-start step
runs) against the same codec tensor by tensor (what lowcomm once did; the same bytes and values).

Per rank a mean is: add the residuals, encode, decode this rank's own payload for the error
feedback, keep the residual, then decode every rank's payload, sum in rank order and divide.
Both ways run here in one process on one thread, turn by turn, on the same inputs and N payloads
(the other ranks' are this rank's, scaled), for the warm start's buckets (1 MB, the last megabyte
in quarters, as it launches them during backward) and for the whole model in one bucket (an
outer sync). Reproduce (about a minute on 2 cores)::

    python benchmarks/codec_cpu.py

which prints the markdown table and writes ``benchmarks/codec_cpu.md``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from lowcomm.compress import Compressor, parse_compression
from lowcomm.compress.flat import FlatLayout
from lowcomm.compress.formats import ElementwiseCodec
from lowcomm.outer.warm import warm_buckets
from lowcomm.train.config import TrainConfig
from lowcomm.train.model import build_gpt

HERE = Path(__file__).resolve().parent
REPEATS = 21
WORLD = 2


def buckets(params: list[torch.Tensor], cap_mb: float) -> list[list[torch.Tensor]]:
    """The warm start's buckets, as it launches them during backward."""
    order = list(reversed(params))
    return [
        [order[i] for i in g] for g in warm_buckets([4 * p.numel() for p in order], cap_mb * 2**20)
    ]


def tensor_by_tensor(
    codecs: list[ElementwiseCodec], xs: list[torch.Tensor], residuals: list[torch.Tensor]
) -> list[torch.Tensor]:
    m = torch._foreach_add(xs, residuals)
    payloads = []
    for codec, x, e in zip(codecs, m, residuals):
        payload = codec.encode(x)
        torch.sub(x, codec.decode(payload, x.shape), out=e)
        torch.nan_to_num_(e, 0.0, 0.0, 0.0)
        payloads.append(payload)
    gathered = [torch.cat(payloads)] * WORLD
    means, off = [], 0
    for codec, x, p in zip(codecs, xs, payloads):
        a, b = off, off + p.numel()
        total = codec.decode(gathered[0][a:b], x.shape)
        for r in range(1, WORLD):
            total.add_(codec.decode(gathered[r][a:b], x.shape))
        means.append(total.div_(float(WORLD)))
        off = b
    return means


def as_a_whole(layout: FlatLayout, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    payload = layout.encode_feedback(x, residual=residual, generator=None)
    out = torch.empty_like(x)
    layout.decode_mean(torch.cat([payload] * WORLD), WORLD, out=out)
    return out


def _each(fn: Callable[..., object], cases: list[tuple[object, ...]]) -> None:
    for case in cases:
        fn(*case)


def median_ms(fn: Callable[[], object]) -> float:
    return 1e3 * statistics.median(_timed(fn) for _ in range(REPEATS))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [p.detach() for p in build_gpt(TrainConfig(), 256).parameters()]
    rows = [
        "| codec | buckets | tensor by tensor | as a whole | faster |",
        "|---|---|---|---|---|",
    ]
    for spec in ("int8", "int4", "int2", "sign", "topk:0.01"):
        codec = parse_compression(spec)
        for name, groups in (("warm start (1 MB)", buckets(params, 1.0)), ("one", [params])):
            cases = []
            for group in groups:
                shapes = [p.shape for p in group]
                comp = Compressor(spec, shapes)  # its assignment: raw where a codec cannot gain
                codecs = [c for c in comp.assignment if isinstance(c, ElementwiseCodec)]
                xs = [torch.randn_like(p) for p in group]
                cases.append((codecs, FlatLayout(codecs, shapes, "cpu"), xs))
            res_a = [[torch.zeros_like(x) for x in xs] for _, _, xs in cases]
            res_b = [torch.zeros(sum(x.numel() for x in xs)) for _, _, xs in cases]
            flats = [torch.cat([x.reshape(-1) for x in xs]) for _, _, xs in cases]
            for (codecs, layout, xs), ra, rb, x in zip(cases, res_a, res_b, flats):  # same bits
                one_by_one = torch.cat([t.reshape(-1) for t in tensor_by_tensor(codecs, xs, ra)])
                assert torch.equal(one_by_one, as_a_whole(layout, x, rb))
            old = new = 0.0
            for _ in range(3):  # turn by turn
                old += median_ms(
                    partial(
                        _each, tensor_by_tensor, [(c, x, r) for (c, _, x), r in zip(cases, res_a)]
                    )
                )
                new += median_ms(
                    partial(
                        _each,
                        as_a_whole,
                        [(lay, x, r) for (_, lay, _), r, x in zip(cases, res_b, flats)],
                    )
                )
            old, new = old / 3, new / 3
            rows.append(
                f"| {codec} | {name}: {len(groups)} | {old:.1f} ms | {new:.1f} ms "
                f"| {old / new:.1f}× |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    head = (
        f"One compressed mean of the default GPT ({len(params)} tensors, "
        f"{sum(p.numel() for p in params):,} parameters) on one rank: encode with error "
        f"feedback, decode {WORLD} ranks' payloads; CPU, one thread, the mean of 3 medians of "
        f"{REPEATS}, both ways turn by turn (`python benchmarks/codec_cpu.py`).\n\n"
    )
    text = head + "\n".join(rows) + "\n"
    print(text)
    (HERE / "codec_cpu.md").write_text(text)


if __name__ == "__main__":
    main()
