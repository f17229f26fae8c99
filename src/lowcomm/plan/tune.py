"""Sync settings chosen from the link: the codec and overlap τ that hide an outer algorithm's
syncs behind compute on the link a job runs over, with the least staleness, by the cost model of
:mod:`lowcomm.plan.cost` (``lowcomm train --tune-link``; :func:`choose_sync_settings` for your
own loop).

A sync of S bytes over bandwidth β takes about 8·S·c/β plus latency (c the codec's ratio); a
round takes H·t (t the inner step's compute). Overlap hides τ·t of it; the rest is waited. The
choice walks a ladder of settings, each rung costing more per token than the one before (the
study in ``docs/studies/slow-links.md``: codecs with error feedback cost nothing measurable,
each extra step of staleness more), and takes the first rung whose predicted step time is within
:data:`SLACK` of the compute alone (and, when the next rung only changes the codec, whose
syncs fit in :data:`HEADROOM` of the compute they overlap); when none hides the syncs, the rung
with the fastest predicted step (the earlier on a tie). A rung that would change a setting the
user gave is skipped: what is given always wins.

* CO2 (``overlap`` < H): fp32 τ 1, int8 τ 1, int4 τ 1, int2 τ 1, int4 τ 2; then staggered
  fragments (``num_fragments`` 4, a fragment synced every H/4 steps and in flight until the
  next sync point, τ = H/4): int4, int2; then one fragment again, int2 τ 2 and int2 τ 4 (for
  models of fewer than 4 blocks or H not a multiple of 4). Codecs with error feedback cost
  nothing measurable per token in the study; staleness does (τ 4 +1.6%, τ 2 +0.1%, τ 1 −1.5%
  against DDP with int4), far less when a quarter of the model is stale at a time (4 fragments,
  int4, 72-step int2 warm start: τ 3 −1.0%, τ 2 −0.6%);
* DiLoCo, SlowMo, LocalSGD (blocking): fp32, int8, int4, int2 — a codec shortens the wait,
  nothing hides it;
* Streaming DiLoCo, CoCoDC: fp32, int8, int4, int2 at the job's fragments and overlap.

The synchronous warm start averages gradients every step, unhidden; its codec follows the same
rule against :data:`WARM_SLACK`: int8 (the job's default), int4, then int2 (all three with error
feedback; in the study's 3 seeds int4 and int2 warm starts ended at or below int8's loss, while
PowerSGD rank 4 ended 11% above DDP's). Given the job's steps, its length is cut until what it
adds is at most :data:`WARM_BUDGET` of the job's compute, but not below
:data:`MIN_WARM_FRACTION` of the steps; where even that floor (or a length the user gave) adds
more than the budget, the codec goes on down the ladder to the first whose warm start fits
(else the cheapest): a slow machine's long steps let int8 pass the slack while one round of it
would cost twice the budget.

Compressed syncs travel by all-gather (every rank decodes every payload), fp32 ones by ring
all-reduce: the times are those of :class:`~lowcomm.plan.cost.Network` for each.

Example::

    link = LinkProfile.parse("10mbit")
    choice = choose_sync_settings("co2", link=link, workers=2, step_time_s=0.075,
                                  shapes=[p.shape for p in model.parameters()], sync_every=12)
    choice.settings   # {'compression': 'int4', 'overlap': 2, ...}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lowcomm.plan.cost import Algorithm, Network, Workload, step_time
from lowcomm.registry import REGISTRY

__all__ = [
    "HEADROOM",
    "SLACK",
    "WARM_SLACK",
    "LinkProfile",
    "SyncChoice",
    "choose_sync_settings",
    "sync_seconds",
]

SLACK = 0.1
"""A rung hides its syncs when its predicted step time is at most this much above the compute
(the study: a second step of staleness costs more per token than 10% of throughput)."""
HEADROOM = 0.9
"""An overlapped rung followed by a rung of another codec only (same τ and fragments: nothing
more per token) is taken only when its sync fits in this share of the compute it overlaps: the
model charges the link alone, not the codec's work or the CPU the collective takes from compute
on the same cores (on 100mbit an int8 sync predicted at 79 ms against 77 ms of compute counted
as hidden), and the next codec costs nothing to take."""
WARM_SLACK = 0.5
"""A warm-start codec is cheap enough when a warm step's all-reduce takes at most this fraction
of the step's compute."""
WARM_BUDGET = 0.03
"""The warm start is shortened until what its all-reduces add is at most this share of the
job's compute (3%, leaving room for the syncs' own waits under a 0.95 ceiling goal; the
100mbit job measured 0.947)…"""
MIN_WARM_FRACTION = 3 / 40
"""…but not below this share of the steps: the shortest warm start with which the default job
tuned for a slow link (int4 syncs in 4 staggered fragments, int2 warm start) ended below DDP's
loss in the study (72 of 960 steps: −1.0% over 3 seeds; 48 steps: +1.7%; no warm start +30%)."""

_CO2_LADDER: tuple[tuple[str | None, int, int], ...] = (
    # (codec, τ, P)
    (None, 1, 1),
    ("int8", 1, 1),
    ("int4", 1, 1),
    ("int2", 1, 1),
    ("int4", 2, 1),
    ("int4", 0, 4),  # τ 0 here: H/P, a fragment in flight until the next sync point
    ("int2", 0, 4),
    ("int2", 2, 1),
    ("int2", 4, 1),
)
_CODEC_LADDER: tuple[str | None, ...] = (None, "int8", "int4", "int2")
_WARM_LADDER: tuple[str, ...] = ("int8", "int4", "int2")


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """The link the outer syncs cross: bandwidth (bits/s per worker, each way), latency, and
    where the figures come from (``emulated`` links are charged as lowcomm's emulation charges
    them; a measured or named real link as a ring)."""

    bandwidth_bps: float
    latency_s: float
    source: str
    emulated: bool = False

    @classmethod
    def parse(cls, spec: str, *, emulated: bool = False) -> LinkProfile:
        """A link profile (``10mbit``) or ``RATE:LATENCY`` value, as ``--link`` takes it."""
        from lowcomm.link import EmulatedLink

        link = EmulatedLink.parse(spec)
        return cls(link.bandwidth_bps, link.latency_s, spec, emulated)

    def network(self) -> Network:
        return Network(
            bandwidth_bps=self.bandwidth_bps,
            latency_s=self.latency_s,
            cost="emulated" if self.emulated else "ring",
        )

    def describe(self) -> str:
        rate = self.bandwidth_bps
        unit = "Gbit/s" if rate >= 1e9 else "Mbit/s"
        value = rate / (1e9 if rate >= 1e9 else 1e6)
        shown = (
            f"{value:.0f}" if value >= 1000 else f"{value:.3g}"
        )  # no exponent: 33600, not 3.36e+04
        return f"{self.source} ({shown} {unit}, {self.latency_s * 1e3:.3g} ms)"


@dataclasses.dataclass(frozen=True)
class SyncChoice:
    """What :func:`choose_sync_settings` chose, and why."""

    settings: dict[str, Any]
    """The job settings to apply (``compression``, ``overlap``, ``sync_warmup_compression``);
    empty when nothing changes."""
    step_s: float
    """Predicted time of an inner step with them (compute plus what is waited)."""
    compute_s: float
    """The inner step's compute, t."""
    sync_s: float
    """Predicted time of one round's syncs on the link."""
    warm_step_s: float | None
    """Predicted time of a warm-start step (None: no warm start)."""
    hidden: bool
    """Whether the syncs hide behind compute within :data:`SLACK`."""
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _encoded_ratio(codec: str | None, shapes: Sequence[Sequence[int]]) -> float:
    """Wire bytes of ``codec`` over fp32 bytes for tensors of ``shapes`` (1 for fp32)."""
    if codec is None:
        return 1.0
    from lowcomm.compress.codecs import parse_codec

    c = parse_codec(codec)
    raw = sum(4 * math.prod(s) for s in shapes)
    return sum(c.wire_nbytes(tuple(s)) for s in shapes) / raw if raw else 1.0


def sync_seconds(
    codec: str | None, payload_bytes: float, workers: int, link: LinkProfile, ratio: float
) -> float:
    """One sync of ``payload_bytes`` (fp32) over ``workers``: a ring all-reduce in fp32, an
    all-gather of the encoded bytes (``ratio`` of them) with a codec."""
    net = link.network()
    if codec is None:
        return net.allreduce_time(payload_bytes, workers)
    return net.allgather_time(payload_bytes * ratio, workers)


class _CodecNetwork:
    """A :class:`~lowcomm.plan.cost.Network` whose all-reduces carry a codec's payload by
    all-gather (what a compressed sync does), for :func:`~lowcomm.plan.cost.step_time`."""

    def __init__(self, link: LinkProfile, codec: str | None, ratio: float) -> None:
        self.link, self.codec, self.ratio = link, codec, ratio
        self.net = link.network()

    def allreduce_time(self, payload_bytes: float, n: int) -> float:
        return sync_seconds(self.codec, payload_bytes, n, self.link, self.ratio)

    def allgather_time(self, payload_bytes: float, n: int) -> float:
        return self.net.allgather_time(payload_bytes, n)

    def exchange_time(self, payload_bytes: float, group: int) -> float:
        return self.net.exchange_time(payload_bytes, group)


def _rungs(algo: str, sync_every: int, max_fragments: int) -> list[dict[str, Any]]:
    """The ladder of ``algo`` as job settings (staggered rungs, each fragment H/P steps in
    flight, only where H splits into P fragments of more than one step and the model has P
    blocks)."""
    entry = REGISTRY[algo]
    schedule = entry.schedule
    if entry.fixed:  # co2-eager: its overlap is the whole round
        return []
    if schedule == "one-round-stale":
        return [
            {"compression": c, "overlap": tau or sync_every // p, "num_fragments": p}
            for c, tau, p in _CO2_LADDER
            if p == 1 or (p <= max_fragments and sync_every % p == 0 and sync_every // p > 1)
        ]
    if schedule in ("blocking", "fragments"):
        return [{"compression": c} for c in _CODEC_LADDER]
    return []


def _algorithm(algo: str, sync_every: int, settings: dict[str, Any]) -> Algorithm:
    schedule = REGISTRY[algo].schedule
    kwargs: dict[str, Any] = {"name": algo, "sync_every": sync_every}
    if schedule in ("one-round-stale", "fragments"):
        kwargs["overlap"] = int(settings.get("overlap") or 0)
        kwargs["num_fragments"] = int(settings.get("num_fragments") or 1)
    return Algorithm(**kwargs)


def choose_sync_settings(
    algo: str,
    *,
    link: LinkProfile,
    workers: int,
    step_time_s: float,
    shapes: Iterable[Sequence[int]],
    sync_every: int,
    current: dict[str, Any] | None = None,
    given: Iterable[str] = (),
    warm_steps: int = 0,
    steps: int | None = None,
    max_fragments: int = 1,
) -> SyncChoice:
    """The sync settings of ``algo`` for ``link`` (module docstring).

    Args:
        algo: the ``--algo`` name.
        link: the link the outer syncs cross.
        workers: N, the ranks in a sync.
        step_time_s: t, one inner step's compute (measured).
        shapes: the synchronised parameters' shapes.
        sync_every: H.
        current: the job's settings before the choice (its defaults: ``overlap``,
            ``num_fragments``, ``compression``, ``sync_warmup_compression``).
        given: settings the user gave (never changed).
        warm_steps: K, the warm start's steps (0: none).
        steps: the job's steps; with it, a warm start that would add more than
            :data:`WARM_BUDGET` of the job's compute is shortened (to no fewer than
            :data:`MIN_WARM_FRACTION` of the steps, in whole rounds), unless ``sync_warmup`` is
            given.
        max_fragments: the most fragments the model splits into (its transformer blocks): CO2's
            staggered rungs (4 fragments) need at least 4; 1 leaves them out.
    """
    current = dict(current or {})
    if REGISTRY[algo].schedule == "one-round-stale" and current.get("num_fragments") is None:
        current["num_fragments"] = 1  # CO2's default: one fragment
    given = set(given)
    shapes = [tuple(s) for s in shapes]
    payload = 4.0 * sum(math.prod(s) for s in shapes)
    if not (step_time_s > 0 and math.isfinite(step_time_s)):
        raise ValueError(f"step_time_s must be a finite number > 0, got {step_time_s!r}")
    work = Workload(parameters=max(1.0, payload / 4), tokens_per_step=1.0, step_time_s=step_time_s)
    best: tuple[float, dict[str, Any], Any] | None = None
    chosen: tuple[dict[str, Any], Any] | None = None
    rungs = _rungs(algo, sync_every, max_fragments)
    for i, rung in enumerate(rungs):
        if any(k in given and current.get(k) != v for k, v in rung.items()):
            continue  # it would change what the user gave
        if int(rung.get("overlap") or 0) >= sync_every:
            continue  # a whole round stale is another schedule (the paper's CO2), not a rung
        settings = {**current, **rung}
        codec = settings.get("compression")
        ratio = _encoded_ratio(codec, shapes)
        t = step_time(
            _algorithm(algo, sync_every, settings), work, _CodecNetwork(link, codec, ratio), workers
        )
        if best is None or t.step_s < best[0] - 1e-12:
            best = (t.step_s, rung, t)
        later = rungs[i + 1 :]
        free_next = bool(later) and all(
            later[0].get(k) == rung.get(k) for k in ("overlap", "num_fragments")
        )
        if t.step_s <= (1 + SLACK) * step_time_s and (
            not free_next or _fits(settings, t.comm_s * sync_every, step_time_s)
        ):
            chosen = (rung, t)
            break
    if best is None:
        return SyncChoice({}, step_time_s, step_time_s, 0.0, None, True, f"{algo}: not tuned")
    hidden = chosen is not None
    rung, timing = chosen if chosen is not None else (best[1], best[2])
    settings = {k: v for k, v in rung.items() if current.get(k) != v}
    warm_s: float | None = None
    if warm_steps > 0:
        warm_codec, warm_s = _warm_choice(
            current.get("sync_warmup_compression"),
            "sync_warmup_compression" in given,
            payload,
            shapes,
            workers,
            link,
            step_time_s,
        )
        if steps is not None:
            n_steps = steps

            def length(extra_s: float) -> int:  # the warm start's steps at ``extra_s`` a step
                if "sync_warmup" in given:
                    return warm_steps
                return _warm_length(warm_steps, n_steps, sync_every, extra_s, step_time_s)

            k = length(warm_s - step_time_s)
            if "sync_warmup_compression" not in given:
                warm_codec, warm_s, k = _warm_within_budget(
                    warm_codec,
                    warm_s,
                    k,
                    lambda c: _warm_step_s(c, payload, shapes, workers, link, step_time_s),
                    length,
                    WARM_BUDGET * steps * step_time_s,
                    step_time_s,
                )
            if k != warm_steps:
                settings["sync_warmup"] = k
        if warm_codec != current.get("sync_warmup_compression"):
            settings["sync_warmup_compression"] = warm_codec
    round_sync = timing.comm_s * sync_every
    what = ", ".join(f"{k} {v if v is not None else 'none'}" for k, v in rung.items())
    reason = (
        f"{what}: a round's syncs {round_sync:.3g} s against {sync_every} x {step_time_s * 1e3:.3g}"
        f" ms of compute, "
        + ("hidden" if hidden else f"not hidden by any setting (fastest: {what})")
    )
    return SyncChoice(settings, timing.step_s, step_time_s, round_sync, warm_s, hidden, reason)


def _fits(settings: dict[str, Any], round_sync_s: float, step_s: float) -> bool:
    """Whether each sync of an overlapped rung fits in :data:`HEADROOM` of the τ steps of
    compute it overlaps (a blocking rung, τ 0, always passes: nothing hides its sync)."""
    tau = int(settings.get("overlap") or 0)
    p = int(settings.get("num_fragments") or 1)
    if tau == 0:
        return True
    return round_sync_s / p <= HEADROOM * tau * step_s


def _warm_length(k: int, steps: int, h: int, extra_s: float, step_s: float) -> int:
    """The warm start's steps: ``k``, or fewer (whole rounds) so that its ``extra_s`` a step
    adds at most :data:`WARM_BUDGET` of ``steps`` steps' compute, but no fewer than
    :data:`MIN_WARM_FRACTION` of the steps (at least one round)."""
    if extra_s <= 0:
        return k
    budget = int(WARM_BUDGET * steps * step_s / extra_s) // h * h
    floor = max(h, int(MIN_WARM_FRACTION * steps) // h * h)
    return min(k, max(budget, floor))


def _warm_within_budget(
    codec: str | None,
    warm_s: float,
    k: int,
    warm_step: Callable[[str | None], float],
    length: Callable[[float], int],
    budget_s: float,
    step_s: float,
) -> tuple[str | None, float, int]:
    """The warm start's codec, step time and length once its cost is held to ``budget_s``:
    when ``k`` warm steps of ``codec`` add more than the budget (its length is at its floor, or
    given), the next codec of the ladder whose warm start (of ``length(extra)`` steps) fits,
    else the cheapest. With error feedback a cheaper codec costs nothing measurable per token
    (the study: int4 and int2 warm starts ended at or below int8's loss), while the warm start's
    all-reduces are waited in full."""
    if k * (warm_s - step_s) <= budget_s or codec not in _WARM_LADDER:
        return codec, warm_s, k
    best = (warm_s, codec, k)
    for cheaper in _WARM_LADDER[_WARM_LADDER.index(codec) + 1 :]:
        seconds = warm_step(cheaper)
        n = length(seconds - step_s)
        if seconds < best[0]:
            best = (seconds, cheaper, n)
        if n * (seconds - step_s) <= budget_s:
            return cheaper, seconds, n
    return best[1], best[0], best[2]


def _warm_step_s(
    codec: str | None,
    payload: float,
    shapes: Sequence[Sequence[int]],
    workers: int,
    link: LinkProfile,
    step_time_s: float,
) -> float:
    """A warm step's predicted time with ``codec``: the compute and the all-reduce after it."""
    ratio = _encoded_ratio(codec, shapes)
    return step_time_s + sync_seconds(codec, payload, workers, link, ratio)


def _warm_choice(
    current: str | None,
    given: bool,
    payload: float,
    shapes: Sequence[Sequence[int]],
    workers: int,
    link: LinkProfile,
    step_time_s: float,
) -> tuple[str | None, float]:
    """The warm start's codec (the given one, else the first of the ladder whose all-reduce
    takes at most :data:`WARM_SLACK` of a step's compute, else the cheapest) and its predicted
    step time."""

    def warm_step(codec: str | None) -> float:
        return _warm_step_s(codec, payload, shapes, workers, link, step_time_s)

    if given:
        return current, warm_step(current)
    ladder = list(_WARM_LADDER)
    if current is not None and current not in ladder:
        ladder.insert(0, current)
    timed = [(warm_step(c), c) for c in ladder]
    for seconds, codec in timed:
        if seconds - step_time_s <= WARM_SLACK * step_time_s:
            return codec, seconds
    seconds, codec = min(timed, key=lambda x: x[0])
    return codec, seconds
