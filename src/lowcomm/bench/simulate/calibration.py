"""Calibration of ``lowcomm simulate`` against ``lowcomm bench``: each measured cell of a
``results.json`` beside the model's prediction for it (:func:`calibrate`), and a scenario that
projects the bench's own setup to many workers (:func:`scenario_from_results`).

The prediction charges the cell's emulated link as lowcomm's link emulation does
(:func:`~lowcomm.bench.simulate.model.emulated_allreduce_time`) and takes the compute time from the
no-sync ceiling measured in the same run.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lowcomm.bench.simulate.model import (
    ALGORITHMS,
    Algorithm,
    Network,
    Scenario,
    Workload,
    step_time,
)
from lowcomm.registry import REGISTRY
from lowcomm.schedules import FRAGMENTS

__all__ = ["CalibrationRow", "calibrate", "load_results", "scenario_from_results"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationRow:
    """A ``lowcomm bench`` cell beside the model's prediction for it."""

    algo: str
    workers: int
    link: str | None
    sync_every: int
    num_fragments: int | None
    overlap: int | None
    compute_s: float
    """t_c: the step time of the no-sync cell with the same worker count."""
    payload_bytes: float
    """Bytes per worker per full synchronisation used for the prediction."""
    measured_step_s: float
    predicted_step_s: float
    measured_tokens_per_s: float
    predicted_tokens_per_s: float
    ratio: float
    """predicted / measured throughput."""
    measured_hidden_fraction: float | None
    predicted_hidden_fraction: float | None
    note: str


def load_results(path: str) -> dict[str, Any]:
    """Read a ``lowcomm bench`` results file; ValueError naming the file when it cannot be used."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ValueError(
            f"results file {path!r} cannot be read ({e.strerror or e}); pass the results.json "
            "written by lowcomm bench"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"results file {path!r} is not JSON ({e.msg} at line {e.lineno}); pass the "
            "results.json written by lowcomm bench"
        ) from None
    _check_results(data, path)
    return data


def _check_results(data: Any, source: str) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise ValueError(
            f"results file {source!r} has no 'cells' list; pass the results.json written by "
            "lowcomm bench"
        )
    for i, cell in enumerate(data["cells"]):
        if not isinstance(cell, dict):
            raise ValueError(f"results file {source!r}: cell {i} is not an object")
        for key in ("algo", "workers", "tokens_per_s", "step_time_s"):
            if key not in cell or cell[key] is None:
                raise ValueError(
                    f"results file {source!r}: cell {i} has no {key!r}; re-run lowcomm bench"
                )
        n = cell["workers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"results file {source!r}: cell {i} has workers={n!r}; it must be an integer >= 1"
            )
        for key in ("tokens_per_s", "step_time_s"):
            v = cell[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(
                    f"results file {source!r}: cell {i} has {key}={v!r}; it must be a number > 0"
                )


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _cell_algorithm(cell: Mapping[str, Any], settings: Mapping[str, Any]) -> Algorithm:
    name = str(cell["algo"])
    if name not in ALGORITHMS:
        raise ValueError(
            f"results cell algo {name!r} is not one the model knows ({', '.join(ALGORITHMS)})"
        )
    if not REGISTRY[name].is_outer:
        return Algorithm(name=name)
    h = _opt_int(cell.get("sync_every")) or _opt_int(settings.get("sync_every")) or 1
    if REGISTRY[name].schedule is FRAGMENTS:
        p = _opt_int(cell.get("num_fragments")) or 1
        tau = _opt_int(cell.get("overlap")) or 0
        return Algorithm(name=name, sync_every=h, num_fragments=p, overlap=tau)
    return Algorithm(name=name, sync_every=h)


def _known_algorithm(cell: Mapping[str, Any], settings: Mapping[str, Any]) -> Algorithm | None:
    try:
        return _cell_algorithm(cell, settings)
    except ValueError as e:
        logger.warning("results cell skipped: %s", e)
        return None


def _is_ceiling(cell: Mapping[str, Any]) -> bool:
    """Whether ``cell`` measured the algorithm that never synchronises (the no-sync ceiling)."""
    entry = REGISTRY.get(str(cell["algo"]))
    return entry is not None and not entry.schedule.syncs


def _cell_network(cell: Mapping[str, Any]) -> Network | None:
    bw = cell.get("link_bandwidth_bps")
    if not isinstance(bw, int | float) or isinstance(bw, bool) or not bw > 0:
        return None
    lat = cell.get("link_latency_s")
    lat = float(lat) if isinstance(lat, int | float) and not isinstance(lat, bool) else 0.0
    return Network(bandwidth_bps=float(bw), latency_s=lat, cost="emulated")


_FREE = Network(bandwidth_bps=math.inf, latency_s=0.0, cost="emulated")


def calibrate(results: Mapping[str, Any], *, source: str = "results") -> list[CalibrationRow]:
    """Predict every synchronising cell of a ``lowcomm bench`` results file and compare.

    For each cell: t_c is the step time of the no-sync ceiling measured in the cell's own
    processes (``ceiling_tokens_per_s``), else of the ``none`` cell with the same worker count;
    the payload is the measured payload per worker step × the sync period (else parameters ×
    4); the link is the cell's emulated link, charged as
    :func:`emulated_allreduce_time`; DDP gets no overlap with backward (lowcomm's emulated DDP
    charges each bucket from its launch, and a model of one or two buckets launches its last
    when backward has finished). The predicted throughput is the ceiling's measured throughput ×
    t_c / predicted step time, so it is in the results file's own units. A cell without a link
    is predicted with free communication (noted); one without a ceiling, or with an algorithm
    the model does not know, is skipped with a warning.
    """
    _check_results(results, source)
    settings = results.get("settings") or {}
    model = results.get("model") or {}
    params = model.get("parameters") if isinstance(model, dict) else None
    cells = results["cells"]
    ceilings = {c["workers"]: c for c in cells if _is_ceiling(c)}
    rows: list[CalibrationRow] = []
    for cell in cells:
        if _is_ceiling(cell):
            continue
        algo = _known_algorithm(cell, settings)
        if algo is None:
            continue
        n = int(cell["workers"])
        notes: list[str] = []
        ceiling = ceilings.get(n)
        if isinstance(cell.get("ceiling_tokens_per_s"), int | float):
            # the ceiling measured inside the cell's own processes (lowcomm bench)
            ceiling_thr = float(cell["ceiling_tokens_per_s"])
            t_c = float(cell["tokens_per_s"]) * float(cell["step_time_s"]) / ceiling_thr
        elif ceiling is not None:
            t_c = float(ceiling["step_time_s"])
            ceiling_thr = float(ceiling["tokens_per_s"])
            notes.append("t_c from the none cell")
        else:
            logger.warning(
                "cell %s on %d workers has no no-sync ceiling cell: skipped", algo.label, n
            )
            continue
        per_step = cell.get("payload_bytes_per_worker_step")
        if isinstance(per_step, int | float) and not isinstance(per_step, bool) and per_step > 0:
            payload = float(per_step) * algo.period
        elif isinstance(params, int | float) and params > 0:
            payload = float(params) * 4.0
            notes.append("payload = parameters × 4")
        else:
            raise ValueError(
                f"results file {source!r}: cell {algo.label} on {n} workers has no "
                "payload_bytes_per_worker_step and the file no model.parameters"
            )
        network = _cell_network(cell)
        if network is None:
            network = _FREE
            notes.append("no emulated link: communication taken as free")
        workload = Workload(
            parameters=float(params) if isinstance(params, int | float) and params > 0 else 1.0,
            tokens_per_step=1.0,
            step_time_s=t_c,
            payload_bytes=payload,
            backward_fraction=0.0,
        )
        st = step_time(algo, workload, network, n)
        predicted = ceiling_thr * t_c / st.step_s
        measured = float(cell["tokens_per_s"])
        hidden = cell.get("hidden_fraction")
        rows.append(
            CalibrationRow(
                algo=algo.label,
                workers=n,
                link=cell.get("link"),
                sync_every=algo.period,
                num_fragments=algo.num_fragments if algo.schedule is FRAGMENTS else None,
                overlap=algo.overlap if algo.schedule is FRAGMENTS else None,
                compute_s=t_c,
                payload_bytes=payload,
                measured_step_s=float(cell["step_time_s"]),
                predicted_step_s=st.step_s,
                measured_tokens_per_s=measured,
                predicted_tokens_per_s=predicted,
                ratio=predicted / measured,
                measured_hidden_fraction=float(hidden) if isinstance(hidden, int | float) else None,
                predicted_hidden_fraction=st.hidden_fraction,
                note="; ".join(notes),
            )
        )
    return rows


def scenario_from_results(results: Mapping[str, Any], *, source: str = "results") -> Scenario:
    """A scenario for this machine: the bench's model, compute time and emulated link.

    t_c and tokens per worker step come from the no-sync ceiling with the fewest workers: the
    ``none`` cell, else the median of the ceilings measured inside the cells (tokens/s are totals
    over workers); the link is the slowest emulated link of the cells; the algorithms are those
    of the cells. Workers are assumed to keep their own compute as N grows (on this machine they
    share its cores).
    """
    _check_results(results, source)
    cells = results["cells"]
    nones = sorted((c for c in cells if _is_ceiling(c)), key=lambda c: c["workers"])
    with_ceiling = sorted(
        (c for c in cells if isinstance(c.get("ceiling_tokens_per_s"), int | float)),
        key=lambda c: c["workers"],
    )
    if nones:
        ceiling = nones[0]
        t_c = float(ceiling["step_time_s"])
        tokens = float(ceiling["tokens_per_s"]) * t_c / int(ceiling["workers"])
    elif with_ceiling:
        fewest = with_ceiling[0]["workers"]
        same = [c for c in with_ceiling if c["workers"] == fewest]
        ceiling = {"workers": fewest}
        per_step = float(same[0]["tokens_per_s"]) * float(same[0]["step_time_s"])
        ceiling_thr = statistics.median(float(c["ceiling_tokens_per_s"]) for c in same)
        t_c = per_step / ceiling_thr
        tokens = per_step / int(fewest)
    else:
        raise ValueError(
            f"results file {source!r} has no no-sync ceiling (a 'none' cell or cells with "
            "ceiling_tokens_per_s) to take the compute time from; re-run lowcomm bench, or pass "
            "--step-time"
        )
    model = results.get("model") or {}
    params = model.get("parameters") if isinstance(model, dict) else None
    if not isinstance(params, int | float) or isinstance(params, bool) or not params > 0:
        raise ValueError(f"results file {source!r} has no model.parameters; re-run lowcomm bench")
    # the slowest emulated link of the bench: where the algorithms differ most
    networks = [net for c in cells if (net := _cell_network(c)) is not None]
    network = min(networks, key=lambda net: net.bandwidth_bps) if networks else None
    if network is None:
        raise ValueError(
            f"results file {source!r} has no cell with an emulated link; pass --bandwidth"
        )
    settings = results.get("settings") or {}
    algos: list[Algorithm] = []
    for c in cells:
        a = None if _is_ceiling(c) else _known_algorithm(c, settings)
        if a is not None and a not in algos:
            algos.append(a)
    if not algos:
        algos = [Algorithm(name="ddp")]
    return Scenario(
        name="this-machine",
        workload=Workload(
            parameters=float(params),
            tokens_per_step=tokens,
            step_time_s=t_c,
            bytes_per_param=4.0,
            backward_fraction=0.0,
        ),
        network=network,
        algorithms=tuple(algos),
        notes=(
            "Projection, not a measurement: the bench's model and measured compute time on this "
            "machine, every worker assumed to have its own compute, the emulated link's cost "
            "(latency once per collective + ring wire bytes / bandwidth).",
            f"t_c = {t_c:.4g} s per step ({tokens:g} tokens per worker step) from the no-sync cell "
            f"on {ceiling['workers']} workers; {params:g} parameters, fp32 payloads; DDP without "
            "overlap, as lowcomm's emulated DDP.",
        ),
        sources=(source,),
    )
