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
``sync_every``, right after a round boundary, where the live parameters equal the consensus
anchor on every rank) and at the end after ``algo.finish()``. Two algorithms differ:

* ``streaming``: fragments are synced at different steps, so the live parameters are never the
  consensus as a whole between sync points; the anchor A (``algo.anchor_views``) is evaluated
  instead, copied into the model for the evaluation and the live parameters restored after it,
  so training is unaffected;
* ``co2-eager``: right after a round boundary rank 0's live parameters equal its own anchor,
  which holds its own fresh pseudo-gradient as well as the others' stale ones; that is what is
  evaluated.

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
``collective_timeout`` seconds, so a worker whose peer died or stalled fails instead of hanging;
every failure is recorded for the launcher, marked as a lost peer when it is one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.link import EmulatedLink
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.train import checkpoint as ckpt
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.metrics import (
    CHECKPOINT_NOTE,
    MetricsWriter,
    plot_losses,
    save_checkpoint,
    write_json,
)

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = [
    "FAULT_ENV",
    "attempt",
    "error_line",
    "is_peer_loss",
    "resolve_backend",
    "run_worker",
    "train",
]

logger = logging.getLogger(__name__)

FAULT_ENV = "LOWCOMM_FAULT_INJECT"
"""For tests only: ``"RANK:STEP[:MODE]"`` makes that rank fail right after ``algo.step()`` of
that step, in the first attempt of the worker group only (``TORCHELASTIC_RESTART_COUNT`` 0):
MODE ``kill`` (default: SIGKILL itself), ``exit`` (``os._exit(3)``), ``hang`` (stop without
exiting, until the others time out), ``raise`` (a ``RuntimeError``) or ``nan`` (set one value
of its first parameter to NaN and go on: a diverging worker). Not a user setting."""

_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")
_PEER_LOSS = re.compile(r"connection (closed|reset)|broken pipe|timed out|timeout", re.IGNORECASE)


def attempt() -> int:
    """Which attempt of the worker group this is: 0, or the number of restarts so far (torch
    elastic's ``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` is what a worker sees when a peer died or stalled (a lost connection or
    a collective timeout): a knock-on effect, not the root cause of a failed job."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and bool(_PEER_LOSS.search(str(error)))


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when CUDA is available, else ``gloo``."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def _loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _setup_worker_logging(rank: int, quiet: bool = False) -> None:
    # Spawned workers start with a fresh interpreter: configure the lowcomm loggers again.
    # Under torchrun the CLI in this same process has configured them already.
    root = logging.getLogger("lowcomm")
    root.setLevel(logging.INFO if rank == 0 and not quiet else logging.WARNING)
    if root.handlers:
        return
    handler = logging.StreamHandler()
    fmt = "%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.propagate = False


def error_line(error: BaseException) -> str:
    """``"Type: first line of the message"``: how a worker's failure is reported."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    # gloo prefixes its errors with its source location: "[/path/unbound_buffer.cc:78] Timed out"
    return f"{type(error).__name__}: {_SOURCE_LOCATION.sub('', lines[0])}"


def run_worker(
    cfg: TrainConfig, launched_locally: bool, failure_dir: str | None = None
) -> dict[str, Any] | None:
    """Entry point of one worker process: set up ``torch.distributed`` from the environment
    (torchrun / elastic launch variables), train, tear down.

    Args:
        cfg: the checked configuration, ``name`` and ``out`` resolved. Passed as it is (pickled
            to a spawned worker), so it is not checked again.
        launched_locally: ``True`` when ``lowcomm train`` launched this worker on this machine;
            gloo is then bound to the loopback interface.
        failure_dir: where to record an exception (``failure-rank<r>-attempt<a>.json``: error,
            traceback, time, attempt, whether it is a lost peer), so the launcher can tell the
            first failure from its knock-on effects, and a restarted group what went wrong.

    Returns:
        The run summary on global rank 0, ``None`` elsewhere.
    """
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run_worker(cfg, launched_locally, rank, failure_dir)
    except BaseException as e:
        if failure_dir is not None:
            _record_failure(failure_dir, rank, e)
        raise


def _record_failure(folder: str, rank: int, error: BaseException) -> None:
    record = {
        "rank": rank,
        "time": time.time(),
        "attempt": attempt(),
        "error": error_line(error),
        "peer_lost": is_peer_loss(error),
        "traceback": traceback.format_exc(),
    }
    path = os.path.join(folder, f"failure-rank{rank}-attempt{attempt()}.json")
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:  # the launcher falls back to torch elastic's own record
        pass


def _describe_attempt(folder: str | None, number: int) -> str:
    """What the failure records of attempt ``number`` say, in a few words."""
    records = []
    if folder is not None and os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.startswith("failure-rank") and name.endswith(f"-attempt{number}.json"):
                try:
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        records.append(json.load(f))
                except (OSError, ValueError):
                    continue
    primary = sorted((r for r in records if not r.get("peer_lost")), key=lambda r: r["time"])
    if primary:
        return f"worker rank {primary[0]['rank']} failed: {primary[0]['error']}"
    if records:
        return "a worker died without an error record (its peers lost the connection)"
    return "a worker failed"


def _run_worker(
    cfg: TrainConfig, launched_locally: bool, rank: int, failure_dir: str | None
) -> dict[str, Any] | None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _setup_worker_logging(rank, cfg.quiet)
    # Workers on one machine share its cores; oversubscribing them slows everyone down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))

    backend = resolve_backend(cfg.backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if launched_locally:
            lo = _loopback_interface()
            if lo is not None:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    if rank == 0 and attempt() > 0:
        logger.warning(
            "worker group restarted (restart %d) after a failure: %s",
            attempt(),
            _describe_attempt(failure_dir, attempt() - 1),
        )
    # A collective that waits longer than this for a peer fails instead of hanging: a dead or
    # stalled worker stops the others within a bounded time.
    timeout = datetime.timedelta(seconds=cfg.collective_timeout)
    if launched_locally:
        store = _loopback_store(rank, timeout)
        world = int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    try:
        summary = train(cfg, device=device)
        # Leave together: a rank tearing down its process group while rank 0 is still writing
        # the run folder can abort in gloo's connection threads at interpreter exit.
        dist.barrier()
        return summary
    finally:
        dist.destroy_process_group()


def _loopback_store(rank: int, timeout: datetime.timedelta) -> dist.Store:
    """The store of a locally launched group, at the ``MASTER_PORT`` the elastic agent chose.

    Rank 0 hosts it on a socket bound to 127.0.0.1 (a store created by ``env://`` listens on
    every interface); the others connect to it. The launcher has the agent pick a fresh port for
    every attempt, so a restarted group never reads the previous attempt's addresses.
    """
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    return host_loopback_store(port, timeout=timeout)


def host_loopback_store(port: int, **kwargs: Any) -> dist.TCPStore:
    """A ``TCPStore`` server listening on 127.0.0.1 only, at ``port`` (0: a free port; read it
    back from ``store.port``). ``kwargs`` go to ``TCPStore`` (``timeout``, ``multi_tenant``)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        store = dist.TCPStore(
            "127.0.0.1",
            int(listener.getsockname()[1]),
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            **kwargs,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now and closes it
    return store


def build_gpt(cfg: TrainConfig, vocab_size: int) -> GPT:
    """The job's GPT for ``cfg`` (seed the torch RNG first for a reproducible initialisation)."""

    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=cfg.block_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            dropout=cfg.dropout,
        )
    )


def _param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    # nanoGPT's grouping: decay weight matrices and embeddings, not biases or LayerNorm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _inner_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(_param_groups(model, cfg), lr=cfg.lr, betas=(0.9, 0.95))


def _zero_optimizer(
    model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup | None
) -> ZeroRedundancyOptimizer:
    """The inner AdamW with its state sharded across ``group`` (``--node-sharding zero``).

    ZeroRedundancyOptimizer takes the same parameter groups as AdamW: it partitions each group
    across the ranks (whole parameters, largest first, to the least loaded rank) and gives each
    rank a local AdamW (``.optim``) over its share with the group's settings, so weight decay
    stays off biases and LayerNorm gains. After every ``step()`` each rank broadcasts the
    parameters it updated to the group: one flat bucket per rank (``parameters_as_bucket_view``:
    the parameters become views into those buckets, updated in place as before) rather than one
    broadcast per parameter, which on gloo cost about a third of the throughput of the small GPT.
    AdamW's update is elementwise per parameter, so this gives the same bits as one AdamW over
    every parameter. ``overlap_with_ddp`` is not used: on gloo torch refuses it (it may hang).
    """
    # imported here: torch.distributed.optim scripts its functional optimizers on import
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        _param_groups(model, cfg),
        optimizer_class=torch.optim.AdamW,
        process_group=group,
        parameters_as_bucket_view=True,
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )


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
def _evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


@torch.no_grad()
def _evaluate_with(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
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

    With ``cfg.resume``, or in a restarted worker group (:func:`attempt` > 0) whose run has a
    complete checkpoint, every rank continues from its part of that checkpoint
    (:mod:`lowcomm.train.checkpoint`).

    Returns the run summary on rank 0, ``None`` elsewhere.
    """
    from lowcomm.comm import CommStats, DDPCommMeter
    from lowcomm.data import eval_batches, get_batch, load_corpus, make_generator
    from lowcomm.outer import StreamingDiLoCo

    assert cfg.out is not None and cfg.name is not None, "call TrainConfig.with_paths() first"
    rank = dist.get_rank()
    world = dist.get_world_size()
    is_main = rank == 0

    source = _resume_source(cfg, rank, world)
    state = ckpt.load_rank_state(source, rank, world) if source is not None else None
    start = int(state["step"]) if state is not None else 0
    if is_main:
        os.makedirs(cfg.out, exist_ok=True)
        # What the stopped run wrote after the point this one continues from is discarded.
        ckpt.discard_after(cfg.out, start)
        if source is not None:
            # resuming into another folder: its records start as the checkpoint's run's
            earlier = os.path.join(ckpt.run_folder_of(source), "metrics.jsonl")
            ckpt.truncate_metrics(os.path.join(cfg.out, "metrics.jsonl"), start, source=earlier)
    dist.barrier()  # no rank writes a checkpoint before the folder is cleaned up

    corpus = load_corpus(cfg.data)
    _check_same_job(cfg, corpus)
    groups = _node_groups(cfg, world)
    torch.manual_seed(cfg.seed)  # identical initial model on every rank
    gpt = build_gpt(cfg, corpus.vocab_size).to(device)
    if state is not None:
        gpt.load_state_dict(state["model"])
    inner: torch.optim.Optimizer
    zero: ZeroRedundancyOptimizer | None = None
    if cfg.node_sharding == "zero":
        inner = zero = _zero_optimizer(gpt, cfg, groups.node)
        if state is not None:  # this rank's shard (see save())
            zero.optim.load_state_dict(state["optimizer"])
    else:
        inner = _inner_optimizer(gpt, cfg)
        if state is not None:
            inner.load_state_dict(state["optimizer"])
    ceiling = _Ceiling(gpt, cfg, corpus, rank, device) if cfg.ceiling_steps else None

    algo = None
    meter: Any = None
    node_meter: DDPCommMeter | None = None  # DDP inside the node (node groups)
    ddp_compression: Any = None  # the compressed DDP hook's state (residuals), when used
    link = EmulatedLink.parse(cfg.link) if cfg.link is not None else None
    ddp_kwargs: dict[str, Any] = {"bucket_cap_mb": cfg.bucket_cap_mb}
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
    if cfg.algo == "ddp":
        # with nodes, still DDP over every process: the layout sets their number (and the
        # group ZeRO shards over), not what is synchronised
        ddp = nn.parallel.DistributedDataParallel(gpt, **ddp_kwargs)
        model: nn.Module = ddp
        if cfg.compression is not None:
            from lowcomm.compress import ddp_hook

            hook_state, hook = ddp_hook(
                cfg.compression, process_group=link.communicator() if link is not None else None
            )
            ddp.register_comm_hook(hook_state, hook)
            if state is not None and state.get("ddp_hook") is not None:
                hook_state.load_state_dict(state["ddp_hook"])
            ddp_compression = hook_state
            meter = hook_state
        else:
            meter = DDPCommMeter(link=link.model() if link is not None else None)
            meter.register(ddp)
        stats = meter.stats
    elif cfg.algo == "none":
        model = gpt  # the no-sync ceiling: every worker trains alone
        stats = CommStats()
    else:
        model = gpt
        if cfg.hierarchical:
            # one replica per node: its processes average gradients every step (the fast
            # local network, never the emulated link)
            model = nn.parallel.DistributedDataParallel(
                gpt, process_group=groups.node, **ddp_kwargs
            )
            node_meter = DDPCommMeter()
            node_meter.register(model)
        outer_group: Any = groups.cross
        if link is not None:
            outer_group = _node_link(link, cfg).communicator(groups.cross)
        # The model itself, not its parameters: streaming builds its fragments from its blocks.
        # With ZeRO the algorithm gets this rank's local AdamW, whose state is the one it zeroes
        # on a non-finite average (the wrapper's own ``state`` stays empty).
        algo = cfg.algorithm_class()(
            gpt,
            zero.optim if zero is not None else inner,
            process_group=outer_group,
            **cfg.algorithm_kwargs(),
        )
        if state is not None:
            algo.load_state_dict(state["algorithm"])
        stats = algo.stats
    if state is not None:
        _restore_stats(stats, state.get("comm_stats") or {})
        if node_meter is not None:
            _restore_stats(node_meter.stats, state.get("intra_node_stats") or {})

    gen = make_generator(cfg.seed, rank)
    if state is not None:
        gen.set_state(state["rng"]["data"])
    val = [
        (x.to(device), y.to(device))
        for x, y in eval_batches(corpus.val, cfg.batch_size, cfg.block_size, cfg.eval_batches)
    ]
    tokens_per_step = cfg.batch_size * cfg.block_size * world
    eval_interval = cfg.eval_interval

    progress: _Progress | None = None
    if is_main:
        write_json(os.path.join(cfg.out, "config.json"), _resolved_config(cfg, world, corpus))
        logger.info(
            "lowcomm train: %s, %s (%s), %.2f M parameters, corpus %s "
            "(%d train / %d val tokens), %d steps of %d tokens per worker",
            cfg.algo,
            _describe_layout(cfg, world),
            dist.get_backend(),
            gpt.num_parameters() / 1e6,
            corpus.source,
            len(corpus.train),
            len(corpus.val),
            cfg.steps,
            cfg.batch_size * cfg.block_size,
        )
        progress = _Progress(cfg, world, tokens_per_step, stats, device, append=state is not None)

    def rounds() -> int:
        return int(getattr(algo, "rounds", 0)) if algo is not None else 0

    def evaluate(step: int) -> float:
        t0 = time.perf_counter()
        if isinstance(algo, StreamingDiLoCo):
            val_loss = _evaluate_with(gpt, val, algo.anchor_views)
        else:
            val_loss = _evaluate(gpt, val)
        if progress is not None:
            progress.eval(step, val_loss, rounds(), time.perf_counter() - t0)
        return val_loss

    def save(step: int) -> None:
        rank_state = {
            "step": step,
            "rank": rank,
            "world_size": world,
            "model": {k: v.detach().cpu() for k, v in gpt.state_dict().items()},
            # with ZeRO, this rank's shard: its local AdamW (the partition is deterministic)
            "optimizer": zero.optim.state_dict() if zero is not None else inner.state_dict(),
            # waits for in-flight all-reduces (not applying them) before the counters are read
            "algorithm": algo.state_dict() if algo is not None else None,
            "ddp_hook": ddp_compression.state_dict() if ddp_compression is not None else None,
            "rng": _rng_state(gen, device),
            "comm_stats": dataclasses.asdict(stats),
            "intra_node_stats": (
                dataclasses.asdict(node_meter.stats) if node_meter is not None else None
            ),
            "progress": progress.state_dict() if progress is not None else None,
        }
        ckpt.write_rank_state(cfg.out or ".", step, rank, rank_state)
        dist.barrier()  # every rank's part is on disk before the manifest makes it complete
        if is_main:
            folder = ckpt.publish(
                cfg.out or ".",
                step,
                {"world_size": world, "attempt": attempt(), "config": cfg.to_dict()},
                keep=cfg.keep_checkpoints,
            )
            logger.debug("checkpoint of step %d written to %s", step, folder)

    fault = _fault_point(rank)
    if ceiling is not None:
        ceiling.run(cfg.ceiling_steps // 2)
    if state is not None:
        _set_rng_state(state["rng"], device)
    elapsed_before = 0.0
    if progress is not None and state is not None:
        elapsed_before = progress.resume(start, state["progress"], source, attempt())
    t_start = time.perf_counter() - elapsed_before
    if progress is not None:
        progress.start(t_start)
    val_start = evaluate(0) if state is None else float("nan")
    if progress is not None and state is not None:
        val_start = progress.val_start
    for step in range(start + 1, cfg.steps + 1):
        lr = _lr_at(step, cfg)
        for group in inner.param_groups:
            group["lr"] = lr
        x, y = get_batch(corpus.train, cfg.batch_size, cfg.block_size, gen)
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        loss.backward()
        if meter is not None:
            meter.backward_done()
        if node_meter is not None:
            node_meter.backward_done()
        inner.step()
        inner.zero_grad(set_to_none=True)
        if algo is not None:
            algo.step()
        if fault is not None and fault[0] == step:
            _inject_fault(fault[1], rank, step, cfg.collective_timeout, model=gpt)
        if progress is not None:
            progress.step(step, loss, lr, flush=step % eval_interval == 0 or step == cfg.steps)
        if step % eval_interval == 0 and step < cfg.steps:
            evaluate(step)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save(step)

    if algo is not None:
        algo.finish()
    val_end = evaluate(cfg.steps)
    wall_s = time.perf_counter() - t_start
    if progress is not None:
        progress.close()
    if ceiling is not None:
        ceiling.run(cfg.ceiling_steps - cfg.ceiling_steps // 2)

    per_rank = {
        "rank": rank,
        "rounds": rounds(),
        "skipped_updates": int(getattr(algo, "skipped_updates", 0)),
        **stats.as_dict(),
        "intra_node": node_meter.stats.as_dict() if node_meter is not None else None,
        "params_checksum": _params_checksum(gpt),
    }
    # ZeRO's group: the node's processes, or every process for ddp on one node (under torchrun,
    # the world size is torchrun's, not cfg.workers)
    if zero is not None and rank < (cfg.procs_per_node or world):
        # node 0 (its group rank 0 is rank 0) gathers the whole AdamW state for checkpoint.pt
        zero.consolidate_state_dict(to=0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_rank)

    if not is_main:
        return None
    assert progress is not None
    eval_s = progress.eval_s
    train_s = wall_s - eval_s
    model_state = {k: v.detach().cpu() for k, v in gpt.state_dict().items()}
    save_checkpoint(
        os.path.join(cfg.out, "checkpoint.pt"),
        {
            "rank": 0,
            "note": CHECKPOINT_NOTE,
            "step": cfg.steps,
            "config": cfg.to_dict(),
            "world_size": world,
            "model": model_state,
            "optimizer": inner.state_dict(),
            "algorithm": algo.state_dict() if algo is not None else None,
        },
    )
    tokens = cfg.steps * tokens_per_step
    summary = _summary(
        cfg,
        world=world,
        tokens=tokens,
        wall_s=wall_s,
        train_s=train_s,
        eval_s=eval_s,
        val_start=val_start,
        val_end=val_end,
        per_rank=gathered,
        n_params=gpt.num_parameters(),
        ceiling=None if ceiling is None else ceiling.summary(tokens_per_step),
    )
    summary["resumed_at"] = list(progress.resumed_at)
    write_json(os.path.join(cfg.out, "summary.json"), summary)
    plot_losses(
        os.path.join(cfg.out, "metrics.jsonl"),
        os.path.join(cfg.out, "loss.png"),
        title=f"{cfg.name}: {cfg.algo}, {_describe_layout(cfg, world)}",
    )
    return summary


@dataclasses.dataclass
class _NodeGroups:
    """This rank's process groups under ``nodes`` > 1 (``None``: WORLD, the flat layout)."""

    node: dist.ProcessGroup | None
    """The M ranks of this rank's node: DDP (with node groups) and ZeRO run inside it."""
    cross: dist.ProcessGroup | None
    """The K ranks with this rank's local index, one per node: the outer algorithm's group."""


def _node_groups(cfg: TrainConfig, world: int) -> _NodeGroups:
    """Create the node groups and the cross-node groups of ``cfg``'s layout.

    Ranks are node-major (node n holds ranks n*M ... n*M+M-1, as torchrun numbers them), so
    local index j's cross group is {j, M+j, 2M+j, ...}. Every rank creates every group, in the
    same order, as torch.distributed requires.
    """
    if cfg.nodes == 1 or not (cfg.hierarchical or cfg.node_sharding == "zero"):
        return _NodeGroups(node=None, cross=None)
    k, m = cfg.nodes, cfg.procs_per_node
    assert m is not None and k * m == world, (k, m, world)
    timeout = datetime.timedelta(seconds=cfg.collective_timeout)
    node, _ = dist.new_subgroups_by_enumeration(
        [[n * m + j for j in range(m)] for n in range(k)], timeout=timeout
    )
    cross = None
    if cfg.hierarchical:
        cross, _ = dist.new_subgroups_by_enumeration(
            [[n * m + j for n in range(k)] for j in range(m)], timeout=timeout
        )
    return _NodeGroups(node=node, cross=cross)


def _node_link(link: EmulatedLink, cfg: TrainConfig) -> EmulatedLink:
    """The emulated link one process of a node sees. ``--link`` is the node's link to the
    others; with node groups each of its M processes runs the same schedule and sends its own
    full copy at the same time, so each gets 1/M of the bandwidth (the latency is the same)."""
    if not cfg.hierarchical or cfg.procs_per_node in (None, 1):
        return link
    m = cfg.procs_per_node
    return EmulatedLink(link.bandwidth_bps / m, link.latency_s)


def _describe_layout(cfg: TrainConfig, world: int) -> str:
    """``"4 workers"``, or ``"4 workers (2 nodes x 2)"`` with node groups."""
    if cfg.nodes == 1:
        return f"{world} workers"
    return f"{world} workers ({cfg.nodes} nodes x {cfg.procs_per_node})"


def _params_checksum(model: nn.Module) -> str:
    """A checksum of every parameter's bits: equal on two ranks that hold the same model."""
    from lowcomm.guard import checksum

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
    return checksum(flat)


def _check_same_job(cfg: TrainConfig, corpus: Any) -> None:
    """Fail on every rank unless all run the same training settings on the same corpus (under
    torchrun each node parses its own flags). Settings that only change what is measured,
    reported or kept may differ, as on resume."""
    from lowcomm.guard import check_same_across_ranks, checksum

    settings = [
        (f"setting {k}", repr(v))
        for k, v in cfg.to_dict().items()
        if k not in ckpt.RESUME_FREE_KEYS and k != "data"
    ]
    tokens = f"{len(corpus.train)} train + {len(corpus.val)} val tokens"
    text = checksum(torch.cat([corpus.train, corpus.val]).to(torch.uint8))
    check_same_across_ranks(
        [*settings, ("corpus size", tokens), ("corpus (checksum)", text)],
        what="lowcomm train settings",
        hint="start every rank with the same flags, config file and --data contents",
    )


def _resume_source(cfg: TrainConfig, rank: int, world: int) -> str | None:
    """The checkpoint folder every rank continues from, or ``None`` (start at step 0).

    Rank 0 decides and tells the others, so that all agree even while the folder changes: in a
    restarted worker group the latest complete checkpoint of this run, else ``cfg.resume``'s.
    A checkpoint of other settings is refused (:class:`ConfigError` on every rank).
    """
    choice: list[Any] = [None, None]  # folder, error
    if rank == 0:
        try:
            folder = None
            if attempt() > 0:
                found = ckpt.complete_checkpoints(cfg.out or ".")
                folder = found[-1][1] if found else None
            if folder is None and cfg.resume is not None:
                folder = ckpt.find_checkpoint(cfg.resume, cfg.out)
            if folder is not None:
                ckpt.check_compatible(folder, cfg, world)
            choice = [folder, None]
        except ConfigError as e:
            choice = [None, str(e)]
    dist.broadcast_object_list(choice, src=0)
    folder, error = choice
    if error is not None:
        raise ConfigError(None, error)
    if rank == 0:
        if folder is not None:
            logger.info("resuming from %s", folder)
        elif attempt() > 0:
            logger.warning("no complete checkpoint yet: the restarted run starts over at step 0")
    return folder


def _rng_state(gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state(), "data": gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _restore_stats(stats: Any, saved: dict[str, Any]) -> None:
    """Continue the communication counters from a checkpoint's."""
    for field in dataclasses.fields(stats):
        if field.name in saved:
            setattr(stats, field.name, type(getattr(stats, field.name))(saved[field.name]))


def _fault_point(rank: int) -> tuple[int, str] | None:
    """``(step, mode)`` of the fault :data:`FAULT_ENV` asks this rank to inject, if any."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or attempt() > 0:
        return None
    parts = spec.split(":")
    modes = ("kill", "exit", "hang", "raise", "nan")
    try:
        fault_rank, step = int(parts[0]), int(parts[1])
        mode = parts[2] if len(parts) > 2 else "kill"
    except (IndexError, ValueError):
        mode = ""
    if mode not in modes or len(parts) > 3:
        raise ValueError(f"{FAULT_ENV}={spec!r} must be RANK:STEP[:MODE], MODE one of {modes}")
    return (step, mode) if fault_rank == rank else None


def _inject_fault(mode: str, rank: int, step: int, timeout_s: float, *, model: nn.Module) -> None:
    logger.warning("%s: rank %d injects a fault (%s) at step %d", FAULT_ENV, rank, mode, step)
    if mode == "nan":  # a worker that diverges: one NaN in its first parameter
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] = float("nan")
        return
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        os._exit(3)
    elif mode == "hang":
        time.sleep(10 * timeout_s)  # the peers time out long before; the launcher stops us
    raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")


_COMPRESSIBLE = ("co2", "co2-eager", "diloco", "slowmo", "streaming", "cocodc", "ddp")


class _Ceiling:
    """The no-sync ceiling measured inside the job: the same worker processes time inner steps
    on a private copy of the model and inner optimizer with no synchronisation at all, half
    before training and half after, so the ceiling sees the machine as the training saw it.

    Every rank runs its segment at the same time (a barrier on each side), drawing batches from
    its own generator: the training's data order and model are untouched.
    """

    def __init__(
        self, gpt: nn.Module, cfg: TrainConfig, corpus: Any, rank: int, device: torch.device
    ) -> None:
        import copy

        from lowcomm.data import make_generator

        self.model = copy.deepcopy(gpt)
        self.optimizer = _inner_optimizer(self.model, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr
        self.cfg = cfg
        self.corpus = corpus
        self.device = device
        self.gen = make_generator(cfg.seed + 1_000_003, rank)
        self.segments: list[tuple[int, float]] = []  # (steps, seconds) on this rank
        self._step()  # untimed: optimizer state and allocator warm-up

    def _step(self) -> None:
        from lowcomm.data import get_batch

        x, y = get_batch(self.corpus.train, self.cfg.batch_size, self.cfg.block_size, self.gen)
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> None:
        if steps <= 0:
            return
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            self._step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.segments.append((steps, time.perf_counter() - t0))
        dist.barrier()

    def summary(self, tokens_per_step: int) -> dict[str, Any]:
        """Rank 0's ceiling in tokens/s (all workers' tokens, like the job's own figure), overall
        and per segment."""
        steps = sum(n for n, _ in self.segments)
        seconds = sum(s for _, s in self.segments)
        return {
            "steps": steps,
            "tokens_per_s": steps * tokens_per_step / seconds,
            "segments_tokens_per_s": [n * tokens_per_step / s for n, s in self.segments],
        }


class _Progress:
    """Rank 0's reporting: ``metrics.jsonl`` records, and a tqdm bar on a terminal (a log line
    per evaluation otherwise, so logs stay readable).

    Each step's loss is added to a running sum on the device; the sum is read back, written as
    one ``step`` record (the mean) and the bar moved on only every ``log_every`` steps and when
    the loop asks (before an evaluation, at the last step).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        world: int,
        tokens_per_step: int,
        stats: Any,
        device: torch.device,
        *,
        append: bool = False,
    ) -> None:
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.stats = stats
        path = os.path.join(cfg.out or ".", "metrics.jsonl")
        self.writer = MetricsWriter(path, append=append)
        self.t_start = time.perf_counter()
        self.eval_s = 0.0
        self.loss = float("nan")
        self.val = float("nan")
        self.val_start = float("nan")
        self.resumed_at: list[int] = []
        self._loss_sum = torch.zeros((), device=device)
        self._last_step = 0  # the step of the last record
        self.bar = None
        if sys.stderr.isatty() and not cfg.quiet:
            from tqdm.auto import tqdm

            layout = f"x{world}" if cfg.nodes == 1 else f"{cfg.nodes}x{cfg.procs_per_node}"
            self.bar = tqdm(
                total=cfg.steps, desc=f"{cfg.algo} {layout}", unit="step", dynamic_ncols=True
            )

    def start(self, t_start: float) -> None:
        self.t_start = t_start

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the records exactly (checkpoint ``progress``)."""
        return {
            "loss_sum": self._loss_sum.detach().cpu().clone(),
            "last_step": self._last_step,
            "elapsed_s": time.perf_counter() - self.t_start,
            "eval_s": self.eval_s,
            "loss": self.loss,
            "val": self.val,
            "val_start": self.val_start,
            "resumed_at": list(self.resumed_at),
        }

    def resume(self, step: int, state: dict[str, Any], source: str | None, restart: int) -> float:
        """Continue from a checkpoint's :meth:`state_dict` at ``step``; write a ``resume``
        record. Returns the elapsed time the stopped run had reached (the new start is that much
        earlier, so times continue)."""
        self._loss_sum.copy_(state["loss_sum"])
        self._last_step = int(state["last_step"])
        self.eval_s = float(state["eval_s"])
        self.loss, self.val = float(state["loss"]), float(state["val"])
        self.val_start = float(state["val_start"])
        self.resumed_at = [*state.get("resumed_at", []), step]
        self.writer.write(
            {"kind": "resume", "step": step, "checkpoint": source, "restart": restart}
        )
        if self.bar is not None:
            self.bar.update(step)
        return float(state["elapsed_s"])

    def _tokens_per_s(self, step: int) -> float:
        train_s = time.perf_counter() - self.t_start - self.eval_s
        return step * self.tokens_per_step / max(train_s, 1e-9)

    def _postfix(self, step: int) -> dict[str, str]:
        hidden = self.stats.hidden_fraction
        return {
            "loss": f"{self.loss:.3f}",
            "val": f"{self.val:.3f}",
            "tok/s": f"{self._tokens_per_s(step):,.0f}",
            "hidden": "-" if hidden is None else f"{hidden:.0%}",
        }

    def step(self, step: int, loss: torch.Tensor, lr: float, *, flush: bool = False) -> None:
        """Add step ``step``'s loss; record the mean since the last record every ``log_every``
        steps, or now when ``flush``."""
        self._loss_sum.add_(loss.detach())
        if not flush and step % self.cfg.log_every:
            return
        n = step - self._last_step
        self.loss = float(self._loss_sum) / n  # the one device sync per record
        self._loss_sum.zero_()
        self._last_step = step
        self.writer.write(
            {
                "kind": "step",
                "step": step,
                "steps": n,
                "loss": self.loss,
                "lr": lr,
                "tokens": step * self.tokens_per_step,
                "elapsed_s": time.perf_counter() - self.t_start,
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(step), refresh=False)
            self.bar.update(n)

    def eval(self, step: int, val_loss: float, rounds: int, eval_s: float) -> None:
        now = time.perf_counter()
        if step == 0:
            self.val_start = val_loss
        # Training time up to this evaluation: wall time less every evaluation so far.
        train_s = now - eval_s - self.t_start - self.eval_s
        self.eval_s += eval_s
        self.val = val_loss
        self.writer.write(
            {
                "kind": "eval",
                "step": step,
                "val_loss": val_loss,
                "tokens": step * self.tokens_per_step,
                "elapsed_s": now - self.t_start,
                "train_s": train_s,
                "rounds": rounds,
                **self.stats.as_dict(),
            }
        )
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(max(step, 1)), refresh=False)
        elif step > 0:
            p = self._postfix(step)
            logger.info(
                "step %d/%d  loss %s  val %s  tok/s %s  hidden %s",
                step,
                self.cfg.steps,
                p["loss"],
                p["val"],
                p["tok/s"],
                p["hidden"],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


def _resolved_config(cfg: TrainConfig, world: int, corpus: Any) -> dict[str, Any]:
    out = cfg.to_dict()
    out["resolved"] = {
        "world_size": world,
        "layout": _describe_layout(cfg, world),
        "backend": dist.get_backend(),
        "eval_interval": cfg.eval_interval,
        "algorithm_kwargs": cfg.algorithm_kwargs(),
        "corpus": str(corpus.source),
        "vocab_size": int(corpus.vocab_size),
        "torch": torch.__version__,
    }
    return out


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _summary(
    cfg: TrainConfig,
    *,
    world: int,
    tokens: int,
    wall_s: float,
    train_s: float,
    eval_s: float,
    val_start: float,
    val_end: float,
    per_rank: list[dict[str, Any]],
    n_params: int,
    ceiling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    workers = []
    for r in sorted(per_rank, key=lambda d: d["rank"]):
        workers.append(
            {
                **r,
                "payload_bytes_per_step": r["payload_bytes"] / cfg.steps,
                "wire_bytes_per_step": r["wire_bytes"] / cfg.steps,
            }
        )
    keys = (
        "collectives",
        "payload_bytes",
        "wire_bytes",
        "payload_bytes_per_step",
        "wire_bytes_per_step",
        "blocked_s",
        "in_flight_s",
        "hidden_fraction",
        "rounds",
    )
    skipped = max((int(w.get("skipped_updates", 0)) for w in workers), default=0)
    mean = {k: _mean([w[k] for w in workers]) for k in keys}
    checksums = {w.get("params_checksum") for w in workers}
    tokens_per_s = tokens / train_s if train_s > 0 else None
    if ceiling is not None and tokens_per_s is not None:
        ceiling["ratio"] = tokens_per_s / ceiling["tokens_per_s"]
    return {
        "algo": cfg.algo,
        "name": cfg.name,
        "out": cfg.out,
        "workers": world,
        "steps": cfg.steps,
        "sync_every": {"ddp": 1, "none": None}.get(cfg.algo, cfg.sync_every),
        "link": None if cfg.link is None else f"{cfg.link} (emulated)",
        "compression": cfg.compression if cfg.algo in _COMPRESSIBLE else None,
        "parameters": n_params,
        "tokens": tokens,
        "wall_time_s": wall_s,
        "train_time_s": train_s,
        "eval_time_s": eval_s,
        "tokens_per_s": tokens_per_s,
        "ceiling": ceiling,
        "val_loss_initial": val_start,
        "val_loss_final": val_end,
        "skipped_updates": skipped,
        "replicas_identical": len(checksums) == 1,
        "layout": _layout_summary(cfg, world, workers, mean),
        "comm_mean": mean,
        "comm_per_worker": workers,
    }


def _layout_summary(
    cfg: TrainConfig, world: int, workers: list[dict[str, Any]], mean: dict[str, Any]
) -> dict[str, Any] | None:
    """The node layout for ``summary.json`` (``None`` for the flat layout without ZeRO):
    ``comm_mean`` then counts what crosses nodes, ``intra_node`` DDP inside them."""
    if cfg.nodes == 1 and cfg.node_sharding == "none":
        return None
    per_node = cfg.procs_per_node if cfg.nodes > 1 else world
    assert per_node is not None
    intra = [w["intra_node"] for w in workers if w.get("intra_node") is not None]
    intra_mean = None
    if intra:
        keys = ("collectives", "payload_bytes", "wire_bytes", "blocked_s", "in_flight_s")
        intra_mean = {k: _mean([d[k] for d in intra]) for k in keys}
        for key in ("payload_bytes", "wire_bytes"):
            intra_mean[f"{key}_per_step"] = (intra_mean[key] or 0.0) / cfg.steps
    cross_wire = mean.get("wire_bytes")
    return {
        "nodes": cfg.nodes,
        "procs_per_node": per_node,
        "node_sharding": cfg.node_sharding,
        "across_nodes": cfg.algo,
        "link_per_process": (
            _node_link(EmulatedLink.parse(cfg.link), cfg).name if cfg.link is not None else None
        ),
        "cross_node_wire_bytes_per_node": (
            per_node * cross_wire if cfg.hierarchical and cross_wire is not None else None
        ),
        "intra_node": intra_mean,
    }
