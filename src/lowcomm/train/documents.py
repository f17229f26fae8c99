"""Documents mode of ``lowcomm train`` (``--documents``): whole documents, balanced across ranks.

Every rank fits the cost model at start-up (all ranks time the same shapes together, and fit
the mean of their times, so every rank plans with the same model), then each step trains on
its :class:`~lowcomm.balance.DocumentStream` micro-batches. With DDP the micro-batches run
under ``no_sync`` and the gradient all-reduce is started once this rank's compute is done (a
one-token backward whose gradient is zero), so the compute time measured is the compute
alone; with ``busy_wait`` the ranks meet at a polling barrier before and after their compute.
An outer algorithm's ranks meet once a round, and the plan balances the round. A list of
assignments (``--balance random,cost``) is taken in turn per step or round, so that they are
measured side by side on the same machine at the same time.

With the timed cost model the fit is refitted online (``cost_refit`` units, :class:`~lowcomm.
balance.OnlineRefit`): at the end of every plan unit the ranks all-reduce a table of every
rank's summed micro-batch features and compute time, and every rank fits the same model from
the same rows (the start-up timings and the last units), which plans the next unit.

Each rank records per step its compute time, the cost model's prediction and its tokens;
:meth:`DocumentJob.report` turns every rank's records into ``balance.json``: per plan unit
(step or round) each rank's compute time ``t_r``, the straggler wait ``max_j t_j - t_r``, the
idle fraction ``sum_r (max t - t_r) / (R max t)``, the unit's wall time and the cost model's
error ``|predicted - measured| / measured`` (and the same with the prediction scaled by the
previous unit's measured / predicted ratio: the device's speed tracked, for a shared machine
whose speed drifts); and the same aggregated per assignment (the
first unit of each left out: start-up), with tokens per second = tokens per unit / mean wall
time of a unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.balance import (
    CostFit,
    CostModel,
    DocumentCorpus,
    DocumentStream,
    LinkTier,
    OnlineRefit,
    RingAttention,
    SplitPolicy,
    analytic_cost_model,
    features,
    measure_cost_model,
    parse_assignments,
    remapped_loss,
    zigzag_positions,
    zigzag_sizes,
    zigzag_take,
)
from lowcomm.balance.stream import StepWork
from lowcomm.comm import spin_barrier
from lowcomm.device import collective_device, device_clock
from lowcomm.link import EmulatedLink
from lowcomm.models.gpt import Packed
from lowcomm.registry import BASELINES
from lowcomm.train.config import TrainConfig

__all__ = ["DocumentJob", "val_micro_batches"]

logger = logging.getLogger(__name__)

_WARMUP_UNITS = 1
"""Plan units left out of the aggregates (start-up: allocations, first-touch)."""


def val_micro_batches(
    corpus: DocumentCorpus, cap: int, count: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor, Packed]]:
    """The validation documents (the first ``cap + 1`` tokens of each), packed in order into
    ``count`` micro-batches of at most ``cap`` tokens (fewer when the documents run out)."""
    out: list[tuple[torch.Tensor, torch.Tensor, Packed]] = []
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []

    def flush() -> None:
        lengths = [len(x) for x in xs]
        x, y = torch.cat(xs)[None].to(device), torch.cat(ys)[None].to(device)
        out.append((x, y, Packed(lengths=lengths)))
        xs.clear()
        ys.clear()

    for doc in corpus.val:
        piece = doc[: cap + 1]
        if xs and sum(len(x) for x in xs) + len(piece) - 1 > cap:
            flush()
            if len(out) == count:
                return out
        xs.append(piece[:-1])
        ys.append(piece[1:])
    if xs:
        flush()
    return out


def _split_policy(cfg: TrainConfig) -> SplitPolicy:
    link = None
    if cfg.link is not None:
        emulated = EmulatedLink.parse(cfg.link)
        link = LinkTier(emulated.bandwidth_bps, emulated.latency_s, name=f"{cfg.link} link")
    kv = 2 * cfg.n_embd * cfg.n_layer * 4  # fp32 keys and values, every layer
    if cfg.nodes > 1:
        return SplitPolicy(
            kv_bytes_per_token=kv,
            layers=cfg.n_layer,
            node_size=cfg.procs_per_node,
            intra=LinkTier(name="intra-node"),
            inter=link or LinkTier(name="inter-node"),
        )
    return SplitPolicy(
        kv_bytes_per_token=kv, layers=cfg.n_layer, intra=link or LinkTier(name="local")
    )


def _mean_over_ranks(times: list[float]) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


class DocumentJob:
    """One rank's documents: the cost model, the stream, the step and the records."""

    def __init__(
        self,
        cfg: TrainConfig,
        corpus: DocumentCorpus,
        gpt: nn.Module,
        *,
        device: torch.device,
        state: dict[str, Any] | None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fit: CostFit | None = None
        if state is not None and state.get("cost_model") is not None:
            self.cost = CostModel(**state["cost_model"])  # plan exactly as before the stop
        elif cfg.cost_model == "fit":
            self.fit = measure_cost_model(
                gpt,
                cfg.block_size,
                vocab_size=corpus.vocab_size,
                device=device,
                between=spin_barrier,
                combine=_mean_over_ranks,
            )
            self.cost = self.fit.model
        else:
            self.cost = analytic_cost_model(n_layer=cfg.n_layer, n_embd=cfg.n_embd)
        self.assignments = parse_assignments(cfg.balance)
        split = _split_policy(cfg) if "cost+split" in self.assignments else None
        self.ring_group = dist.new_group() if split is not None else None
        # the remapping's all-to-alls get a group that carries nothing else
        self.remap_group = dist.new_group() if "remap" in self.assignments else None
        restored = state is not None and state.get("cost_model") is not None
        if split is not None and cfg.cost_model == "fit" and not restored and self.world > 1:
            factor = self._split_factor(gpt, cfg.block_size)
            self.cost = dataclasses.replace(self.cost, split_factor=factor)
        self.unit_steps = 1 if cfg.algo in BASELINES else cfg.sync_every
        tokens = cfg.batch_size * cfg.block_size
        exchange = None
        if self.remap_group is not None and cfg.cost_model == "fit" and self.world > 1:
            exchange = self._exchange_rate(tokens, cfg.n_embd, cfg.n_layer)
        self.stream = DocumentStream(
            corpus,
            cap=cfg.block_size,
            tokens_per_step=tokens,
            steps_per_unit=self.unit_steps,
            seed=cfg.seed,
            strategy=self.assignments,
            paired=cfg.balance_paired,
            method=cfg.balance_method,
            token_cap=cfg.token_cap if cfg.token_cap is not None else 2 * tokens,
            cost=self.cost,
            split=split,
            ring_group=self.ring_group,
            device=device,
            exchange_s_per_token=exchange,
        )
        if state is not None:
            self.stream.load_state_dict(state["stream"])
        # the online refit (timed cost models only: an analytic one stays what it is)
        self.refit: OnlineRefit | None = None
        if cfg.cost_model == "fit" and cfg.cost_refit > 0:
            self.refit = OnlineRefit(
                self.fit.samples if self.fit is not None else (), window=cfg.cost_refit
            )
            if state is not None and state.get("refit") is not None:
                self.refit.load_state_dict(state["refit"])
        self._unit_row = [0.0, 0.0, 0.0, 0.0]
        self._unit_s = 0.0
        self.last_error: float | None = None
        """RMS over the ranks of the cost model's relative error on the last unit (before it
        was refitted with it: a held-out error)."""
        self.records: list[dict[str, Any]] = []
        self.plans: dict[int, dict[str, Any]] = {}
        self._last_loss = torch.zeros((), device=device)
        self._dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._clock = device_clock(device)
        """Times compute on the device (the records and the refit of the cost model)."""

    def _exchange_rate(self, tokens: int, width: int, layers: int, repeats: int = 3) -> float:
        """``remap``'s exchange, timed on this job's processes: one all-to-all of a step's
        tokens at 4 x width (a layer's queries, keys, values and output), the median of
        ``repeats``, times 2 x layers (forward and backward), per token; the mean over ranks,
        so every rank decides with the same rate."""
        from lowcomm.balance.remap import all_to_all

        rows = max(self.world, tokens - tokens % self.world)
        x = torch.zeros((rows, 4 * width), device=self.device)
        splits = [rows // self.world] * self.world
        times = []
        clock = device_clock(self.device)
        for _ in range(repeats + 1):
            spin_barrier()
            t0 = clock()
            all_to_all(x, splits, splits, self.remap_group)
            times.append(clock() - t0)
        rate = statistics.median(times[1:]) * 2 * layers / rows
        mean = torch.tensor([rate], dtype=torch.float64, device=collective_device())
        dist.all_reduce(mean)
        value = float(mean) / self.world
        logger.debug("remap exchanges: %.3g s per token and step", value)
        return value

    def _split_factor(self, gpt: nn.Module, length: int, repeats: int = 3) -> float:
        """Time one ``length``-token document split over pairs of ranks (0 and 1, 2 and 3, ...;
        an odd last rank only keeps pace) against the cost model's ideal share: the mean ratio
        over ranks, at least 1."""
        partner = self.rank ^ 1
        ratio = torch.zeros(2, dtype=torch.float64, device=collective_device())
        ring = None
        if partner < self.world:
            pair = sorted((self.rank, partner))
            index = pair.index(self.rank)
            sizes = zigzag_sizes(length, 2)
            ring = RingAttention(self.ring_group, ranks=pair, index=index, sizes=sizes)
            gen = torch.Generator().manual_seed(0)
            x = zigzag_take(torch.randint(256, (length,), generator=gen), sizes, index)[None]
            x = x.to(self.device)
            packed = Packed(
                lengths=[x.shape[1]], positions=zigzag_positions(sizes, index), split=ring
            )
        times = []
        clock = device_clock(self.device)
        for i in range(repeats + 1):
            spin_barrier()
            if ring is None:
                continue
            t0 = clock()
            _, loss = gpt(x, x, packed=packed, reduction="sum")
            loss.backward()
            if i:
                times.append(clock() - t0)
        gpt.zero_grad(set_to_none=True)
        if times:
            ideal = self.cost.c0 + self.cost.split_piece(length, 2)
            ratio += torch.tensor(
                [statistics.median(times) / ideal, 1.0], dtype=torch.float64, device=ratio.device
            )
        dist.all_reduce(ratio)
        factor = max(1.0, float(ratio[0] / ratio[1]))
        logger.debug("split documents cost %.2fx their ideal share", factor)
        return factor

    def step(self, model: nn.Module, *, ddp: bool) -> torch.Tensor:
        """Forward and backward of this rank's documents for one step (gradients averaged
        over ranks for DDP); returns this rank's mean token loss, for the records."""
        work = self.stream.next_step()
        digest = cost_digest = None
        if work.first_of_unit:
            # every rank's copy of the plan, to check in the report that they are one plan
            whole = [[(p.doc, p.ranks, p.index) for p in pieces] for pieces in work.plan.assignment]
            digest = hashlib.blake2b(repr(whole).encode(), digest_size=8).hexdigest()
            coefs = repr(sorted(self.cost.as_dict().items()))
            cost_digest = hashlib.blake2b(coefs.encode(), digest_size=8).hexdigest()
            self.plans[work.unit] = {
                "assignment": work.assignment,
                "ratio": work.plan.ratio,
                "method": work.plan.method,
                "splits": [(d.k, d.tier, d.refused) for d in work.plan.splits],
                "t_start": time.perf_counter(),
            }
        scale = self.stream.loss_scale()
        total = torch.zeros((), device=self.device)
        if ddp and self.cfg.busy_wait:
            # start together: a rank let out of the last step's all-reduce early (an emulated
            # link's sleep ends by each rank's own clock) would compute alone on a shared CPU
            spin_barrier()
        t0 = self._clock()
        no_sync = model.no_sync() if ddp else contextlib.nullcontext()  # type: ignore[operator]
        with no_sync:
            for mb in work.micro_batches:
                _, loss = model(mb.x, mb.y, packed=mb.packed, reduction="sum")
                (loss * scale).backward()
                total += loss.detach()
            if work.remap is not None:
                gpt = model.module if ddp else model
                loss = remapped_loss(
                    gpt,  # type: ignore[arg-type]
                    work.remap.x,
                    work.remap.y,
                    work.remap.remap,
                    group=self.remap_group,
                )
                (loss * scale).backward()
                total += loss.detach()
        compute = self._clock() - t0
        if self.refit is not None:  # the unit's row for the online refit
            self._add_row(work, compute)
        wait = 0.0
        if ddp:
            t1 = time.perf_counter()
            if self.cfg.busy_wait:
                spin_barrier()
            wait = time.perf_counter() - t1
            # start the all-reduce of the accumulated gradients: a zero-weighted backward
            _, loss = model(self._dummy, self._dummy, reduction="sum")
            (loss * 0.0).backward()
        self.records.append(
            {
                "unit": work.unit,
                "compute_s": compute,
                "predicted_s": work.predicted_s,
                "tokens": work.tokens,
                "barrier_s": wait,
                "plan_digest": digest,
                "cost_digest": cost_digest,
            }
        )
        if work.tokens:
            self._last_loss = total / work.tokens
        return self._last_loss

    def _add_row(self, work: StepWork, compute: float) -> None:
        """Add a step's summed micro-batch features and compute time to the unit's row."""
        rows = [
            features(mb.lengths, split_k=mb.split_k, split_factor=self.cost.split_factor)
            for mb in work.micro_batches
        ]
        if work.remap is not None:
            # its run's tokens through the linear layers, its documents' attention
            mine = work.remap.remap.attention_lengths()
            rows.append(
                [1.0, float(len(mine)), float(work.tokens), float(sum(n * n for n in mine))]
            )
        for row in rows:
            self._unit_row = [u + f for u, f in zip(self._unit_row, row, strict=True)]
        self._unit_s += compute

    def unit_done(self, unit_end: bool) -> None:
        """Call after the step's synchronisation (every rank at the same step): stamps the end
        of a plan unit, and at its end refits the cost model with what every rank measured."""
        if not unit_end:
            return
        if self.plans:
            last = max(self.plans)
            self.plans[last].setdefault("t_end", time.perf_counter())
        if self.refit is None:
            return
        rows = self._exchange(self._unit_row, self._unit_s)
        self._unit_row, self._unit_s = [0.0, 0.0, 0.0, 0.0], 0.0
        errors = [(OnlineRefit.predict(self.cost, f) - t) / t for f, t in rows if t > 0]
        self.last_error = math.sqrt(statistics.fmean(e * e for e in errors)) if errors else None
        self.refit.add_unit(rows)
        self.cost = self.refit.fit(self.cost)
        self.stream.cost = self.cost  # the next unit is planned (on every rank) with it
        if self.plans:
            self.plans[max(self.plans)]["refit"] = {
                "error": self.last_error,
                "cost_model": self.cost.as_dict(),
            }

    def _exchange(self, row: list[float], seconds: float) -> list[tuple[list[float], float]]:
        """Every rank's row and compute time of the unit, in rank order, on every rank."""
        table = torch.zeros((self.world, 5), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor([*row, seconds], dtype=torch.float64)
        dist.all_reduce(table)
        out = table.cpu().tolist()
        return [(r[:4], r[4]) for r in out]

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "cost_model": self.cost.as_dict(),
            "refit": self.refit.state_dict() if self.refit is not None else None,
        }

    # --- the report ---------------------------------------------------------------------------

    def report(self) -> dict[str, Any] | None:
        """Gather every rank's records; rank 0 gets ``balance.json``'s contents."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, self.records)
        if self.rank != 0:
            return None
        return summarise(
            gathered,
            self.plans,
            cost=self.cost,
            fit=self.fit,
            strategy=self.cfg.balance,
            unit_steps=self.unit_steps,
            refits=self.refit.refits if self.refit is not None else 0,
        )


def summarise(
    per_rank: list[list[dict[str, Any]]],
    plans: dict[int, dict[str, Any]],
    *,
    cost: CostModel,
    fit: CostFit | None,
    strategy: str,
    unit_steps: int,
    refits: int = 0,
) -> dict[str, Any]:
    """Per plan unit, and per assignment over its units: compute time per rank, straggler
    wait, idle fraction, wall time, tokens per second, the cost model's error (see the module
    docstring). The first unit of each assignment is left out of the aggregates (start-up)."""
    keys = ("compute_s", "predicted_s", "tokens", "barrier_s")
    units: dict[int, dict[str, list[float]]] = {}
    digests: dict[int, set[str]] = {}  # every rank's copy of the plan, and of the cost model
    models: dict[int, set[str]] = {}
    for r, records in enumerate(per_rank):
        for rec in records:
            u = units.setdefault(rec["unit"], {k: [0.0] * len(per_rank) for k in keys})
            for k in keys:
                u[k][r] += rec[k]
            if rec.get("plan_digest") is not None:
                digests.setdefault(rec["unit"], set()).add(rec["plan_digest"])
                models.setdefault(rec["unit"], set()).add(rec["cost_digest"])
    rows: list[dict[str, Any]] = []
    scale = None  # measured / predicted over the previous unit: the device's speed, tracked
    for unit in sorted(units):
        u = units[unit]
        t = u["compute_s"]
        worst = max(t)
        wait = [worst - x for x in t]
        errors = [
            abs(p - m) / m for p, m in zip(u["predicted_s"], t, strict=True) if m > 0 and p == p
        ]
        rms = math.sqrt(statistics.fmean(e * e for e in errors)) if errors else None
        tracked = None
        if scale is not None:
            pairs = zip(u["predicted_s"], t, strict=True)
            tracked = statistics.fmean(abs(scale * p - m) / m for p, m in pairs if m > 0)
        if sum(u["predicted_s"]) > 0:
            scale = sum(t) / sum(u["predicted_s"])
        info = plans.get(unit, {})
        rows.append(
            {
                "unit": unit,
                "assignment": info.get("assignment", strategy),
                "compute_s": t,
                "predicted_s": u["predicted_s"],
                "tokens": [int(x) for x in u["tokens"]],
                "straggler_wait_s": wait,
                "idle_fraction": sum(wait) / (len(t) * worst) if worst > 0 else 0.0,
                "wall_s": info.get("t_end", math.nan) - info.get("t_start", math.nan),
                "plan_ratio": info.get("ratio"),
                "plan_method": info.get("method"),
                "splits": info.get("splits", []),
                "cost_model_error": statistics.fmean(errors) if errors else None,
                "cost_model_rms_error": rms,
                "cost_model_error_tracked": tracked,
                "cost_model_after": info.get("refit", {}).get("cost_model"),
                "plans_identical": len(digests.get(unit, ())) == 1,
                "cost_models_identical": len(models.get(unit, ())) == 1,
            }
        )
    names = list(dict.fromkeys(r["assignment"] for r in rows))
    per_assignment = {
        name: _aggregate([r for r in rows if r["assignment"] == name][_WARMUP_UNITS:])
        for name in names
    }
    return {
        "strategy": strategy,
        "unit_steps": unit_steps,
        "cost_model": {**(fit.as_dict() if fit is not None else {}), **cost.as_dict()},
        "refits": refits,
        "summary": _aggregate(rows[_WARMUP_UNITS * len(names) :]),
        "assignments": per_assignment,
        "units": rows,
    }


def _aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(values: list[Any]) -> float | None:
        kept = [v for v in values if v is not None and v == v]
        return statistics.fmean(kept) if kept else None

    splits = [s for r in rows for s in r["splits"]]
    wall = mean([r["wall_s"] for r in rows])
    tokens = mean([sum(r["tokens"]) for r in rows])
    return {
        "units": len(rows),
        "idle_fraction": mean([r["idle_fraction"] for r in rows]),
        "straggler_wait_s": mean([statistics.fmean(r["straggler_wait_s"]) for r in rows]),
        "max_compute_s": mean([max(r["compute_s"]) for r in rows]),
        "mean_compute_s": mean([statistics.fmean(r["compute_s"]) for r in rows]),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if tokens is not None and wall else None,
        "plan_ratio": mean([r["plan_ratio"] for r in rows]),
        "cost_model_error": mean([r["cost_model_error"] for r in rows]),
        "cost_model_rms_error": mean([r["cost_model_rms_error"] for r in rows]),
        "cost_model_error_tracked": mean([r["cost_model_error_tracked"] for r in rows]),
        "documents_split": sum(1 for k, _, _ in splits if k > 1),
        "not_split": sum(1 for k, _, _ in splits if k == 1),
        "refused_by_link": sum(1 for _, _, refused in splits if refused),
        "split_tiers": sorted({tier for k, tier, _ in splits if k > 1}),
    }
