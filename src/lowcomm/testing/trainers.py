"""Real Hugging Face ``Trainer`` and ``lightning.Trainer`` runs with lowcomm, on the ranks of
:func:`lowcomm.procs.workers.run_workers`: the scenarios ``tests/test_integrations.py`` checks,
run in one pair of processes so the libraries are imported once.

Each scenario trains a tiny ``LlamaForCausalLM`` (built from its config, seeded) on fixed
random token sequences and returns plain tensors and numbers to the parent.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.guard import checksum

__all__ = [
    "HF_STEPS",
    "HF_SYNC_EVERY",
    "LIGHTNING_SAMPLES",
    "hf_scenarios",
    "lightning_scenarios",
    "Sequences",
    "tiny_llama",
    "trainer_args",
    "trainer_scenarios",
]

HF_STEPS = 12
HF_SYNC_EVERY = 3
VOCAB = 64
SEQ = 16


def tiny_llama(seed: int = 0) -> Any:
    """A 2-layer ``LlamaForCausalLM`` of 23k parameters, initialised from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` fixed random token sequences (item i from seed 1000 + i), labels = inputs."""

    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _digest(model: torch.nn.Module) -> str:
    return checksum(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def trainer_args(out: str, **overrides: Any) -> Any:
    """The scenarios' ``TrainingArguments`` (CPU, gloo, 12 steps, accumulation 2), with
    ``overrides``."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": out,
        "use_cpu": True,
        "max_steps": HF_STEPS,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3,
        "report_to": [],
        "logging_steps": HF_SYNC_EVERY,
        "save_strategy": "no",
        "ddp_backend": "gloo",
        "disable_tqdm": True,
        "log_level": "error",
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def _trainer(out: str, model: Any = None, trainer_cls: Any = None, **overrides: Any) -> Any:
    from transformers import Trainer, TrainerCallback

    class Digests(TrainerCallback):  # each rank's model after every step
        def __init__(self) -> None:
            self.digests: list[str] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.digests.append(_digest(kw["model"]))

    cls = trainer_cls or Trainer
    trainer: Any = cls(
        model=model or tiny_llama(), args=trainer_args(out, **overrides), train_dataset=Sequences()
    )
    trainer.digests = Digests()
    trainer.add_callback(trainer.digests)
    return trainer


def _own_loop(out: str, rank: int) -> dict[str, torch.Tensor]:
    """lowcomm's own loop over the batches, optimizer and schedule the Trainer would use: the
    same model, data and seed, no Trainer loop."""
    import lowcomm

    model = tiny_llama()
    factory = _trainer(out, model=model)  # its data loader, optimizer and schedule only
    loader = factory.get_train_dataloader()
    inner = factory.create_optimizer()
    schedule = factory.create_scheduler(num_training_steps=HF_STEPS, optimizer=inner)
    algo = lowcomm.CO2(model, inner, sync_every=HF_SYNC_EVERY)
    batches = iter(loader)
    model.train()
    for _ in range(HF_STEPS):
        micro = [next(batches) for _ in range(2)]
        n_items = sum(b["labels"][..., 1:].ne(-100).sum() for b in micro)
        for b in micro:
            loss = model(**b, num_items_in_batch=n_items).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        inner.step()
        schedule.step()
        model.zero_grad()
        algo.step()
    algo.finish()
    return _params(model)


class _Plant:
    """A pickle that makes a folder named ``marker`` when it is loaded unsafely."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.marker,))


class _Planted:
    def __init__(self, folder: str, marker: str) -> None:
        self.folder = folder
        self.marker = marker


def _planted_copy(source: str, target: str, state_of: Any, rank: int) -> _Planted:
    """Copy the trainer checkpoint ``source`` (a folder or a file with its ``.lowcomm`` folder)
    to ``target`` on rank 0, then replace this rank's lowcomm state (``state_of(target)``) by
    a pickle that would run code if it were loaded unsafely."""
    import shutil

    if rank == 0:
        if os.path.isdir(source):
            shutil.copytree(source, target)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy(source, target)
            shutil.copytree(f"{source}.lowcomm", f"{target}.lowcomm")
    dist.barrier()
    marker = os.path.join(os.path.dirname(target), f"code-ran-on-rank{rank}")
    torch.save({"format": 1, "state": _Plant(marker)}, state_of(target))
    dist.barrier()
    return _Planted(target, marker)


def _try_resume(resume: Any, marker: str) -> dict[str, Any]:
    """Run ``resume`` (a trainer resuming from a planted checkpoint): what it raised, and
    whether the planted code ran."""
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resume()
        except Exception as e:  # the refusal, however the trainer wraps it
            error = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {"error": error, "code_ran": os.path.exists(marker)}


def trainer_scenarios(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every Hugging Face and Lightning scenario on this rank, in one process; see
    ``tests/test_integrations.py``. The environment is torchrun's, which both trainers read
    (the process group exists already: they use it)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "0",
        }
    )
    return {
        "hf": hf_scenarios(rank, world, out_dir),
        "lightning": lightning_scenarios(rank, world, out_dir),
    }


def hf_scenarios(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every Hugging Face scenario on this rank (in :func:`trainer_scenarios`)."""
    from transformers import Trainer

    from lowcomm.integrations.hf import attach
    from lowcomm.optim import DeMo
    from lowcomm.registry import outer_names

    result: dict[str, Any] = {}

    # CO2 across the ranks, with gradient accumulation and TensorBoard scalars
    trainer = _trainer(os.path.join(out_dir, "co2"))
    tb = os.path.join(out_dir, "tb") if rank == 0 else None
    callback = attach(trainer, "co2", sync_every=HF_SYNC_EVERY, tensorboard=tb)
    trainer.train()
    result["co2"] = {
        "digests": trainer.digests.digests,
        "params": _params(trainer.model),
        "log_history": trainer.state.log_history,
        "local_step": callback.algorithm.local_step,
        "sync_points": callback.algorithm.sync_points,
        "ddp_grad_sync": getattr(callback.driver.ddp, "require_backward_grad_sync", None),
    }

    result["own_loop"] = _own_loop(os.path.join(out_dir, "own"), rank)

    # checkpoints inside rounds (warned), then a resume from the one of step 4
    saving = os.path.join(out_dir, "saving")
    trainer = _trainer(saving, save_strategy="steps", save_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attach(trainer, "co2", sync_every=HF_SYNC_EVERY)
        trainer.train()
    result["saving"] = {
        "params": _params(trainer.model),
        "warnings": [str(w.message) for w in caught if "lowcomm" in str(w.message)],
    }
    dist.barrier()  # every rank's part of the checkpoints is written
    trainer = _trainer(saving, model=tiny_llama(seed=1), save_strategy="steps", save_steps=4)
    attach(trainer, "co2", sync_every=HF_SYNC_EVERY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=os.path.join(saving, "checkpoint-4"))
    result["resumed"] = {"params": _params(trainer.model), "digests": trainer.digests.digests}

    # the same checkpoint with a planted pickle as this rank's lowcomm state: refused, not run
    planted = _planted_copy(
        os.path.join(saving, "checkpoint-4"),
        os.path.join(out_dir, "planted", "checkpoint-4"),
        lambda folder: os.path.join(folder, "lowcomm", f"rank{rank}.pt"),
        rank,
    )
    trainer = _trainer(os.path.join(out_dir, "planted"), save_strategy="steps", save_steps=4)
    attach(trainer, "co2", sync_every=HF_SYNC_EVERY)
    result["planted"] = _try_resume(
        lambda: trainer.train(resume_from_checkpoint=planted.folder), planted.marker
    )

    # a GradScaler skip on rank 1 only (an overflow at step 5, after a 3-step warm start)
    class Overflow(Trainer):
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            loss: Any = super().compute_loss(*args, **kwargs)
            if rank == 1 and self.state.global_step == 4:
                return loss * float("inf")
            return loss

    trainer = _trainer(os.path.join(out_dir, "skip"), trainer_cls=Overflow)
    callback = attach(trainer, "co2", sync_every=HF_SYNC_EVERY, sync_warmup=HF_SYNC_EVERY)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    real_prepare = trainer.accelerator.prepare

    def prepare_with_scaler(*objs: Any, **kw: Any) -> Any:
        trainer.accelerator.scaler = scaler  # what fp16 on a GPU sets up
        return real_prepare(*objs, **kw)

    trainer.accelerator.prepare = prepare_with_scaler
    trainer.train()
    inner = callback.driver.algo.inner
    result["skip"] = {
        "params": _params(trainer.model),
        "local_step": callback.algorithm.local_step,
        "inner_steps": int(max(float(s["step"]) for s in inner.state.values())),
        "scale": float(scaler.get_scale()),
    }

    # every algorithm, compression and sharded outer state
    cases: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in outer_names()]
    cases += [("co2", {"compression": "int8"}), ("diloco", {"shard_outer_state": True})]
    cases += [("demo", {})]
    result["algorithms"] = {}
    for name, options in cases:
        model = tiny_llama()
        extra: dict[str, Any] = {}
        if name == "demo":
            extra["optimizers"] = (DeMo(model.parameters(), lr=1e-3), None)
        trainer = Trainer(
            model=model,
            # constant: SlowMo divides by the inner lr, which a linear decay ends at 0
            args=trainer_args(
                os.path.join(out_dir, f"algo-{name}"), max_steps=8, lr_scheduler_type="constant"
            ),
            train_dataset=Sequences(),
            **extra,
        )
        h = {} if name == "demo" else {"sync_every": 4}
        if name in ("streaming", "cocodc"):
            h.update(num_fragments=2, overlap=1)
        callback = attach(trainer, name, **h, **options)
        trainer.train()
        key = name + "".join(f"+{k}" for k in options)
        result["algorithms"][key] = {
            "digest": _digest(model),
            "outer_step": int(callback.algorithm.outer_step),
            "bytes_sent": int(callback.algorithm.metrics()["bytes_sent"]),
        }
    return result


# --- Lightning --------------------------------------------------------------------------------


def _lightning_module(seed: int = 0, overflow_at: int | None = None) -> Any:
    import lightning.pytorch as pl

    class TinyLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama(seed)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            on_rank = overflow_at is not None and self.global_rank == 1
            if on_rank and self.trainer.global_step == overflow_at:
                return loss * float("inf")  # an fp16 overflow on this rank only
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    return TinyLlama()


def _lightning_trainer(callbacks: list[Any], **overrides: Any) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    class Digests(Callback):
        def __init__(self) -> None:
            self.digests: list[str] = []
            self.seen = 0

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step > self.seen:
                self.seen = trainer.global_step
                self.digests.append(_digest(module))

    digests = Digests()
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp",
        "max_steps": HF_STEPS,
        "accumulate_grad_batches": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": HF_SYNC_EVERY,
        "callbacks": [*callbacks, digests],
    }
    settings.update(overrides)
    trainer: Any = pl.Trainer(**settings)
    trainer.digests = digests
    return trainer


LIGHTNING_SAMPLES = 64
"""An epoch of 4 optimizer steps on each of 2 ranks (8 batches of 4, accumulated in pairs):
Lightning resumes a plain DataLoader from the start of its epoch, so checkpoints are taken at
epoch ends (steps 4 and 8, inside CO2's rounds of 3)."""


def _loader() -> Any:
    return torch.utils.data.DataLoader(Sequences(LIGHTNING_SAMPLES), batch_size=4)


def _lightning_own_loop(rank: int, world: int) -> dict[str, torch.Tensor]:
    """lowcomm's own loop over the batches Lightning gives this rank (its distributed sampler:
    shuffled with seed 0, reseeded every epoch) and the module's optimizer."""
    import lowcomm

    module = _lightning_module()
    inner = module.configure_optimizers()
    algo = lowcomm.CO2(module, inner, sync_every=HF_SYNC_EVERY)
    data = Sequences(LIGHTNING_SAMPLES)
    sampler: Any = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, seed=0)

    def batches() -> Any:
        for epoch in range(HF_STEPS):
            sampler.set_epoch(epoch)
            yield from torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)

    stream = batches()
    module.train()
    for _ in range(HF_STEPS):
        for _ in range(2):
            (module.training_step(next(stream), 0) / 2).backward()
        inner.step()
        inner.zero_grad()
        algo.step()
    algo.finish()
    return _params(module)


def lightning_scenarios(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Every Lightning scenario on this rank (in :func:`trainer_scenarios`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lowcomm.integrations.lightning import LowcommCallback

    result: dict[str, Any] = {}
    callback = LowcommCallback("co2", sync_every=HF_SYNC_EVERY)
    trainer = _lightning_trainer([callback])
    module = _lightning_module()
    trainer.fit(module, _loader())
    result["co2"] = {
        "digests": trainer.digests.digests,
        "params": _params(module),
        "local_step": callback.algorithm.local_step,
        "sync_points": callback.algorithm.sync_points,
        "ddp_grad_sync": getattr(callback.driver.ddp, "require_backward_grad_sync", None),
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    result["own_loop"] = _lightning_own_loop(rank, world)

    # checkpoints every 4 steps (inside rounds: warned), then a resume from step 4's
    folder = os.path.join(out_dir, "lightning-ckpt")
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _lightning_trainer(
            [LowcommCallback("co2", sync_every=HF_SYNC_EVERY), saver], enable_checkpointing=True
        )
        module = _lightning_module()
        trainer.fit(module, _loader())
    result["saving"] = {
        "params": _params(module),
        "warnings": [str(w.message) for w in caught if "lowcomm" in str(w.message)],
        "files": sorted(os.listdir(folder)),
    }
    dist.barrier()
    trainer = _lightning_trainer([LowcommCallback("co2", sync_every=HF_SYNC_EVERY)])
    module = _lightning_module(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(), ckpt_path=os.path.join(folder, "epoch=0-step=4.ckpt"))
    result["resumed"] = {"params": _params(module), "digests": trainer.digests.digests}

    # the same checkpoint with a planted pickle as this rank's lowcomm state: refused, not run
    name = "epoch=0-step=4.ckpt"
    planted = _planted_copy(
        os.path.join(folder, name),
        os.path.join(out_dir, "lightning-planted", name),
        lambda path: os.path.join(f"{path}.lowcomm", f"rank{rank}.pt"),
        rank,
    )
    trainer = _lightning_trainer([LowcommCallback("co2", sync_every=HF_SYNC_EVERY)])
    module = _lightning_module(seed=1)
    result["planted"] = _try_resume(
        lambda: trainer.fit(module, _loader(), ckpt_path=planted.folder), planted.marker
    )

    # an AMP GradScaler skip on rank 1 only, after a 3-step warm start
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    callback = LowcommCallback("co2", sync_every=HF_SYNC_EVERY, sync_warmup=HF_SYNC_EVERY)
    trainer = _lightning_trainer(
        [callback], plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    module = _lightning_module(overflow_at=4)
    trainer.fit(module, _loader())
    inner = callback.algorithm.inner
    result["skip"] = {
        "params": _params(module),
        "local_step": callback.algorithm.local_step,
        "inner_steps": int(max(float(s["step"]) for s in inner.state.values())),
        "scale": float(scaler.get_scale()),
    }
    return result
