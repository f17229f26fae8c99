"""lowcomm in a ``lightning.Trainer`` run with the DDP strategy (extra ``lowcomm[lightning]``)::

    trainer = lightning.Trainer(strategy="ddp", devices=2, max_steps=1000,
                                callbacks=[LowcommCallback("diloco", sync_every=50)])
    trainer.fit(module, loader)

:class:`LowcommCallback` does what the Hugging Face integration does
(:mod:`lowcomm.integrations.hf`), through Lightning's hooks:

* switches off the gradient all-reduce of the strategy's ``DistributedDataParallel``
  (``trainer.strategy.model``) and builds the algorithm over the module and its optimizer when
  training starts;
* steps it by ``trainer.global_step`` (optimizer steps, counted alike on every rank when an AMP
  ``GradScaler`` skips one; gradient accumulation steps it once per optimizer step), with the
  warm start's gradient mean in ``on_before_optimizer_step``;
* runs ``finish()`` at the last step (``max_steps``, else the trainer's estimate), so the last
  checkpoint and the model after ``fit`` are the one every rank agrees on;
* writes every rank's own state next to each checkpoint Lightning saves (``<file>.lowcomm/``,
  removed with it) and restores it on ``fit(ckpt_path=...)``, so a resumed run continues
  exactly;
* logs lowcomm's metrics with ``pl_module.log`` (under ``lowcomm/``, every ``log_every_n_steps``)
  and, with ``tensorboard=``, writes them with the outer step as x-axis;
* warns when checkpoints (``ModelCheckpoint(every_n_train_steps=...)``) or validation
  (``val_check_interval``) fall inside rounds.

The trainer must run one process per device with the ``ddp`` strategy; FSDP, DeepSpeed and
model-parallel strategies are refused: they shard the model, while lowcomm's ranks each train a
whole replica.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lowcomm.integrations.driver import STATE_FOLDER, Driver

__all__ = ["LowcommCallback", "state_folder"]

logger = logging.getLogger(__name__)


def state_folder(checkpoint_file: str) -> str:
    """The folder beside a Lightning checkpoint file that holds every rank's lowcomm state."""
    return f"{os.fspath(checkpoint_file)}.{STATE_FOLDER}"


class LowcommCallback(Callback):
    """lowcomm's ``algorithm`` in a Lightning run (module docstring). ``tensorboard`` /
    ``jsonl``: where rank 0 writes lowcomm's scalars (with the validation loss the module logs
    as ``val_loss``); ``process_group``: the ranks to synchronise (``None``: all); the other
    keywords are the algorithm's (``sync_every=50``, ``outer_lr=0.7``, …; torchtitan's names
    accepted)."""

    def __init__(
        self,
        algorithm: str,
        *,
        tensorboard: str | None = None,
        jsonl: str | None = None,
        process_group: Any = None,
        **options: Any,
    ) -> None:
        self.driver = Driver(
            algorithm,
            options,
            process_group=process_group,
            tensorboard=tensorboard,
            jsonl=jsonl,
        )
        self._last_step: int | None = None
        self._accumulate = 1
        self._wrapped: tuple[Any, Callable[..., Any], Any, Callable[..., Any]] | None = None

    @property
    def algorithm(self) -> Any:
        """The running algorithm (or DeMo optimizer); ``None`` before training starts."""
        return self.driver.algo

    # -- set-up -----------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._wrapped is not None:
            return
        strategy = trainer.strategy
        plain_ddp = isinstance(strategy, DDPStrategy) and "DeepSpeed" not in type(strategy).__name__
        if not plain_ddp and trainer.world_size > 1:
            raise ValueError(
                f"lowcomm runs under the ddp strategy (one process per device, each a whole "
                f"replica), not {type(strategy).__name__}: Trainer(strategy='ddp')"
            )
        # every rank writes its state beside each checkpoint file, and it goes with the file
        save, remove = trainer.save_checkpoint, trainer.strategy.remove_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            if self.driver.algo is not None:
                parts = _trainer_parts(trainer)
                self.driver.save(state_folder(filepath), trainer.global_rank, pl_module, parts)
            save(filepath, *args, **kwargs)

        def remove_checkpoint(filepath: Any) -> None:
            remove(filepath)
            if trainer.is_global_zero:
                shutil.rmtree(state_folder(filepath), ignore_errors=True)

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        trainer.strategy.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]
        self._wrapped = (trainer, save, trainer.strategy, remove)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._wrapped is not None:
            owner, save, strategy, remove = self._wrapped
            owner.save_checkpoint = save
            strategy.remove_checkpoint = remove
            self._wrapped = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"lowcomm drives one optimizer; this module configures {len(trainer.optimizers)}"
            )
        self._accumulate = max(1, int(trainer.accumulate_grad_batches))
        self.driver.start(
            pl_module,
            trainer.optimizers[0],
            ddp=trainer.strategy.model,
            global_step=trainer.global_step,
            rank=trainer.global_rank,
        )
        if trainer.global_step > 0:
            if trainer.ckpt_path is None:
                raise ValueError(
                    "lowcomm: this run starts at step "
                    f"{trainer.global_step} but from no checkpoint file; resume with "
                    "trainer.fit(..., ckpt_path=PATH)"
                )
            self.driver.load(
                state_folder(str(trainer.ckpt_path)),
                trainer.global_rank,
                pl_module,
                _trainer_parts(trainer),
                global_step=trainer.global_step,
            )
        self._last_step = _last_step(trainer)
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint):
                self.driver.warn_mid_round("checkpointing", cb._every_n_train_steps)
        interval = trainer.val_check_interval
        if isinstance(interval, int) and trainer.val_check_batch is not None:
            self.driver.warn_mid_round(
                "validating", int(trainer.val_check_batch) // self._accumulate
            )

    # -- every step -------------------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.driver.before_optimizer_step()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # the loss Lightning reports is already divided by accumulate_grad_batches
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.driver.add_loss(loss)
        if trainer.global_step <= self.driver.seen:
            return  # accumulating: no optimizer step yet
        self.driver.after_step(trainer.global_step)
        if self._last_step is not None and trainer.global_step >= self._last_step:
            self.driver.finish()  # before the last checkpoint
        if trainer.global_step % max(1, getattr(trainer, "log_every_n_steps", 50)) == 0:
            for key, value in self.driver.metrics().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        val = trainer.callback_metrics.get("val_loss")
        if val is not None and not trainer.sanity_checking:
            self.driver.evaluated(float(val))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.driver.finish()
        self.driver.close()


def _trainer_parts(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's learning-rate scheduler and gradient scaler (Lightning saves rank 0's)."""
    configs = trainer.lr_scheduler_configs
    return {
        "lr_scheduler": configs[0].scheduler if configs else None,
        "scaler": getattr(trainer.precision_plugin, "scaler", None),
    }


def _last_step(trainer: pl.Trainer) -> int | None:
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    total = trainer.estimated_stepping_batches
    return int(total) if total != float("inf") else None
