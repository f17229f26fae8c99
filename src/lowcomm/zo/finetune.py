"""The ``lowcomm finetune`` job: fine-tune a pretrained model with zeroth-order MeZO (any mode of
:mod:`lowcomm.zo.mezo`) or, for comparison, first-order AdamW with DDP.

**Start.** A ``lowcomm train`` run (its folder or its ``checkpoint.pt``: the natural path is to
pretrain with CO2, then fine-tune), or with ``hf_llama`` a small ``LlamaForCausalLM`` built from
its config (random weights: MeZO barely moves a model that was never trained, so this is for
AdamW and for plumbing). Both read bytes (the byte tokenizer of ``lowcomm train``).

**Task** ``stdlib-code``: continue the model, pretrained on Python's English help topics, on
Python code: the source of a fixed list of standard-library modules (:data:`STDLIB_MODULES`),
split 90/10 into training and held-out text. It ships with Python and needs no download; the
held-out loss measures how far the model adapted to the new domain.

**Batches.** Every step draws one global batch of ``batch_size`` windows from a generator
seeded with ``seed``, the same on every rank, and each rank takes its part: all of it (single,
PertP), its 1/W slice (DDP, AdamW) or its pair's 1/D slice (2D). So every mode sees the same
data at each step, and their curves are comparable step for step.

**Records** (rank 0), in ``out``: ``metrics.jsonl`` (``step`` records every ``log_every``
steps: the loss, L₊ for ZO; ``eval`` records: the held-out loss at step 0, every
``eval_every`` steps and at the end), ``summary.json``: the held-out loss start → end, tokens/s,
bytes sent per worker per step, each worker's peak resident memory, the parameter count.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lowcomm.comm import CommStats, DDPCommMeter
from lowcomm.data import ByteTokenizer, get_batch, make_generator
from lowcomm.device import to_device
from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.runfiles import CheckpointError, MetricsWriter, load_checkpoint, write_json
from lowcomm.zo.mezo import MODES, MeZO

__all__ = [
    "METHODS",
    "STDLIB_MODULES",
    "TASKS",
    "FinetuneConfig",
    "FinetuneError",
    "check_init",
    "finetune",
    "task_tokens",
]

logger = logging.getLogger(__name__)

METHODS = ("zo", "adamw")
TASKS = ("stdlib-code",)
STDLIB_MODULES = (
    "argparse",
    "calendar",
    "csv",
    "dataclasses",
    "difflib",
    "fractions",
    "json.decoder",
    "json.encoder",
    "pprint",
    "shlex",
    "statistics",
    "string",
    "textwrap",
)
"""The standard-library modules whose source is the ``stdlib-code`` task, in this order."""


class FinetuneError(ValueError):
    """A bad ``lowcomm finetune`` setting, naming it and the fix."""


@dataclass
class FinetuneConfig:
    """The ``lowcomm finetune`` settings; every field is a flag (``--n-directions``)."""

    init: str | None = None
    """A lowcomm train run folder or its checkpoint.pt to start from (the pretrained model)."""
    hf_llama: bool = False
    """Start instead from a small LlamaForCausalLM built from its config (random weights)."""
    method: str = "zo"
    """zo (MeZO) or adamw (first-order AdamW with DDP, for comparison)."""
    mode: str = "single"
    """ZO's parallel mode: single, pertp (2 workers), ddp, 2d (an even number of workers)."""
    workers: int = 1
    """Worker processes."""
    task: str = "stdlib-code"
    """The fine-tuning task: stdlib-code (Python standard-library source, held out 10%)."""
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 16
    """Windows per step over all workers (each takes its part)."""
    block_size: int = 64
    """Tokens per window (at most the model's context)."""
    lr: float | None = None
    """Learning rate; unset: 1e-4 (for zo, from the default checkpoint: 3e-4 diverges)."""
    eps: float = 1e-3
    """ZO: the perturbation scale."""
    weight_decay: float = 0.0
    """Weight decay (ZO: MeZO's rule; AdamW: decoupled)."""
    n_directions: int = 1
    """ZO: estimates per step."""
    blockwise: bool = False
    """ZO: ZO2's fused dual forward (each block's two forwards back to back, the previous
    update applied lazily in the same pass); changes no bit. lowcomm train models only."""
    offload: bool = False
    """ZO: ZO2's offloading (implies --blockwise): the blocks' parameters stay in host memory
    and each is uploaded to the device just before its stage, two buffers in turn; changes no
    bit."""
    seed: int = 0
    """Seeds the batches and ZO's directions."""
    eval_every: int = 50
    """Steps between held-out evaluations."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    log_every: int = 10
    """Steps per training-loss record."""
    out: str | None = None
    """Output folder; unset: runs/finetune-<method>-<mode>."""
    overwrite: bool = False
    """Replace the files of a previous run in the output folder."""
    quiet: bool = False
    """Workers log warnings only."""
    threads: int | None = None
    """Intra-op threads per worker; unset: the machine's cores shared among the workers."""
    backend: str = "auto"
    """gloo, nccl, or auto (nccl with CUDA)."""
    collective_timeout: float = 300.0
    """Seconds a collective may wait for a peer."""

    max_restarts = 0  # the launcher's: a fine-tuning run is not restarted

    def __post_init__(self) -> None:
        def bad(key: str, problem: str) -> FinetuneError:
            return FinetuneError(f"--{key.replace('_', '-')} {problem}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.mode not in MODES:
            raise bad("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.task not in TASKS:
            raise bad("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")
        for key in ("workers", "steps", "batch_size", "block_size", "n_directions"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, f"must be an integer >= 1, got {value!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise bad("threads", f"must be an integer >= 1, got {self.threads!r}")
        for key in ("eval_every", "eval_batches", "log_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, f"must be an integer >= 1, got {value!r}")
        for key in ("blockwise", "offload"):
            if getattr(self, key) and (
                self.method != "zo" or self.hf_llama or self.n_directions != 1
            ):
                raise bad(
                    key,
                    "is for --method zo with one direction on a lowcomm train model (its stages)",
                )
        if (self.init is None) == (not self.hf_llama):
            raise bad(
                "init",
                "names the model to fine-tune: a lowcomm train run folder or checkpoint.pt "
                "(lowcomm train writes one), or pass --hf-llama instead (not both)",
            )
        w = self.workers
        if self.method == "adamw":
            if self.mode not in ("single", "ddp"):
                raise bad("mode", f"{self.mode!r} is a ZO mode; adamw runs DDP (--mode ddp)")
        elif self.mode == "single" and w != 1:
            raise bad("workers", f"must be 1 for --mode single, got {w}; or choose --mode ddp")
        elif self.mode == "pertp" and w != 2:
            raise bad("workers", f"must be 2 for --mode pertp (one per sign), got {w}")
        elif self.mode == "2d" and w % 2:
            raise bad("workers", f"must be even for --mode 2d (pairs), got {w}")
        if self.batch_size % self.shards:
            raise bad(
                "batch_size",
                f"must divide into {self.shards} equal shards ({self.mode} on {w} workers), "
                f"got {self.batch_size}",
            )
        if self.init is not None and not os.path.isfile(checkpoint_path(self.init)):
            raise bad(
                "init",
                f"{self.init}: no lowcomm train checkpoint there (expected a run folder holding "
                "checkpoint.pt, or the file itself); run lowcomm train first",
            )

    @property
    def world_size(self) -> int:
        return self.workers

    @property
    def shards(self) -> int:
        """How many parts a global batch is cut into."""
        if self.method == "zo" and self.mode in ("single", "pertp"):
            return 1
        if self.method == "zo" and self.mode == "2d":
            return self.workers // 2
        return self.workers

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return float(self.lr)
        return 1e-4

    def with_paths(self) -> FinetuneConfig:
        out = self.out or os.path.join("runs", f"finetune-{self.method}-{self.mode}")
        return dataclasses.replace(self, out=out)


# -- the task and the model ---------------------------------------------------------------------


def checkpoint_path(init: str) -> str:
    """The ``checkpoint.pt`` that ``--init`` names (a run folder, or the file itself)."""
    return os.path.join(init, "checkpoint.pt") if os.path.isdir(init) else init


def task_tokens(task: str = "stdlib-code") -> tuple[torch.Tensor, torch.Tensor]:
    """The task's (training, held-out) byte tokens."""
    assert task in TASKS, task
    text = "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in STDLIB_MODULES)
    tokens = ByteTokenizer().encode_tensor(text)
    n_train = int(len(tokens) * 0.9)
    return tokens[:n_train].clone(), tokens[n_train:].clone()


class _LlamaBytes(nn.Module):
    """A LlamaForCausalLM over bytes with lowcomm's (idx, targets) -> (logits, loss) interface."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=block_size,
        )
        self.model = LlamaForCausalLM(config)
        self.block_size = block_size

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=idx).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def load_model(cfg: FinetuneConfig) -> tuple[nn.Module, int]:
    """The model to fine-tune and its context length."""
    if cfg.hf_llama:
        torch.manual_seed(cfg.seed)
        return _LlamaBytes(cfg.block_size), cfg.block_size
    assert cfg.init is not None
    path = checkpoint_path(cfg.init)
    hint = "pass the folder or checkpoint.pt of a lowcomm train run"
    try:
        state = load_checkpoint(path, what="a lowcomm train checkpoint", hint=hint)
    except CheckpointError as e:
        raise FinetuneError(f"--init {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise FinetuneError(f"--init {path!r} is not a lowcomm train checkpoint; {hint}")
    train = state.get("config") or {}
    try:
        config = GPTConfig(
            vocab_size=int(state["model"]["wte.weight"].shape[0]),
            block_size=int(train["block_size"]),
            n_layer=int(train["n_layer"]),
            n_head=int(train["n_head"]),
            n_embd=int(train["n_embd"]),
            dropout=0.0,
        )
    except (KeyError, TypeError) as e:
        raise FinetuneError(
            f"--init {cfg.init}: not a lowcomm train checkpoint (missing {e}); pass the "
            "checkpoint.pt of a lowcomm train run"
        ) from None
    model = GPT(config)
    model.load_state_dict(state["model"])
    return model, config.block_size


def check_init(cfg: FinetuneConfig) -> None:
    """Before any worker starts: ``--init`` is a lowcomm train checkpoint whose model takes
    ``--block-size`` tokens (raises :class:`FinetuneError`, a ``ValueError``)."""
    if cfg.init is None:
        return
    _, context = load_model(cfg)
    _check_context(cfg, context)


def _check_context(cfg: FinetuneConfig, context: int) -> None:
    if cfg.block_size > context:
        raise FinetuneError(
            f"--block-size {cfg.block_size} is longer than the model's context ({context}); "
            f"use at most {context}"
        )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _, loss = model(x, y)
    return loss


@torch.no_grad()
def _evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    total = sum(float(_loss(model, x, y)) for x, y in batches)
    model.train(was)
    return total / len(batches)


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# -- the job ----------------------------------------------------------------------------------


def finetune(cfg: FinetuneConfig, *, device: torch.device) -> dict[str, Any] | None:
    """Run the job on an initialised process group (see the module docstring); returns the
    summary on rank 0."""
    assert cfg.out is not None
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, context = load_model(cfg)
    _check_context(cfg, context)
    if not cfg.offload:
        model.to(device)  # offloaded: MeZO places each stage (on the first evaluation)
    train_tokens, val_tokens = task_tokens(cfg.task)
    gen = make_generator(cfg.seed, 0)  # the same global batches on every rank
    val_gen = make_generator(cfg.seed + 1, 0)
    val: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(cfg.eval_batches):
        vx, vy = get_batch(val_tokens, cfg.batch_size, cfg.block_size, val_gen)
        val.append((vx.to(device), vy.to(device)))
    shard = _shard_index(cfg, rank)
    per_shard = cfg.batch_size // cfg.shards
    lr = cfg.learning_rate
    zo: MeZO | None = None
    optimizer: torch.optim.Optimizer | None = None
    step_model: nn.Module = model
    meter: DDPCommMeter | None = None
    stats: CommStats
    if cfg.method == "zo":
        mode = cfg.mode if world > 1 else "single"
        zo = MeZO(
            model,
            lr=lr,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            n_directions=cfg.n_directions,
            seed=cfg.seed,
            mode=mode,
            blockwise=cfg.blockwise,
            offload=cfg.offload,
            device=device if cfg.offload else None,
        )
        stats = zo.stats
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
        stats = CommStats()
        if world > 1:
            step_model = nn.parallel.DistributedDataParallel(model)
            meter = DDPCommMeter()
            meter.register(step_model)
            stats = meter.stats
    records = _Records(cfg) if rank == 0 else None

    def evaluate() -> float:
        if zo is not None and zo.blockwise:  # the pending update applied, blocks streamed
            assert isinstance(model, GPT)
            losses = [float(zo.evaluate(model.zo_stages(x, y))) for x, y in val]
            return sum(losses) / len(losses)
        return _evaluate(model, val)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    val_start = evaluate()
    if records is not None:
        records.eval(0, val_start)
    t0 = time.perf_counter()
    eval_s = 0.0
    loss_sum, losses = 0.0, 0
    for step in range(1, cfg.steps + 1):
        x, y = get_batch(train_tokens, cfg.batch_size, cfg.block_size, gen)
        x = to_device(x[shard * per_shard : (shard + 1) * per_shard], device)
        y = to_device(y[shard * per_shard : (shard + 1) * per_shard], device)
        if zo is not None:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return _loss(model, x, y)

            if zo.blockwise:
                assert isinstance(model, GPT)
                result = zo.step(stages=model.zo_stages(x, y), weight=float(x.shape[0]))
            else:
                result = zo.step(closure, weight=float(x.shape[0]))
            loss = result.loss
        else:
            assert optimizer is not None
            step_loss = _loss(step_model, x, y)
            step_loss.backward()
            if meter is not None:
                meter.backward_done()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(step_loss.detach())
        loss_sum, losses = loss_sum + loss, losses + 1
        if records is not None and (step % cfg.log_every == 0 or step == cfg.steps):
            records.step(step, loss_sum / losses, losses, time.perf_counter() - t0)
            loss_sum, losses = 0.0, 0
        if step % cfg.eval_every == 0 or step == cfg.steps:
            t_eval = time.perf_counter()
            val_loss = evaluate()
            eval_s += time.perf_counter() - t_eval
            if records is not None:
                records.eval(step, val_loss)
    train_s = time.perf_counter() - t0 - eval_s
    if zo is not None and world > 1:
        zo.check_replicas()
    if meter is not None:
        meter.settle()  # (a GPU's blocked time, measured by events)
    per_rank: dict[str, Any] = {
        "rank": rank,
        "peak_rss_bytes": _peak_rss_bytes(),
        **stats.metrics(),
    }
    if device.type == "cuda":
        per_rank["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    if zo is not None and zo.offloader is not None:
        per_rank["offload"] = zo.offloader.summary()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, per_rank)
    if records is None:
        return None
    summary = records.summary(
        val_start=val_start,
        train_s=train_s,
        per_rank=gathered,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    records.close()
    return summary


def _shard_index(cfg: FinetuneConfig, rank: int) -> int:
    if cfg.method == "zo" and cfg.mode in ("single", "pertp"):
        return 0
    if cfg.method == "zo" and cfg.mode == "2d":
        return rank // 2
    return rank


class _Records:
    """Rank 0's ``metrics.jsonl``, progress and summary."""

    def __init__(self, cfg: FinetuneConfig) -> None:
        assert cfg.out is not None
        os.makedirs(cfg.out, exist_ok=True)
        self.cfg = cfg
        self.writer = MetricsWriter(os.path.join(cfg.out, "metrics.jsonl"))
        self.val: list[tuple[int, float]] = []
        self.bar = None
        if sys.stderr.isatty() and not cfg.quiet:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.steps, desc=f"{cfg.method} {cfg.mode}", unit="step")

    def step(self, step: int, loss: float, steps: int, elapsed_s: float) -> None:
        self.writer.write(
            {"kind": "step", "step": step, "steps": steps, "loss": loss, "elapsed_s": elapsed_s}
        )
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def eval(self, step: int, val_loss: float) -> None:
        self.val.append((step, val_loss))
        self.writer.write({"kind": "eval", "step": step, "val_loss": val_loss})
        if self.bar is None and not self.cfg.quiet:
            logger.info("step %d/%d  held-out loss %.4f", step, self.cfg.steps, val_loss)

    def summary(
        self, *, val_start: float, train_s: float, per_rank: list[dict[str, Any]], parameters: int
    ) -> dict[str, Any]:
        cfg = self.cfg
        tokens = cfg.steps * cfg.batch_size * cfg.block_size
        sent = [r["bytes_sent"] for r in per_rank]
        summary = {
            "out": cfg.out,
            "method": cfg.method,
            "mode": cfg.mode if cfg.method == "zo" else ("ddp" if cfg.workers > 1 else "single"),
            "workers": cfg.workers,
            "threads_per_worker": torch.get_num_threads(),
            "steps": cfg.steps,
            "lr": cfg.learning_rate,
            "task": cfg.task,
            "init": cfg.init if not cfg.hf_llama else "hf-llama (random)",
            "parameters": parameters,
            "tokens": tokens,
            "train_s": train_s,
            "tokens_per_s": tokens / train_s if train_s > 0 else None,
            "val_loss_initial": val_start,
            "val_loss_final": self.val[-1][1],
            "bytes_sent_per_worker_per_step": sum(sent) / len(sent) / cfg.steps,
            "peak_rss_bytes_per_worker": [r["peak_rss_bytes"] for r in per_rank],
            "peak_device_bytes_per_worker": [r.get("peak_device_bytes") for r in per_rank],
            "offload": per_rank[0].get("offload"),
            "per_rank": per_rank,
            "config": dataclasses.asdict(cfg),
        }
        write_json(os.path.join(cfg.out or ".", "summary.json"), summary)
        return summary

    def close(self) -> None:
        self.writer.close()
        if self.bar is not None:
            self.bar.close()
