"""The codec row of ``lowcomm bench``: what a codec costs against the memory it touches.

A compressed sync reads and writes a fragment's buckets a few times: the delta plus the residual,
the codes, this rank's decoded contribution and the new residual, then the decoded mean. A
``clone()`` of the same buckets reads and writes them once, so ``codec time / clone time`` says
how far a codec is from the speed of memory, on any machine, whatever its absolute speed.

For every codec and size N (millions of fp32 parameters) the row builds the tensors of N
parameters, packs them as a fragment does (:class:`~lowcomm.buckets.FlatBuckets` of
``bucket_cap_mb``, 25 MB by default) and builds a :class:`~lowcomm.compress.Compressor` with
error feedback over their shapes. One timed *codec* call is lowcomm's real path on a one-rank
gloo group: :meth:`~lowcomm.comm.Communicator.compressed_mean_async` (add the residual, encode,
this rank's decoded contribution, the new residual; the collective, at one rank a copy of the
codes) then the handle's ``wait()`` (decode the mean into the buckets). One timed *clone* call
clones every bucket (the median of 3 clones in a row); one timed *copy* call copies them into
buffers allocated once. The three alternate (the order flipping every repeat, after one untimed
warm-up of each), so that drift in the machine's speed hits them alike; the buckets are refilled
with the same delta before each codec call, outside the clock, and the residual carries over as
in training. Reported: the medians of each time, and the median over repeats of each repeat's
codec / clone (``ratio``, the figure the bench's codec goal is set on) and codec / copy
(``ratio_to_copy``). The copy is the floor of the memory traffic: a clone also allocates, and on
Linux an allocation larger than glibc's mmap threshold (which adapts, up to 32 MB) comes as
fresh pages from the kernel, whose faults can make a clone cost up to 3 copies.

Two layouts of N parameters:

* ``gpt``: whole transformer blocks of :class:`lowcomm.models.gpt.Block` (LayerNorm weight and
  bias, the 3C × C attention matrix and its bias, C × C projection, 4C × C and C × 4C MLP
  matrices and their biases: 12 tensors, 12C² + 13C parameters) of the widest width C, a
  multiple of 128 up to GPT-2 small's 768, whose whole blocks come within 5% of N: 1 M is five
  blocks of width 128 (lowcomm's default GPT's), 10 M two of 640, 85 M GPT-2 small's twelve of
  768;
* ``single``: one matrix of round(N / 1024) × 1024.

Every loop is bounded: at most ``repeats`` timed repeats per codec, size and layout, fewer where
one entry has run ``budget_s`` seconds (it then stops after the repeat it is in; the first one
always runs).

Example::

    row = measure_codecs(["int8", "topk:0.01"], [1.0], repeats=5)
    [(r["codec"], r["layout"], r["ratio"]) for r in row["rows"]]
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowcomm.buckets import DEFAULT_BUCKET_CAP_MB, FlatBuckets

__all__ = [
    "DEFAULT_CODECS",
    "DEFAULT_SIZES_M",
    "LAYOUTS",
    "check_codec_settings",
    "gpt_shapes",
    "measure_codecs",
    "run_codec",
    "single_shapes",
]

logger = logging.getLogger(__name__)

DEFAULT_CODECS = ("int8", "int4", "int2", "topk:0.01", "bf16", "sign", "powersgd:4")
"""The codecs of the row by default: the quantisers, top-k at the density lowcomm's docs use,
and the other codecs lowcomm offers (the defaults of each)."""

DEFAULT_SIZES_M = (1.0, 10.0)
"""Sizes in millions of parameters by default: short enough for every bench run; 85 (GPT-2
small's blocks) is asked for with ``--codec-sizes 1,10,85``."""

LAYOUTS = ("gpt", "single")
"""The tensor layouts of N parameters (see the module docstring)."""

_WIDTHS = (768, 640, 512, 384, 256, 128, 96, 64, 32)
"""Block widths of the ``gpt`` layout, widest first: multiples of 128 (of every quantiser's
default block: no tensor's last block is padded) up to GPT-2 small's 768, then narrower ones for
sizes below five blocks of 128."""
_MIN_SIZE_M = 0.01
"""The smallest size: one block of width 32 is 12,704 parameters."""


def _block_params(width: int) -> int:
    return 12 * width * width + 13 * width


def gpt_shapes(numel: int) -> list[torch.Size]:
    """The ``gpt`` layout of about ``numel`` parameters: whole blocks of
    :class:`lowcomm.models.gpt.Block`, in its parameter order (see the module docstring)."""
    from lowcomm.models.gpt import Block, GPTConfig

    width, blocks = _gpt_width_and_blocks(numel)
    with torch.device("meta"):  # shapes only: nothing is allocated
        block = Block(GPTConfig(vocab_size=1, n_layer=1, n_head=1, n_embd=width))
    shapes = [p.shape for p in block.parameters()]
    assert sum(s.numel() for s in shapes) == _block_params(width)
    return shapes * blocks


def _gpt_width_and_blocks(numel: int) -> tuple[int, int]:
    """The widest of :data:`_WIDTHS` whose whole blocks come within 5% of ``numel`` (else the
    nearest), and how many blocks."""
    best: tuple[float, int, int] | None = None
    for width in _WIDTHS:
        blocks = round(numel / _block_params(width))
        if blocks < 1:
            continue
        error = abs(blocks * _block_params(width) - numel) / numel
        if error <= 0.05:
            return width, blocks
        if best is None or error < best[0]:
            best = (error, width, blocks)
    if best is None:  # below half a block of width 32: one such block
        return _WIDTHS[-1], 1
    return best[1], best[2]


def single_shapes(numel: int) -> list[torch.Size]:
    """The ``single`` layout: one round(numel / 1024) × 1024 matrix."""
    return [torch.Size((max(1, round(numel / 1024)), 1024))]


def check_codec_settings(
    codecs: Sequence[str],
    sizes_m: Sequence[float],
    *,
    layouts: Sequence[str] = LAYOUTS,
    repeats: int = 5,
    budget_s: float = 30.0,
) -> None:
    """Raise ``ValueError`` naming the first bad setting of the codec row and its fix (before
    anything runs)."""
    from lowcomm.compress import parse_compression

    if not codecs:
        raise ValueError("codecs: give at least one codec, e.g. --codecs int8,topk:0.01")
    for spec in codecs:
        try:
            setting = parse_compression(spec)
        except ValueError as e:
            raise ValueError(f"codecs: {e}") from None
        if setting is None:
            raise ValueError(
                f"codecs: {spec!r} is no codec; name codecs such as int8,int4,topk:0.01 "
                "(the clone each is timed against is in every entry)"
            )
    if not sizes_m:
        raise ValueError("codec_sizes: give at least one size in millions, e.g. --codec-sizes 1,10")
    for size in sizes_m:
        if not (isinstance(size, (int, float)) and math.isfinite(size) and size >= _MIN_SIZE_M):
            raise ValueError(
                f"codec_sizes: {size!r} is not a size in millions of parameters >= "
                f"{_MIN_SIZE_M} (one transformer block of width 32); e.g. --codec-sizes 1,10,85"
            )
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(
                f"layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}"
            )
    if not layouts:
        raise ValueError(f"layouts: give at least one of {', '.join(LAYOUTS)}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: must be an integer >= 1 (--codec-repeats), got {repeats!r}")
    if not budget_s > 0:
        raise ValueError(f"budget_s: must be > 0 seconds, got {budget_s!r}")


def measure_codecs(
    codecs: Sequence[str] = DEFAULT_CODECS,
    sizes_m: Sequence[float] = DEFAULT_SIZES_M,
    *,
    layouts: Sequence[str] = LAYOUTS,
    repeats: int = 5,
    budget_s: float = 30.0,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    threads: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time each codec's compressed mean against a clone of the same buckets (module docstring).

    Initialises (and afterwards destroys) a single-rank gloo process group when none is
    initialised; uses the existing default group otherwise (it must then have one rank).

    Args:
        codecs: ``lowcomm train --compression`` values.
        sizes_m: sizes in millions of parameters.
        layouts: ``"gpt"`` and/or ``"single"``.
        repeats: timed repeats (codec, clone, copy) per entry, at most.
        budget_s: seconds after which an entry stops at the end of its current repeat.
        bucket_cap_mb: the buckets' cap, as ``lowcomm train --bucket-cap-mb``.
        threads: torch intra-op threads while measuring (restored afterwards); default the
            current setting.
        seed: the delta's values.
        progress: called with a one-line note as each entry ends (the CLI prints it; default:
            logged).

    Returns:
        ``{"threads", "bucket_cap_mb", "max_repeats", "budget_s", "rows"}``, one row per
        size, layout and codec (in that nesting, codecs innermost) with ``codec``, ``layout``,
        ``size_m``, ``parameters``, ``tensors``, ``buckets``, ``payload_bytes`` (this rank's
        compressed bytes), ``clone_s``, ``copy_s``, ``codec_s``, ``launch_s`` (add the
        residual, encode, error feedback, the collective), ``wait_s`` (decode), ``ratio``
        and ``ratio_to_copy`` (medians of each repeat's codec / clone and codec / copy),
        ``repeats`` (timed repeats) and ``elapsed_s``.

    Raises:
        ValueError: a bad setting (:func:`check_codec_settings`).
    """
    check_codec_settings(codecs, sizes_m, layouts=layouts, repeats=repeats, budget_s=budget_s)
    from lowcomm.bench.overhead import one_rank_group
    from lowcomm.comm import Communicator

    with one_rank_group(threads) as used_threads:
        comm = Communicator()
        if comm.world_size != 1:
            raise ValueError(
                f"the codec row times one rank's codec work: run it without a process group or "
                f"on one of one rank, not {comm.world_size}"
            )
        note = progress or (lambda text: logger.info("%s", text))
        rows = []
        for size in sizes_m:
            for layout in layouts:
                rows += _measure_size(
                    comm, codecs, size, layout, repeats, budget_s, bucket_cap_mb, seed, note
                )
    return {
        "threads": used_threads,
        "bucket_cap_mb": bucket_cap_mb,
        "max_repeats": repeats,
        "budget_s": budget_s,
        "rows": rows,
    }


def run_codec(
    *,
    out: str,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """``lowcomm bench --codec-only``: :func:`measure_codecs` with ``settings``, its results
    (:func:`~lowcomm.bench.results.assemble_codec_results`: the machine, the row's goal) with
    ``command`` and ``elapsed_s``, written to ``out`` as ``results.json`` and ``codec.md``;
    returns them."""
    from lowcomm.bench.report import write_codec_report
    from lowcomm.bench.results import assemble_codec_results

    t0 = time.perf_counter()
    results = assemble_codec_results(measure_codecs(**settings, progress=progress))
    results["command"] = command
    results["elapsed_s"] = time.perf_counter() - t0
    write_codec_report(results, out)
    return results


def _measure_size(
    comm: Any,
    codecs: Sequence[str],
    size_m: float,
    layout: str,
    repeats: int,
    budget_s: float,
    bucket_cap_mb: float,
    seed: int,
    note: Callable[[str], None],
) -> list[dict[str, Any]]:
    numel = round(size_m * 1e6)
    shapes = gpt_shapes(numel) if layout == "gpt" else single_shapes(numel)
    buckets = FlatBuckets(shapes, bucket_cap_mb=bucket_cap_mb)
    g = torch.Generator().manual_seed(seed)
    # a delta's scale; the quantisers' cost does not depend on the values, top-k's little
    delta = [torch.randn(b.numel(), generator=g).mul_(1e-3) for b in buckets.buffers]
    rows = []
    for spec in codecs:
        row = _measure_one(comm, spec, buckets, delta, size_m, layout, repeats, budget_s)
        note(
            f"codec {spec}, {size_m:g} M ({layout}, {row['tensors']} tensors): "
            f"{row['codec_s'] * 1e3:.1f} ms against a clone's {row['clone_s'] * 1e3:.2f} ms: "
            f"{row['ratio']:.1f}x"
        )
        rows.append(row)
    return rows


def _measure_one(
    comm: Any,
    spec: str,
    buckets: FlatBuckets,
    delta: list[torch.Tensor],
    size_m: float,
    layout: str,
    repeats: int,
    budget_s: float,
) -> dict[str, Any]:
    from lowcomm.compress import Compressor

    compressor = Compressor(spec, buckets.shapes, error_feedback=True)

    def codec_call() -> tuple[float, float]:
        torch._foreach_copy_(buckets.buffers, delta)  # the same delta every time, unclocked
        t0 = time.perf_counter()
        handle = comm.compressed_mean_async(buckets, compressor)
        t1 = time.perf_counter()
        handle.wait()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def clone_call() -> float:
        # the median of 3 in a row: what ran before (a codec freeing its temporaries) can leave
        # the allocator to fault fresh pages in for one clone, not for the next two
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            copies = [b.clone() for b in buckets.buffers]
            times.append(time.perf_counter() - t0)
            del copies
        return statistics.median(times)

    scratch = [torch.empty_like(b) for b in buckets.buffers]

    def copy_call() -> float:
        t0 = time.perf_counter()
        torch._foreach_copy_(scratch, buckets.buffers)
        return time.perf_counter() - t0

    start = time.perf_counter()
    codec_call()  # warm-up: the payload layout, the allocator, a residual to feed back
    clone_call()
    copy_call()
    clones: list[float] = []
    copies: list[float] = []
    launches: list[float] = []
    waits: list[float] = []
    for i in range(repeats):
        if i % 2 == 0:
            clones.append(clone_call())
            copies.append(copy_call())
            launch, wait = codec_call()
        else:
            launch, wait = codec_call()
            copies.append(copy_call())
            clones.append(clone_call())
        launches.append(launch)
        waits.append(wait)
        if time.perf_counter() - start > budget_s:
            break
    totals = [a + b for a, b in zip(launches, waits)]
    clone_s = statistics.median(clones)
    copy_s = statistics.median(copies)
    codec_s = statistics.median(totals)
    row: dict[str, Any] = {
        "codec": spec,
        "layout": layout,
        "size_m": size_m,
        "parameters": buckets.numel,
        "tensors": len(buckets.shapes),
        "buckets": len(buckets.buffers),
        "payload_bytes": compressor.wire_nbytes(),
        "clone_s": clone_s,
        "codec_s": codec_s,
        "launch_s": statistics.median(launches),
        "wait_s": statistics.median(waits),
        "ratio": _paired_ratio(totals, clones),
        "copy_s": copy_s,
        "ratio_to_copy": _paired_ratio(totals, copies),
        "repeats": len(totals),
        "elapsed_s": time.perf_counter() - start,
    }
    return row


def _paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median over repeats of one repeat's ratio: a repeat's calls run back to back, so a
    burst of other work on the machine that slows both cancels out."""
    return statistics.median(n / d if d > 0 else math.inf for n, d in zip(numerators, denominators))
