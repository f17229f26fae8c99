"""The outer hyperparameters of the ``lowcomm train`` job, derived from the registry and the
algorithms' dataclasses: which keys each ``--algo`` takes (each a flag and TOML key of the job,
held in :attr:`~.config.TrainConfig.outer`), the job's defaults, and each key's ``--help``
text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowcomm.hparams import public_fields
from lowcomm.outer.hparams import ShardableConfig
from lowcomm.registry import REGISTRY, AlgorithmEntry

__all__ = [
    "ALL_OUTER_KEYS",
    "COCODC_FULL_OVERLAP",
    "JOB_KEYS",
    "JOB_OUTER_DEFAULTS",
    "JOB_WARMUP_COMPRESSION",
    "OUTER_FIELDS",
    "OUTER_KEYS",
    "job_outer_defaults",
    "job_sync_warmup",
    "outer_doc",
    "sync_codec",
]

JOB_KEYS = ("sync_every", "bucket_cap_mb")
"""Algorithm keywords that are fields of the job itself (every algorithm gets them)."""

_TUNED_OUTER_SGD = {"outer_lr": 0.5, "outer_momentum": 0.9, "nesterov": True}
_STREAMED = {**_TUNED_OUTER_SGD, "num_fragments": 2, "overlap": 2}

JOB_OUTER_DEFAULTS: dict[str, dict[str, Any]] = {
    "co2": {**_TUNED_OUTER_SGD, "overlap": 1, "clip": "none", "gap_penalty": "none"},
    "co2-eager": {"outer_momentum": 0.0},
    "diloco": dict(_TUNED_OUTER_SGD),
    "streaming": dict(_STREAMED),
    "cocodc": dict(_STREAMED),
    "sparseloco": {
        "sync_warmup": 0,
        "outer_lr": 2.0,
        "error_decay": 0.8,
        "chunk": 8,
        "merge": "delay_corrected",
    },
}
"""Where this job's defaults differ from the library's (which stay the papers'), per ``--algo``,
chosen from the sweep in ``docs/studies/convergence.md`` (the 960-step job on 2 and 4 workers,
every job with the warm start of :func:`job_sync_warmup`):

* DiLoCo, Streaming DiLoCo, CoCoDC: outer lr 0.5 with Nesterov momentum 0.9 (best of 0.35, 0.5
  and 0.7 on 2 and on 4 workers). The papers' 0.7 was tuned for rounds of 500 steps and many
  more outer steps. The fragment methods sync 2 fragments in turn, each all-reduce hidden
  behind 2 inner steps.
* CO2: each round's all-reduce launched 1 step before the round ends and applied at its end
  (``overlap=1``: one step stale, not a whole round), with DiLoCo's tuned outer step and
  without the gap penalty and clipping, which were made for a whole round of staleness.
* CO2 with eager updates (which needs the whole round): outer momentum 0, plain α = 1.
* SparseLoCo: no warm start (the paper's). On 2 workers (seed 0) it ended 1.7% above DDP without
  one and 8.5% above with the job's int8 warm start of 240 steps, which would also cross the
  link every step and send more than all of its syncs. Outer lr 2 and accumulator decay 0.8,
  not the paper's 1 and 0.95: with no outer momentum the sparse step is too short for this
  job, and what stays unsent for rounds is stale (seed 1: the paper's settings ended 9.4% above
  DDP, α 1.5 4.1%, α 2 4.2%, α 2.5 6.5%, α 3 unstable early, α 2 with β 0.9 1.4%; β 0.99 and 1
  worse than 0.95); 4 workers want less memory still (seed 0: β 0.9 5.2%, 0.8 2.5%, 0.7 2.0%,
  0.6 2.7% above DDP) and 2 workers not (seed 1: β 0.8 0.2%, 0.7 2.9%), so 0.8. Tiles of
  16 × 16 (4 kept of each), not the paper's 64 × 64: 8-bit indices instead of 12, 1.4× fewer
  bytes, at no loss (seed 1, 2 workers: 0.6% above DDP against 1.4%). Over three seeds: 0.3%
  below DDP on 2 workers, 2.3% above on 4 (on another machine, whose kernels round otherwise,
  0.1% below and 3.0% above; ``docs/studies/slow-links.md``). The mean over the senders, not
  ``sender_power`` 1.5: 2.0% above DDP on 4 workers but 0.5% above on 2. Tiles of 8 × 8 (1 kept
  of each, 6-bit indices) with early rounds (:func:`job_early_rounds`): 2.4% below DDP on 2
  workers, 1.4% above on 4. The delay-corrected merge, for an overlap given or chosen from the
  link (blocking by default), keeps the τ steps: 1 and 2 steps in flight ended 1.6% and 1.5%
  above DDP on 4 workers, 2.1% and 0.6% below on 2.
"""


COCODC_FULL_OVERLAP: dict[str, Any] = {"lambda0": 0.5, "adaptive": False}
"""The job's CoCoDC at full overlap (``overlap`` = ``sync_every``, asked for by the user): delay
compensation λ₀ 0.5 instead of the paper's 0.2, and fragments in turn instead of by priority.
With a whole round in flight the correction carries the weight: in the study
(``docs/studies/slow-links.md``, 2 workers, 4 fragments, int4) λ₀ 0, 0.2, 0.5, 0.7 and 1.0
ended 20%, 11%, 6%, 5% and 7% above DDP on one seed, and 0.5 3.5% above it over three; picking
the fragment by priority ended where turns did (λ₀ 0.5: 1.457 against 1.466) but takes one
blocking all-reduce of the scores per sync point, a latency each on the slow links that need
full overlap."""

JOB_WARMUP_COMPRESSION = "int8"
"""This job's codec for the warm start's gradient all-reduce (``sync_warmup_compression``) for
every outer algorithm: a quarter of the bytes, so a warm step on an emulated 100 Mbit/s link
takes 159 ms instead of 351 (DDP's), at no measurable cost in loss (CO2, seed 1: 1.352 against
1.348 uncompressed). The library's default is fp32."""


def job_sync_warmup(steps: int, sync_every: int) -> int:
    """This job's default K (``sync_warmup``) for every outer algorithm: a quarter of the steps,
    rounded down to whole rounds (240 of the default 960; 0 for jobs under 4 rounds). The
    synchronous warm start was the largest single lever of the sweep; the library's default
    is 0 (no warm start)."""
    return steps // 4 // sync_every * sync_every


def job_early_rounds(steps: int, sync_every: int) -> dict[str, int]:
    """This job's early rounds for SparseLoCo: the first three eighths of the steps, in whole
    rounds (360 of the default 960), synced every H₀ steps, H₀ the largest divisor of H below H
    (6 of the default 12: two syncs a round); none where that is 1 (a prime H: a sync every
    step across the link) or the job is under 4 rounds.

    Without them the 4-worker job lagged DDP from the start (seed 0: 27% above it at step 60,
    11% at step 360) and ended 2.3% above it over three seeds; a warm start of 240 DDP steps
    took seed 0 to 0.8% but crosses the link every step, one of 48 steps to 1.7%. Rounds of 6
    steps for the first 240 (20 more syncs, which 8 × 8 tiles pay for) ended 1.8% above DDP
    over the three seeds on 4 workers and 1.8% below it on 2 (−0.3% without); rounds of 4 for
    the first 240 with 16 × 16 tiles 0.6% above on 4, but at 40 more syncs of a fifth more
    bytes each (762× fewer bytes per token than DDP, short of 1000×), and for the first 120
    with 8 × 8 tiles 2.0% above. The gap was widest where the first 240 ended (seed 0, 2 steps
    in flight: 7.9% above DDP at step 240, 6.2% at 360) and DDP's loss falls fastest until
    about step 400; rounds of 6 for the first 360 (30 more syncs: 1,004× fewer bytes per token
    than DDP on 4 workers) took the 4-worker job with 2 steps in flight from 2.4% to 1.5%
    above DDP over three seeds, blocking from 1.8% to 1.4%, and on 2 workers blocking from 1.8%
    to 2.4% below it (``docs/studies/slow-links.md``)."""
    h0 = max((d for d in range(1, sync_every) if sync_every % d == 0), default=1)
    if h0 == 1 or steps < 4 * sync_every:
        return {"early_steps": 0}
    return {"early_every": h0, "early_steps": steps * 3 // 8 // sync_every * sync_every}


def job_outer_defaults(
    algo: str,
    *,
    steps: int,
    sync_every: int,
    n_layer: int,
    fault_tolerance: bool = False,
    overlap: int | None = None,
    local_steps: str | None = None,
) -> dict[str, Any]:
    """The job's defaults for ``algo`` (:data:`JOB_OUTER_DEFAULTS` and :func:`job_sync_warmup`),
    fitted to the job's own settings so that a default never makes them invalid: for the
    fragment methods, 1 fragment where H is odd or the model has a single block, and an overlap
    below H (below H / fragments with ``fault_tolerance``; CO2's overlap of 1 fits every H).
    ``overlap``, the user's: CoCoDC at full overlap takes :data:`COCODC_FULL_OVERLAP`."""
    out: dict[str, Any] = {
        "sync_warmup": job_sync_warmup(steps, sync_every),
        "sync_warmup_compression": JOB_WARMUP_COMPRESSION,
        **JOB_OUTER_DEFAULTS.get(algo, {}),
    }
    if algo == "cocodc" and overlap == sync_every:
        out.update(COCODC_FULL_OVERLAP)
    if algo == "sparseloco":  # (rounds of fixed length, fewer steps in flight than H₀)
        early = job_early_rounds(steps, sync_every) if local_steps in (None, "fixed") else {}
        if not early.get("early_steps") or (overlap or 0) >= early["early_every"]:
            early = {"early_steps": 0}
        out.update(early)
    p = out.get("num_fragments")
    if p is not None:
        if sync_every % p or n_layer < p:
            out["num_fragments"] = 1
        # fewer steps in flight than H (elastic: than H / P, one sync in flight at a time)
        limit = sync_every // out["num_fragments"] if fault_tolerance else sync_every
        out["overlap"] = max(0, min(out["overlap"], limit - 1))
    return out


def sync_codec(algorithm: Any) -> str | None:
    """The codec spec of the outer syncs of a resolved algorithm ``Config``: its
    ``compression``, or the codec its own settings make (SparseLoCo's ``sparse:…``); ``None``:
    fp32 (or no outer algorithm)."""
    codec = getattr(algorithm, "compression", None)
    return None if codec is None else str(codec)


def outer_fields(entry: AlgorithmEntry) -> list[dataclasses.Field[Any]]:
    """The job fields of ``entry``: its class's public hyperparameters but the job's own and
    those a registered name fixes (``eager``: ``--algo co2-eager``), the keywords common to
    every algorithm last."""
    if entry.config is None:
        return []
    fixed = {k for e in REGISTRY.values() if e.cls is entry.cls for k in e.fixed}
    common = {f.name for f in dataclasses.fields(ShardableConfig)}
    keys = [f for f in public_fields(entry.config) if f.name not in (*JOB_KEYS, *fixed)]
    return sorted(keys, key=lambda f: f.name in common)


OUTER_KEYS: dict[str, tuple[str, ...]] = {
    name: ("compression",)
    if entry.cls is None and entry.compressible
    else tuple(f.name for f in outer_fields(entry))
    for name, entry in REGISTRY.items()
}
"""The outer-loop keywords each ``--algo`` takes (besides ``sync_every`` and ``bucket_cap_mb``),
from its algorithm's hyperparameter dataclass."""

OUTER_FIELDS: dict[str, dataclasses.Field[Any]] = {}
for _entry in REGISTRY.values():
    for _f in outer_fields(_entry):
        OUTER_FIELDS.setdefault(_f.name, _f)
ALL_OUTER_KEYS = tuple(OUTER_FIELDS)


def job_type(f: dataclasses.Field[Any]) -> str:
    """The annotation of a job field for an algorithm field (all may be None: unset)."""
    declared = f.metadata.get("job_type") or str(f.type)
    return declared if declared.endswith("None") else f"{declared} | None"


def outer_doc(key: str) -> str:
    """Help for an outer hyperparameter: its symbol and text from the algorithms' dataclasses
    and each algorithm's default (this job's where it differs)."""
    f = OUTER_FIELDS[key]
    symbol = f.metadata.get("symbol")
    text = f"{symbol}: {f.metadata['doc']}" if symbol else str(f.metadata["doc"])
    groups: dict[str, list[str]] = {}
    for name, entry in REGISTRY.items():
        if entry.config is None or key not in OUTER_KEYS[name]:
            continue
        library = entry.config.field(key).default
        job = JOB_OUTER_DEFAULTS.get(name, {}).get(key, library)
        if key == "sync_warmup":
            value = f"steps/4 in whole rounds in this job, library {library}"
        elif key == "sync_warmup_compression":
            value = f"{JOB_WARMUP_COMPRESSION} in this job (none: fp32), library {library}"
        elif job != library:
            value = f"{job} in this job, library {library}"
        else:
            value = f"{library}"
        if name == "cocodc" and key in COCODC_FULL_OVERLAP:
            value += f", {COCODC_FULL_OVERLAP[key]} in this job at overlap = sync_every"
        groups.setdefault(value, []).append(name)
    defaults = "; ".join(f"{', '.join(algos)} {value}" for value, algos in groups.items())
    return f"{text} (default: {defaults})"
