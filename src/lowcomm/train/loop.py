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

The job runs in three phases, one method each of a per-rank :class:`_Job`: build (resume point,
model, optimizer, synchronisation, data, records), run (the steps) and finalize (drain, last
evaluation, summary). Process setup is :mod:`lowcomm.train.worker`'s and failure records
:mod:`lowcomm.train.failures`'s; node groups are :mod:`lowcomm.train.nodes`'s, the records and
the summary :mod:`lowcomm.train.report`'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import lowcomm.train.checkpoint as ckpt
from lowcomm.balance import DocumentCorpus, load_documents
from lowcomm.comm import CommStats, DDPCommMeter, set_busy_wait
from lowcomm.data import eval_batches, get_batch, load_corpus, make_generator
from lowcomm.guard import check_same_across_ranks, checksum
from lowcomm.integrations.loggers import EveryStep, MetricsLogger
from lowcomm.link import EmulatedLink
from lowcomm.optim import DeMo
from lowcomm.train.ceiling import Ceiling
from lowcomm.train.config import TrainConfig
from lowcomm.train.documents import DocumentJob, val_micro_batches
from lowcomm.train.elastic import ElasticReplica
from lowcomm.train.failures import attempt
from lowcomm.train.faults import ELASTIC_MODES, FAULT_ENV, fault_point, inject_fault
from lowcomm.train.metrics import CHECKPOINT_NOTE, plot_losses, save_checkpoint, write_json
from lowcomm.train.model import build_gpt, inner_optimizer, zero_optimizer
from lowcomm.train.nodes import NodeGroups, describe_layout, node_groups, node_link
from lowcomm.train.report import LossWatch, Progress, divergence, resolved_config, run_summary
from lowcomm.train.resume import restore_stats, resume_source, rng_state, set_rng_state

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lowcomm.models.gpt import GPT
    from lowcomm.outer.base import OuterAlgorithm

__all__ = ["FAULT_ENV", "check_same_job", "train"]

logger = logging.getLogger(__name__)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Inner learning rate for 1-based step ``step``: linear warm-up over ``warmup`` steps, then
    constant or a cosine decay to ``min_lr_ratio * lr`` at the last step."""
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
        if job.elastic is not None:
            job.elastic.close()  # its heartbeats stop: the others' next quorum leaves it out


@dataclasses.dataclass
class _Sync:
    """How this rank's replica keeps in step with the others."""

    model: nn.Module
    """What the steps call: the GPT, or its ``DistributedDataParallel`` wrapper."""
    stats: Any
    """The communication counters ``summary.json`` reports (a :class:`~lowcomm.comm.CommStats`):
    with node groups, those of the cross-node group."""
    algo: OuterAlgorithm | None = None
    """The outer algorithm; ``None`` for ddp and none."""
    meter: Any = None
    """Told when each backward pass is done: ddp's traffic meter (or its compressed hook)."""
    node_meter: DDPCommMeter | None = None
    """DDP inside the node (node groups)."""
    ddp_compression: Any = None
    """The compressed DDP hook's state (its residuals), when used."""


def _synchronisation(
    cfg: TrainConfig,
    gpt: GPT,
    inner: torch.optim.Optimizer,
    groups: NodeGroups,
    state: dict[str, Any] | None,
    device: torch.device,
    elastic: ElasticReplica | None = None,
) -> _Sync:
    """Wrap ``gpt`` for ``cfg.algo`` (DDP, nothing, or an outer algorithm over the cross-node
    group, with DDP inside the node for node groups), restoring ``state``'s part of it.
    ``inner`` is the optimizer the algorithm drives: with ZeRO, this rank's local AdamW, whose
    state is the one it zeroes on a non-finite average (the wrapper's own ``state`` stays
    empty)."""
    link = EmulatedLink.parse(cfg.link) if cfg.link is not None else None
    ddp_kwargs: dict[str, Any] = {"bucket_cap_mb": cfg.bucket_cap_mb}
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
    if cfg.algo == "ddp":
        # with nodes, still DDP over every process: the layout sets their number (and the
        # group ZeRO shards over), not what is synchronised
        ddp = nn.parallel.DistributedDataParallel(gpt, **ddp_kwargs)
        sync = _Sync(model=ddp, stats=None)
        if cfg.compression is not None:
            from lowcomm.compress import ddp_hook

            hook_state, hook = ddp_hook(
                cfg.compression, process_group=link.communicator() if link is not None else None
            )
            ddp.register_comm_hook(hook_state, hook)
            if state is not None and state.get("ddp_hook") is not None:
                hook_state.load_state_dict(state["ddp_hook"])
            sync.ddp_compression = sync.meter = hook_state
        else:
            sync.meter = DDPCommMeter(link=link.model() if link is not None else None)
            sync.meter.register(ddp)
        sync.stats = sync.meter.stats
    elif cfg.algo == "none":
        sync = _Sync(model=gpt, stats=CommStats())  # the no-sync ceiling: every worker alone
    elif cfg.algo == "demo":
        # the optimizer itself communicates (inner_optimizer): no DDP, no outer algorithm
        assert isinstance(inner, DeMo)
        sync = _Sync(model=gpt, stats=inner.stats)
    else:
        sync = _Sync(model=gpt, stats=None)
        if cfg.hierarchical:
            # one replica per node: its processes average gradients every step (the fast
            # local network, never the emulated link)
            sync.model = nn.parallel.DistributedDataParallel(
                gpt, process_group=groups.node, **ddp_kwargs
            )
            sync.node_meter = DDPCommMeter()
            sync.node_meter.register(sync.model)
        outer_group: Any = groups.cross
        if link is not None:
            outer_group = node_link(link, cfg).communicator(groups.cross)
        # The model itself, not its parameters: streaming builds its fragments from its blocks.
        if elastic is not None:  # the replicas meet in torchft's quorum of each sync
            algo = cfg.algorithm_class()(
                gpt, inner, fault_tolerance=elastic.replica, **cfg.algorithm_kwargs()
            )
        else:
            algo = cfg.algorithm_class()(
                gpt, inner, process_group=outer_group, **cfg.algorithm_kwargs()
            )
        if state is not None:
            algo.load_state_dict(state["algorithm"])
        sync.algo, sync.stats = algo, algo.stats
    if state is not None:
        restore_stats(sync.stats, state.get("comm_stats") or {})
        if sync.node_meter is not None:
            restore_stats(sync.node_meter.stats, state.get("intra_node_stats") or {})
    return sync


class _Job:
    """One rank's part of a training job: :meth:`build`, then :meth:`run`, then
    :meth:`finalize`."""

    source: str | None
    """The checkpoint folder this run continues from, if any."""
    state: dict[str, Any] | None
    """This rank's part of it."""
    start: int
    """The last step done before this run (0, or the checkpoint's step)."""
    corpus: Any
    gpt: GPT
    inner: torch.optim.Optimizer
    zero: ZeroRedundancyOptimizer | None
    """The inner optimizer with ``node_sharding="zero"`` (then ``inner`` too)."""
    ceiling: Ceiling | None
    sync: _Sync
    gen: torch.Generator
    """This rank's batches."""
    val: list[Any]
    """Validation batches: ``(x, y)`` windows, or ``(x, y, packed)`` with documents."""
    docs: DocumentJob | None
    """Documents mode (``--documents``): the stream, its step and its records."""
    tokens_per_step: int
    progress: Progress | None
    """Rank 0's records; ``None`` elsewhere."""
    tensorboard: MetricsLogger | None
    """Rank 0's TensorBoard scalars (``--tensorboard``); ``None`` elsewhere and without it."""
    every_step: EveryStep | None
    """Its source without an outer algorithm or DeMo (ddp, none): every step is a sync."""
    fault: tuple[int, str] | None
    started_at: float
    """Wall-clock time the run started (its first attempt's, in a restarted worker group)."""
    watch: LossWatch
    """This rank's non-finite training losses."""
    t_start: float
    val_start: float

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        assert cfg.out is not None and cfg.name is not None, "call TrainConfig.with_paths() first"
        self.cfg = cfg
        self.out: str = cfg.out
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.is_main = self.rank == 0
        self.elastic: ElasticReplica | None = None
        """This process as a replica of an elastic job (``fault_tolerance``)."""

    # --- build --------------------------------------------------------------------------------

    def build(self) -> None:
        """Everything before the first step, from the checkpoint when resuming. The order is
        part of the numbers: the model is initialised from the seeded torch generator, which
        the ceiling's warm-up step then draws from."""
        cfg, rank, world, device = self.cfg, self.rank, self.world, self.device
        self.source = resume_source(cfg, rank, world)
        state = ckpt.load_rank_state(self.source, rank, world) if self.source else None
        self.state = state
        self.start = int(state["step"]) if state is not None else 0
        if self.is_main:
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
        self.corpus = corpus = load_documents(cfg.data) if cfg.documents else load_corpus(cfg.data)
        check_same_job(cfg, corpus)
        groups = node_groups(cfg, world)
        torch.manual_seed(cfg.seed)  # identical initial model on every rank
        self.gpt = gpt = build_gpt(cfg, corpus.vocab_size).to(device)
        if state is not None:
            gpt.load_state_dict(state["model"])
        self.zero = None
        if cfg.node_sharding == "zero":
            self.inner = self.zero = zero_optimizer(gpt, cfg, groups.node)
            if state is not None:  # this rank's shard (see save())
                self.zero.optim.load_state_dict(state["optimizer"])
        else:
            self.inner = inner_optimizer(gpt, cfg)
            if state is not None:
                self.inner.load_state_dict(state["optimizer"])
        self.docs = None
        if cfg.documents:  # fits the cost model on every rank, before any optimizer step
            part = state.get("documents") if state is not None else None
            assert isinstance(corpus, DocumentCorpus)
            self.docs = DocumentJob(cfg, corpus, gpt, device=device, state=part)
        self.ceiling = Ceiling(gpt, cfg, corpus, rank, device) if cfg.ceiling_steps else None
        driven = self.zero.optim if self.zero is not None else self.inner
        if cfg.fault_tolerance:
            self.elastic = ElasticReplica(cfg)
        self.sync = _synchronisation(cfg, gpt, driven, groups, state, device, self.elastic)

        self.gen = make_generator(cfg.seed, rank)
        if state is not None:
            self.gen.set_state(state["rng"]["data"])
        if isinstance(corpus, DocumentCorpus):
            self.val = list(val_micro_batches(corpus, cfg.block_size, cfg.eval_batches, device))
        else:
            self.val = [
                (x.to(device), y.to(device))
                for x, y in eval_batches(
                    corpus.val, cfg.batch_size, cfg.block_size, cfg.eval_batches
                )
            ]
        self.tokens_per_step = cfg.batch_size * cfg.block_size * world
        self.progress = None
        self.started_at = time.time()
        if self.is_main:
            config = resolved_config(cfg, world, corpus)
            if attempt() > 0:  # a restarted worker group: the run started with attempt 0
                self.started_at = _started_at(self.out) or self.started_at
            config["resolved"]["started_at"] = self.started_at
            write_json(os.path.join(self.out, "config.json"), config)
            logger.info(
                "lowcomm train: %s, %s (%s), %.2f M parameters, corpus %s (%s), %d steps of %d "
                "tokens per worker",
                cfg.algo,
                describe_layout(cfg, world),
                dist.get_backend(),
                gpt.num_parameters() / 1e6,
                corpus.source,
                _corpus_size(corpus),
                cfg.steps,
                cfg.batch_size * cfg.block_size,
            )
            self.progress = Progress(
                cfg, world, self.tokens_per_step, self.sync.stats, device, append=state is not None
            )
        self.tensorboard = self.every_step = None
        if self.is_main and cfg.tensorboard is not None:
            self.tensorboard = self._tensorboard(cfg.tensorboard)
        self.fault = (
            fault_point(self.elastic.index, attempt=self.elastic.attempt)
            if self.elastic is not None
            else fault_point(rank)
        )
        if self.fault is not None and self.fault[1] in ELASTIC_MODES:
            if self.elastic is None or self.sync.algo is None:
                raise ValueError(f"{FAULT_ENV}: {self.fault[1]} faults are an elastic job's")
            self.elastic.arm(self.sync.algo, *self.fault)
            self.fault = (self.fault[0], "armed")
        self.watch = LossWatch(device, state.get("nonfinite") if state is not None else None)

    def _tensorboard(self, folder: str) -> MetricsLogger:
        """Rank 0's scalars, once per outer step (every ``log_every`` steps for ddp and none);
        a resumed run hides what the stopped one wrote after the checkpoint."""
        source: Any = self.sync.algo
        every = 1
        if source is None and isinstance(self.inner, DeMo):
            source = self.inner
        elif source is None:
            source = self.every_step = EveryStep(self.sync.stats)
            source.outer_step = self.start
            every = self.cfg.log_every
        resumed = self.state is not None
        purge = int(source.outer_step) + 1 if resumed else None
        return MetricsLogger(source, tensorboard=folder, every=every, purge_step=purge)

    # --- run ----------------------------------------------------------------------------------

    def run(self) -> None:
        """The steps: the first half of the ceiling, the initial evaluation (not when resuming),
        then every step with its evaluations and checkpoints."""
        cfg, device, state, progress = self.cfg, self.device, self.state, self.progress
        sync, inner, gen, corpus = self.sync, self.inner, self.gen, self.corpus
        if self.ceiling is not None:
            self.ceiling.run(cfg.ceiling_steps // 2)
        if state is not None:
            set_rng_state(state["rng"], device)
        elapsed_before = 0.0
        if progress is not None and state is not None:
            elapsed_before = progress.resume(self.start, state["progress"], self.source, attempt())
        if progress is not None and attempt() > 0:
            # A restarted group continues the same job: its time runs from the job's start,
            # the work lost since the checkpoint and the restart itself included (a resume
            # the user asks for later does not count the time in between).
            since_start = time.time() - self.started_at
            progress.lost_s += max(0.0, since_start - elapsed_before)
            elapsed_before = max(elapsed_before, since_start)
        self.t_start = time.perf_counter() - elapsed_before
        if progress is not None:
            progress.start(self.t_start)
        self.val_start = self.evaluate(0) if state is None else float("nan")
        if progress is not None and state is not None:
            self.val_start = progress.val_start
        eval_interval = cfg.eval_interval
        step = self.start
        while step < cfg.steps:
            step += 1
            lr = _lr_at(step, cfg)
            for group in inner.param_groups:
                group["lr"] = lr
                group["initial_lr"] = cfg.lr  # the peak, as torch's LR schedulers name it
            if self.docs is not None:
                ddp = isinstance(sync.model, nn.parallel.DistributedDataParallel)
                loss = self.docs.step(sync.model, ddp=ddp)
            else:
                if self.elastic is not None:  # its own stream, by step (module elastic)
                    gen = self.elastic.generator(step)
                x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
                x, y = x.to(device), y.to(device)
                _, loss = sync.model(x, y)
                loss.backward()
            self.watch.step(step, loss)
            if sync.meter is not None:
                sync.meter.backward_done()
            if sync.node_meter is not None:
                sync.node_meter.backward_done()
            inner.step()
            inner.zero_grad(set_to_none=True)
            if sync.algo is not None:
                sync.algo.step()
            if self.elastic is not None and sync.algo is not None:
                record = self.elastic.synced(sync.algo)
                if record is not None and progress is not None:
                    progress.writer.write(record)
                done = step
                step = self.elastic.follow(sync.algo.local_step, step)
                if step != done and progress is not None:
                    progress.jumped(step)  # healed: the records continue at the donor's step
                    continue
            if self.docs is not None:
                self.docs.unit_done(step % self.docs.unit_steps == 0)
            if self.fault is not None and self.fault[0] == step and self.fault[1] != "armed":
                inject_fault(self.fault[1], self.rank, step, cfg.collective_timeout, model=self.gpt)
            if progress is not None:
                progress.step(step, loss, lr, flush=step % eval_interval == 0 or step == cfg.steps)
            if self.tensorboard is not None:
                if self.every_step is not None:
                    self.every_step.step()
                self.tensorboard.step(loss)
            if step % eval_interval == 0 and step < cfg.steps:
                self.evaluate(step)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                self.save(step)

    def rounds(self) -> int:
        algo = self.sync.algo
        return int(getattr(algo, "rounds", 0)) if algo is not None else 0

    def evaluate(self, step: int) -> float:
        """Validation loss of the consensus model (module docstring); rank 0 records it."""
        t0 = time.perf_counter()
        algo = self.sync.algo
        if algo is not None:
            val_loss = _evaluate_with(self.gpt, self.val, algo.anchor_views)
        else:
            val_loss = _evaluate(self.gpt, self.val)
        if self.progress is not None:
            self.progress.eval(step, val_loss, self.rounds(), time.perf_counter() - t0)
        if self.tensorboard is not None:
            self.tensorboard.eval(val_loss)
        return val_loss

    def save(self, step: int) -> None:
        """Write this rank's part of the checkpoint of ``step``; rank 0 publishes it once every
        rank's part is on disk."""
        sync, zero, progress = self.sync, self.zero, self.progress
        rank_state = {
            "step": step,
            "rank": self.rank,
            "world_size": self.world,
            "model": {k: v.detach().cpu() for k, v in self.gpt.state_dict().items()},
            # with ZeRO, this rank's shard: its local AdamW (the partition is deterministic)
            "optimizer": zero.optim.state_dict() if zero is not None else self.inner.state_dict(),
            # waits for in-flight all-reduces (not applying them) before the counters are read
            "algorithm": sync.algo.state_dict() if sync.algo is not None else None,
            "ddp_hook": (
                sync.ddp_compression.state_dict() if sync.ddp_compression is not None else None
            ),
            "rng": rng_state(self.gen, self.device),
            "documents": self.docs.state_dict() if self.docs is not None else None,
            "comm_stats": dataclasses.asdict(sync.stats),
            "intra_node_stats": (
                dataclasses.asdict(sync.node_meter.stats) if sync.node_meter is not None else None
            ),
            "progress": progress.state_dict() if progress is not None else None,
            "nonfinite": self.watch.state_dict(),
        }
        ckpt.write_rank_state(self.out, step, self.rank, rank_state)
        dist.barrier()  # every rank's part is on disk before the manifest makes it complete
        if self.is_main:
            folder = ckpt.publish(
                self.out,
                step,
                {"world_size": self.world, "attempt": attempt(), "config": self.cfg.to_dict()},
                keep=self.cfg.keep_checkpoints,
            )
            logger.debug("checkpoint of step %d written to %s", step, folder)

    # --- finalize -----------------------------------------------------------------------------

    def finalize(self) -> dict[str, Any] | None:
        """Drain the algorithm, evaluate the final model, run the ceiling's second half, gather
        every rank's counters; rank 0 writes ``checkpoint.pt``, ``summary.json`` and the loss
        plot and returns the summary."""
        cfg, sync, zero, progress, world = self.cfg, self.sync, self.zero, self.progress, self.world
        if sync.algo is not None:
            sync.algo.finish()
        if isinstance(self.inner, DeMo):
            self.inner.finish()  # with overlap: the last gathered update
        if self.tensorboard is not None:
            self.tensorboard.step()  # the syncs finish() applied
        val_end = self.evaluate(cfg.steps)
        if self.tensorboard is not None:
            self.tensorboard.close()
        wall_s = time.perf_counter() - self.t_start
        if progress is not None:
            progress.close()
        if self.ceiling is not None:
            self.ceiling.run(cfg.ceiling_steps - cfg.ceiling_steps // 2)

        balance = self.docs.report() if self.docs is not None else None
        per_rank = {
            "rank": self.rank,
            "rounds": self.rounds(),
            "skipped_updates": int(getattr(sync.algo, "skipped_updates", 0)),
            **sync.stats.as_dict(),
            "intra_node": sync.node_meter.stats.as_dict() if sync.node_meter is not None else None,
            "params_checksum": _params_checksum(self.gpt),
            "nonfinite": self.watch.state_dict(),
        }
        # ZeRO's group: the node's processes, or every process for ddp on one node (under
        # torchrun, the world size is torchrun's, not cfg.workers)
        if zero is not None and self.rank < (cfg.procs_per_node or world):
            # node 0 (its group rank 0 is rank 0) gathers the whole AdamW state for checkpoint.pt
            zero.consolidate_state_dict(to=0)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, per_rank)

        if not self.is_main:
            return None
        assert progress is not None
        eval_s = progress.eval_s
        train_s = wall_s - eval_s
        model_state = {k: v.detach().cpu() for k, v in self.gpt.state_dict().items()}
        save_checkpoint(
            os.path.join(self.out, "checkpoint.pt"),
            {
                "rank": 0,
                "note": CHECKPOINT_NOTE,
                "step": cfg.steps,
                "config": cfg.to_dict(),
                "world_size": world,
                "model": model_state,
                "optimizer": self.inner.state_dict(),
                "algorithm": sync.algo.state_dict() if sync.algo is not None else None,
            },
        )
        tokens = cfg.steps * self.tokens_per_step
        summary = run_summary(
            cfg,
            world=world,
            tokens=tokens,
            wall_s=wall_s,
            train_s=train_s,
            eval_s=eval_s,
            val_start=self.val_start,
            val_end=val_end,
            per_rank=gathered,
            n_params=self.gpt.num_parameters(),
            ceiling=None if self.ceiling is None else self.ceiling.summary(self.tokens_per_step),
        )
        summary["resumed_at"] = list(progress.resumed_at)
        if self.elastic is not None:
            assert sync.algo is not None
            summary["elastic"] = self.elastic.report(sync.algo)
        summary["lost_to_restarts_s"] = progress.lost_s
        summary["nonfinite"] = divergence(
            gathered,
            steps=cfg.steps,
            tail=cfg.log_every,
            val_start=self.val_start,
            val_end=val_end,
        )
        diverged = summary["nonfinite"] is not None and summary["nonfinite"]["diverged"]
        summary["status"] = "diverged" if diverged else "finished"
        if balance is not None:
            write_json(os.path.join(self.out, "balance.json"), balance)
            summary["balance"] = balance["summary"]
        write_json(os.path.join(self.out, "summary.json"), summary)
        plot_losses(
            os.path.join(self.out, "metrics.jsonl"),
            os.path.join(self.out, "loss.png"),
            title=f"{cfg.name}: {cfg.algo}, {describe_layout(cfg, world)}",
        )
        return summary


def _corpus_size(corpus: Any) -> str:
    """``"N train / M val tokens"``; with documents, their counts as well."""
    if isinstance(corpus, DocumentCorpus):
        train, val = corpus.train, corpus.val
        return (
            f"{len(train):,} train / {len(val):,} val documents, "
            f"{sum(len(d) for d in train):,} / {sum(len(d) for d in val):,} tokens"
        )
    return f"{len(corpus.train):,} train / {len(corpus.val):,} val tokens"


def _started_at(out: str) -> float | None:
    """When the run in ``out`` started (``config.json``; wall-clock seconds), if recorded."""
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get("resolved", {}).get("started_at")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _params_checksum(model: nn.Module) -> str:
    """A checksum of every parameter's bits: equal on two ranks that hold the same model."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    return checksum(flat)


def check_same_job(cfg: TrainConfig, corpus: Any) -> None:
    """Fail on every rank unless all run the same training settings on the same corpus (under
    torchrun each node parses its own flags). Settings that only change what is measured,
    reported or kept may differ, as on resume."""
    settings = [
        (f"setting {k}", repr(v))
        for k, v in cfg.to_dict().items()
        if k not in ckpt.RESUME_FREE_KEYS and k != "data"
    ]
    train, val = corpus.train, corpus.val
    if isinstance(train, list):  # documents
        train, val = torch.cat(train), torch.cat(val)
    tokens = f"{len(train)} train + {len(val)} val tokens"
    text = checksum(torch.cat([train, val]).to(torch.uint8))
    check_same_across_ranks(
        [*settings, ("corpus size", tokens), ("corpus (checksum)", text)],
        what="lowcomm train settings",
        hint="start every rank with the same flags, config file and --data contents",
    )
