"""The per-worker training loop of ``lowcomm train``.

Every rank builds the same model (seeded with ``seed``), draws its own batches (generator seeded
with ``(seed, rank)``), and runs plain PyTorch steps: forward, backward, inner AdamW step,
``zero_grad``, then ``algo.step()``. ``--algo ddp`` instead wraps the model in
``DistributedDataParallel`` (gradients all-reduced every step) as the synchronous baseline, with a
:class:`~lowcomm.comm.DDPCommMeter` counting its traffic.

**Node groups** (``nodes`` K > 1, ``procs_per_node`` M; ranks node-major, node n holding ranks
n*M ... n*M+M-1): the M processes of a node train one replica, wrapped in
``DistributedDataParallel`` over the node's group (gradients averaged every step, counted by a
second :class:`~lowcomm.comm.DDPCommMeter`), and the algorithm runs across nodes over the
cross-node group of the ranks with this rank's local index ({j, M+j, 2M+j, ...}): every local
index averages its own copy of the node's replica, the same on each. ``--link`` applies to the
cross-node group only, each of a node's M processes getting 1/M of its bandwidth (they send at
the same time); DDP inside the node uses the real (local) network. ``--algo ddp`` stays DDP over
every process. ``node_sharding="zero"`` replaces each process's AdamW by a
``ZeroRedundancyOptimizer`` over the node's group (over every process for ddp on one node).

Validation loss is measured at step 0, every ``eval_interval`` steps (a multiple of
``sync_every``, right after a round boundary) and at the end after ``algo.finish()``. With an
outer algorithm the model evaluated is its consensus, the anchor A (``algo.anchor_views``; for
LocalSGD, which keeps none, the averaged parameters), copied into the model for the evaluation
and the live parameters restored after it, so training is unaffected. Right after a round
boundary most algorithms' live parameters equal A, so evaluating A changes nothing for them;
it matters where they never are the consensus as a whole (``streaming``, ``cocodc``: fragments
synced at different steps). With ``co2-eager`` each rank's A holds its own fresh
pseudo-gradient as well as the others' stale ones; rank 0's is what is evaluated.

Every rank evaluates the same batches, which keeps the ranks in step (a rank evaluating alone
would make the others wait in their next collective and distort the blocked-time counters);
rank 0 records.

Rank 0 writes the run folder (see :mod:`lowcomm.train.metrics`) and shows the progress bar. The
per-step path stays on the device: rank 0 adds each step's loss to a running sum there and reads
it back (one device sync) only every ``log_every`` steps and at evaluations.

With ``checkpoint_every`` every rank saves its whole state (with ZeRO, its shard of AdamW) every
that many steps, at the end of the step (after ``algo.step()``, the evaluation and the records),
into one checkpoint folder per step (:mod:`lowcomm.train.checkpoint`). A run given ``resume``, or
a worker group restarted by the elastic agent, restores all of it and continues with the next
step, so that it ends exactly where an uninterrupted run would. Collectives time out after
``collective_timeout`` seconds, so a worker whose peer died or stalled fails instead of hanging.

The job is built from parts, each made once from the configuration, and runs in three phases,
one method each of a per-rank :class:`_Job`: build, run (the steps) and finalize (drain, last
evaluation, summary). The parts:

* the replica topology (:mod:`lowcomm.train.topology`): this rank's place — flat, node groups
  (:mod:`lowcomm.train.nodes`) or an elastic replica (:mod:`lowcomm.train.elastic`) — and the
  group each collective runs over;
* the data source (:mod:`lowcomm.train.source`): the corpus, each step's batch with its forward
  and backward pass, the validation batches;
* the model and the inner optimizer (:mod:`lowcomm.train.model`);
* the synchronisation (:mod:`lowcomm.train.synchronisation`): DDP, DeMo or the outer
  algorithm, wherever the topology places its collectives;
* the instrumentation (:mod:`lowcomm.train.instruments`): records, progress, loss watch and
  the faults tests inject.

The loop itself knows none of the layouts: a replica healed at a sync is the synchronisation
telling it which step it now stands at. Process setup is :mod:`lowcomm.train.worker`'s and
failure records :mod:`lowcomm.train.failures`'s; the summary :mod:`lowcomm.train.report`'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import lowcomm.train.checkpoint as ckpt
from lowcomm.comm import set_busy_wait
from lowcomm.device import device_clock, peak_memory_allocated
from lowcomm.guard import checksum
from lowcomm.runfiles import plot_losses, save_checkpoint, write_json
from lowcomm.train.ceiling import Ceiling
from lowcomm.train.config import TrainConfig
from lowcomm.train.failures import attempt
from lowcomm.train.faults import FAULT_ENV, fetch_lost_state
from lowcomm.train.instruments import Instruments
from lowcomm.train.metrics import CHECKPOINT_NOTE
from lowcomm.train.model import build_gpt, inner_optimizer, zero_optimizer
from lowcomm.train.report import divergence, run_summary
from lowcomm.train.resume import resume_source, rng_state, set_rng_state
from lowcomm.train.source import DataSource, check_same_job
from lowcomm.train.summary import record_path
from lowcomm.train.synchronisation import Synchronisation
from lowcomm.train.topology import Topology
from lowcomm.train.tuning import tune_to_link

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lowcomm.models.gpt import GPT

__all__ = ["FAULT_ENV", "check_same_job", "train"]

logger = logging.getLogger(__name__)


def _set_lr(inner: torch.optim.Optimizer, step: float, cfg: TrainConfig) -> float:
    """Set and return the learning rate of ``step`` (:func:`_lr_at`) in every group of
    ``inner``, its peak as ``initial_lr`` (as torch's LR schedulers name it)."""
    lr = _lr_at(step, cfg)
    for group in inner.param_groups:
        group["lr"] = lr
        group["initial_lr"] = cfg.lr
    return lr


def _lr_at(step: float, cfg: TrainConfig) -> float:
    """Inner learning rate for 1-based step ``step``: linear warm-up over ``warmup`` steps, then
    constant or a cosine decay to ``min_lr_ratio * lr`` at the last step (with dynamic local
    steps ``step`` is the steps per worker done, a fraction: the schedule follows the tokens;
    past the last step it stays at the floor)."""
    step = min(step, cfg.steps)
    if step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    if cfg.lr_schedule == "constant" or cfg.steps <= cfg.warmup:
        return cfg.lr
    progress = (step - cfg.warmup) / (cfg.steps - cfg.warmup)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def _evaluate(model: nn.Module, batches: list[Any]) -> float:
    """Mean validation loss over ``batches``: ``(x, y)`` windows, or ``(x, y, packed)``
    documents (then the mean over their tokens)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        if len(batch) == 3:
            x, y, packed = batch
            _, loss = model(x, y, packed=packed, reduction="sum")
            total, tokens = total + float(loss), tokens + y.numel()
        else:
            _, loss = model(*batch)
            total, tokens = total + float(loss), tokens + 1
    model.train(was_training)
    return total / tokens


@torch.no_grad()
def _evaluate_with(
    model: nn.Module,
    batches: list[Any],
    values: list[torch.Tensor],
) -> float:
    """Evaluate ``model`` with ``values`` in place of its trainable parameters (model order),
    then put its live parameters back."""
    params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == len(values), (len(params), len(values))
    live = [p.detach().clone() for p in params]
    torch._foreach_copy_(params, values)
    try:
        return _evaluate(model, batches)
    finally:
        torch._foreach_copy_(params, live)


def train(cfg: TrainConfig, *, device: torch.device) -> dict[str, Any] | None:
    """Run the training job on an initialised default process group; see the module docstring.

    With ``cfg.resume``, or in a restarted worker group
    (:func:`~lowcomm.train.failures.attempt` > 0) whose run has a complete checkpoint, every
    rank continues from its part of that checkpoint (:mod:`lowcomm.train.checkpoint`).

    Returns the run summary on rank 0, ``None`` elsewhere.
    """
    job = _Job(cfg, device)
    try:
        job.build()
        job.run()
        return job.finalize()
    finally:
        if job.topology is not None:
            job.topology.close()  # an elastic replica's heartbeats stop


class _Job:
    """One rank's part of a training job, built from its parts — :class:`Topology`,
    :class:`DataSource`, the model and inner optimizer, :class:`Synchronisation`,
    :class:`Instruments` — each made once from the configuration: :meth:`build`, then
    :meth:`run`, then :meth:`finalize`."""

    source: str | None
    """The checkpoint folder this run continues from, if any."""
    state: dict[str, Any] | None
    """This rank's part of it."""
    start: int
    """The last step done before this run (0, or the checkpoint's step)."""
    data: DataSource
    gpt: GPT
    inner: torch.optim.Optimizer
    zero: ZeroRedundancyOptimizer | None
    """The inner optimizer with ``node_sharding="zero"`` (then ``inner`` too)."""
    ceiling: Ceiling | None
    given: TrainConfig
    """The configuration as given; ``cfg`` is it with the settings chosen from the link."""
    tuning: dict[str, Any] | None
    """The record of that choice (``None``: not tuned)."""
    sync: Synchronisation
    records: Instruments
    t_start: float
    t_attempt: float
    warm_clock: float | None
    """The training clock when the warm start ended (rank 0; ``None``: not in this run)."""
    val_start: float
    end_step: int
    """The step the run ended after (``steps``; later with dynamic local steps)."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        assert cfg.out is not None and cfg.name is not None, "call TrainConfig.with_paths() first"
        self.cfg = cfg
        self.out: str = cfg.out
        self.device = device
        self.topology: Topology | None = None

    # --- build --------------------------------------------------------------------------------

    def build(self) -> None:
        """Everything before the first step, from the checkpoint when resuming. The order is
        part of the numbers: the model is initialised from the seeded torch generator, which
        the ceiling's warm-up step then draws from."""
        cfg, device = self.cfg, self.device
        self.topology = topology = Topology.create(cfg)
        rank, world = topology.rank, topology.world
        self.source = resume_source(cfg, rank, world)
        state = ckpt.load_rank_state(self.source, rank, world) if self.source else None
        if self.source is not None:  # (a benchmark's lost machine: its file crosses the link)
            fetch_lost_state(ckpt.rank_file(self.source, rank), rank, cfg.link)
        self.state = state
        self.start = int(state["step"]) if state is not None else 0
        if topology.is_main:
            os.makedirs(self.out, exist_ok=True)
            # What the stopped run wrote after the point this one continues from is discarded.
            ckpt.discard_after(self.out, self.start)
            if self.source is not None:
                # resuming into another folder: its records start as the checkpoint's run's
                earlier = os.path.join(ckpt.run_folder_of(self.source), "metrics.jsonl")
                ckpt.truncate_metrics(
                    os.path.join(self.out, "metrics.jsonl"), self.start, source=earlier
                )
        dist.barrier()  # no rank writes a checkpoint before the folder is cleaned up

        set_busy_wait(cfg.busy_wait)
        self.data = data = DataSource.load(cfg, topology, device)
        torch.manual_seed(cfg.seed)  # identical initial model on every rank
        self.gpt = gpt = build_gpt(cfg, data.vocab_size).to(device)
        if state is not None:
            gpt.load_state_dict(state["model"])
        self.zero = None
        if cfg.node_sharding == "zero":
            self.inner = self.zero = zero_optimizer(gpt, cfg, topology.node_group)
            if state is not None:  # this rank's shard (see save())
                self.zero.optim.load_state_dict(state["optimizer"])
        else:
            self.inner = inner_optimizer(gpt, cfg)
            if state is not None:
                self.inner.load_state_dict(state["optimizer"])
        # fits the cost model on every rank, before any optimizer step
        data.prepare_documents(gpt, state.get("documents") if state is not None else None)
        self.ceiling = None
        if cfg.ceiling_steps:
            self.ceiling = Ceiling(gpt, cfg, data.corpus, rank, device)
        # the link's settings (--tune-link): the rest of the job runs with them
        self.given = cfg
        cfg, self.tuning = tune_to_link(cfg, topology, gpt, data.corpus, device, state)
        self.cfg = data.cfg = cfg
        driven = self.zero.optim if self.zero is not None else self.inner
        self.sync = Synchronisation.create(cfg, topology, gpt, driven, state, device)
        data.prepare(state["rng"] if state is not None else None)
        self.records = Instruments.create(
            cfg,
            topology,
            self.sync,
            data,
            n_params=gpt.num_parameters(),
            start=self.start,
            state=state,
            device=device,
        )

    # --- run ----------------------------------------------------------------------------------

    def run(self) -> None:
        """The steps: the ceiling's first segment, the initial evaluation (not when resuming),
        then every step with its evaluations, checkpoints and the ceiling's segments due."""
        cfg, device, state, records = self.cfg, self.device, self.state, self.records
        sync, inner, data = self.sync, self.inner, self.data
        assert self.topology is not None
        rank = self.topology.rank
        if self.ceiling is not None:
            self.ceiling.before(self.start)
        if state is not None:
            set_rng_state(state["rng"], device)
        self.t_start = records.start(self.start, state, self.source)
        # this run's own start (t_start: step 0's, the same instant or earlier)
        self.t_attempt = time.perf_counter()
        self.val_start = self.evaluate(0) if state is None else float("nan")
        if records.progress is not None and state is not None:
            self.val_start = records.progress.val_start
        eval_interval = cfg.eval_interval
        algo = sync.algo if sync.algo is not None and sync.algo.pace is not None else None
        stretch = cfg.stretch(rank, self.topology.world)
        # a slower device's longer step is measured from this one's: on a GPU after its kernels
        clock = device_clock(device) if stretch > 1.0 else time.perf_counter
        if algo is not None:
            algo.set_total_steps(cfg.steps)  # the last round ends at the job's tokens
        step = self.start
        warm_steps = cfg.sync_warmup_steps() if self.start == 0 else -1
        self.warm_clock = None
        while not self.finished(step):
            step += 1
            done = step if algo is None else algo.steps_done(including_next=True)
            lr = _set_lr(inner, done, cfg)
            loss = None
            if algo is None or algo.takes_step():  # (dynamic local steps pass some positions)
                t0 = clock()
                now = sync.before_forward(step)
                if now != step:  # healed before this step's forward: it takes the donor's
                    step = now
                    records.jumped(step - 1)
                    lr = _set_lr(inner, step, cfg)  # (the donor's optimizer state had it)
                with self.autocast():
                    loss = data.loss(sync.model, step)
                records.trained(step, loss)
                sync.backward_done()
                inner.step()
                inner.zero_grad(set_to_none=True)
                if stretch > 1.0:
                    _compute_for((stretch - 1.0) * (clock() - t0))
            now, record = sync.after_step(step)
            records.synced(record)
            if now != step:  # healed: the records continue at the donor's step
                step = now
                records.jumped(step)
                continue
            data.step_done(step)
            records.inject(step, rank, self.gpt)
            last = self.finished(step)
            records.step(step, loss, lr, flush=step % eval_interval == 0 or last)
            if step == warm_steps and records.progress is not None:
                # the training clock (evaluations and ceiling segments left out) at the warm
                # start's end: the run's warm and local step times, beside the tuner's
                self.warm_clock = time.perf_counter() - self.t_start - records.progress.excluded_s
            if step % eval_interval == 0 and not last:
                self.evaluate(step)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                self.save(step)
            if self.ceiling is not None:
                records.paused(self.ceiling.during(step, sync.idle))
        self.end_step = step

    def step_times(self, train_s: float, end: int) -> dict[str, float | None] | None:
        """This run's training time per step: over the warm start's steps (``warm_step_s``)
        and over the others (``step_s``); ``None`` for a resumed run (its clock continues the
        stopped run's)."""
        if self.start > 0 or end <= 0:
            return None
        k = self.cfg.sync_warmup_steps()
        if not k or self.warm_clock is None:
            return {"step_s": train_s / end, "warm_step_s": None}
        rest = end - k
        return {
            "step_s": (train_s - self.warm_clock) / rest if rest > 0 else None,
            "warm_step_s": self.warm_clock / k,
        }

    def finished(self, step: int) -> bool:
        """Whether the job ends after ``step``: at ``steps``; with dynamic local steps at the
        first round boundary where the workers together have taken ``steps`` each (the tokens
        of the job with every worker at every step)."""
        algo = self.sync.algo
        if algo is None or algo.pace is None:
            return step >= self.cfg.steps
        return algo.steps_done() >= self.cfg.steps and algo.at_round_boundary

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward and backward's arithmetic (``precision``): bf16 autocast on the job's
        device, or nothing for fp32."""
        if self.cfg.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self, step: int) -> float:
        """Validation loss of the consensus model (module docstring); rank 0 records it."""
        t0 = time.perf_counter()
        consensus = self.sync.consensus
        if consensus is not None:
            val_loss = _evaluate_with(self.gpt, self.data.val, consensus)
        else:
            val_loss = _evaluate(self.gpt, self.data.val)
        self.records.eval(step, val_loss, self.sync.rounds, time.perf_counter() - t0)
        return val_loss

    def save(self, step: int) -> None:
        """Write this rank's part of the checkpoint of ``step``; rank 0 publishes it once every
        rank's part is on disk."""
        assert self.topology is not None
        zero, rank, world = self.zero, self.topology.rank, self.topology.world
        rank_state = {
            "step": step,
            "rank": rank,
            "world_size": world,
            "model": {k: v.detach().cpu() for k, v in self.gpt.state_dict().items()},
            # with ZeRO, this rank's shard: its local AdamW (the partition is deterministic)
            "optimizer": zero.optim.state_dict() if zero is not None else self.inner.state_dict(),
            **self.sync.state_dict(),
            "rng": rng_state(self.data.gen, self.device),
            "documents": self.data.documents_state(),
            "tuned": self.tuning,
            **self.records.state_dict(),
        }
        ckpt.write_rank_state(self.out, step, rank, rank_state)
        dist.barrier()  # every rank's part is on disk before the manifest makes it complete
        if self.topology.is_main:
            folder = ckpt.publish(
                self.out,
                step,
                # the settings as given: a resumed run compares its own with them, and takes
                # the ones chosen from the link from the rank states
                {"world_size": world, "attempt": attempt(), "config": self.given.to_dict()},
                keep=self.cfg.keep_checkpoints,
            )
            logger.debug("checkpoint of step %d written to %s", step, folder)

    # --- finalize -----------------------------------------------------------------------------

    def finalize(self) -> dict[str, Any] | None:
        """Drain the algorithm, evaluate the final model, run the ceiling's last segments, gather
        every rank's counters; rank 0 writes ``checkpoint.pt``, ``summary.json`` and the loss
        plot and returns the summary."""
        cfg, sync, zero, records = self.cfg, self.sync, self.zero, self.records
        topology = self.topology
        assert topology is not None
        world = topology.world
        end = self.end_step
        sync.finish()
        if self.ceiling is not None:
            # the training's time ends with the last rank's steps, as the ceiling's is the
            # slowest rank's (ranks that never sync finish apart)
            dist.barrier()
        records.synced_at_end()
        val_end = self.evaluate(end)
        now = time.perf_counter()
        wall_s = now - self.t_start
        records.close()
        ceiling_segments: list[Any] = []
        if self.ceiling is not None:
            self.ceiling.after()
            ceiling_segments = [None] * world
            dist.all_gather_object(ceiling_segments, self.ceiling.segments)

        balance = self.data.report()
        per_rank = {
            "rank": topology.rank,
            **sync.per_rank(),
            "params_checksum": _params_checksum(self.gpt),
            "nonfinite": records.watch.state_dict(),
            # this process's device memory high-water mark (None on the CPU)
            "peak_gpu_memory_bytes": peak_memory_allocated(self.device),
            # the intra-op threads it computed with (this machine's cores over its processes)
            "threads": torch.get_num_threads(),
        }
        if zero is not None and topology.holds_zero_root():
            # node 0 (its group rank 0 is rank 0) gathers the whole AdamW state for checkpoint.pt
            zero.consolidate_state_dict(to=0)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, per_rank)

        progress = records.progress
        if progress is None:
            return None
        eval_s = progress.eval_s
        train_s = wall_s - eval_s - progress.paused_s
        model_state = {k: v.detach().cpu() for k, v in self.gpt.state_dict().items()}
        save_checkpoint(
            os.path.join(self.out, "checkpoint.pt"),
            {
                "rank": 0,
                "note": CHECKPOINT_NOTE,
                "step": end,
                "config": cfg.to_dict(),
                "world_size": world,
                "model": model_state,
                "optimizer": self.inner.state_dict(),
                "algorithm": sync.algo.state_dict() if sync.algo is not None else None,
            },
        )
        summary = run_summary(
            cfg,
            world=world,
            tokens=round(sync.steps_done(end) * topology.tokens_per_step),
            wall_s=wall_s,
            train_s=train_s,
            eval_s=eval_s,
            val_start=self.val_start,
            val_end=val_end,
            per_rank=gathered,
            n_params=self.gpt.num_parameters(),
            ceiling=None
            if self.ceiling is None
            else self.ceiling.summary(topology.tokens_per_step, ceiling_segments),
        )
        summary["steps_run"] = end
        summary["step_times"] = self.step_times(train_s, end)
        # a resumed run's wall time counts from step 0 over every attempt; this one's alone:
        # (read at the same instant as wall_s, so it is never more than it)
        summary["attempt_wall_time_s"] = now - self.t_attempt
        peaks = [r.get("peak_gpu_memory_bytes") for r in sorted(gathered, key=lambda r: r["rank"])]
        summary["peak_gpu_memory_bytes"] = peaks if any(p is not None for p in peaks) else None
        summary["resumed_at"] = list(progress.resumed_at)
        if topology.elastic is not None:
            assert sync.algo is not None
            summary["elastic"] = topology.elastic.report(sync.algo)
        summary["lost_to_restarts_s"] = progress.lost_s
        summary["link_tuning"] = self.tuning
        summary["nonfinite"] = divergence(
            gathered,
            steps=end,
            tail=cfg.log_every,
            val_start=self.val_start,
            val_end=val_end,
        )
        diverged = summary["nonfinite"] is not None and summary["nonfinite"]["diverged"]
        summary["status"] = "diverged" if diverged else "finished"
        if balance is not None:
            write_json(os.path.join(self.out, "balance.json"), balance)
            summary["balance"] = balance["summary"]
        write_json(record_path(self.out, ending=True), summary)
        plot_losses(
            os.path.join(self.out, "metrics.jsonl"),
            os.path.join(self.out, "loss.png"),
            title=f"{cfg.name}: {cfg.algo}, {topology.describe()}",
        )
        return summary


def _compute_for(seconds: float) -> None:
    """Keep this worker's CPU busy for ``seconds`` (``speeds``: a slower device's longer step,
    spent computing as the device would, not sleeping, so a CPU shared by several workers is
    shared as it is during their real steps)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _params_checksum(model: nn.Module) -> str:
    """A checksum of every parameter's bits: equal on two ranks that hold the same model."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    return checksum(flat)
