"""lowcomm in a Hugging Face ``transformers.Trainer`` run, in one line (extra ``lowcomm[hf]``)::

    trainer = Trainer(model=model, args=args, train_dataset=train)
    lowcomm.integrations.hf.attach(trainer, "co2", sync_every=12)
    trainer.train()                    # under torchrun: CO2 across the processes, not DDP

:func:`attach` adds a :class:`LowcommCallback` that holds the trainer and, for every algorithm
of the registry (with ``compression`` and ``shard_outer_state`` where the algorithm takes them):

* switches off DDP's per-step gradient all-reduce (``require_backward_grad_sync = False`` on
  the Trainer's ``DistributedDataParallel``) and the Trainer's per-step all-gather of token
  counts (``average_tokens_across_devices``): each rank's loss is its own batch's mean;
* builds the algorithm over the Trainer's model and its (unwrapped) optimizer when training
  begins, and steps it after every optimizer step, counted by ``state.global_step`` (an fp16
  ``GradScaler`` skipping ``optimizer.step()`` on one rank keeps the ranks in step; gradient
  accumulation steps it once per optimizer step);
* runs ``finish()`` at the last step, before the Trainer's last save, so the saved model is the
  one every rank agrees on (and again, idempotently, when training ends early);
* saves every rank's own state into each Trainer checkpoint (``checkpoint-N/lowcomm/``:
  :mod:`lowcomm.integrations.driver`) and restores it on ``train(resume_from_checkpoint=...)``,
  so a resumed run continues exactly;
* merges lowcomm's metrics (``lowcomm/outer_step``, ``lowcomm/pseudo_grad_norm``, bytes sent and
  received, time blocked, hidden fraction, skipped updates) into the Trainer's logs, and with
  ``tensorboard=`` writes them with the outer step as x-axis
  (:mod:`lowcomm.loggers`);
* warns when ``save_steps`` or ``eval_steps`` are not multiples of ``sync_every``.

Not supported, refused with an error: DeepSpeed and FSDP (they shard parameters, gradients and
optimizer state across the ranks; lowcomm's ranks each hold a whole replica and average it every
H steps), ``DataParallel`` (several GPUs in one process), and ``demo`` under a ``GradScaler``
(DeMo communicates inside ``optimizer.step()``, which the scaler may skip on one rank).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from lowcomm.integrations.driver import STATE_FOLDER, Driver

__all__ = ["LowcommCallback", "attach"]

logger = logging.getLogger(__name__)


class LowcommCallback(TrainerCallback):
    """The callback :func:`attach` adds (module docstring). ``trainer``: the Trainer it runs in;
    ``algorithm``: a lowcomm algorithm name; ``tensorboard`` / ``jsonl``: where rank 0 writes
    lowcomm's scalars; ``process_group``: the ranks to synchronise (``None``: all); the other
    keywords are the algorithm's (``sync_every=12``, ``outer_lr=0.7``, …)."""

    def __init__(
        self,
        trainer: Trainer,
        algorithm: str,
        *,
        tensorboard: str | None = None,
        jsonl: str | None = None,
        process_group: Any = None,
        **options: Any,
    ) -> None:
        _check_supported(trainer, algorithm)
        self.trainer = trainer
        self.driver = Driver(
            algorithm,
            options,
            process_group=process_group,
            tensorboard=tensorboard,
            jsonl=jsonl,
        )
        self.resume_from: str | None = None
        """The checkpoint the next ``train()`` resumes from (set by :func:`attach`)."""

    @property
    def algorithm(self) -> Any:
        """The running algorithm (or DeMo optimizer); ``None`` before training begins."""
        return self.driver.algo

    def _model(self) -> Any:
        model = self.trainer.model
        assert model is not None, "a Trainer trains a model"
        return model

    def _parts(self) -> dict[str, Any]:
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        return {"lr_scheduler": self.trainer.lr_scheduler, "scaler": scaler}

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self.trainer
        if self.driver.name == "demo" and getattr(trainer.accelerator, "scaler", None) is not None:
            raise ValueError(
                "lowcomm demo cannot run under a GradScaler (fp16): DeMo communicates inside "
                "optimizer.step(), which the scaler skips on a rank whose gradients overflowed, "
                "and the other ranks would wait for it; use bf16 or fp32"
            )
        rank = args.process_index
        self.driver.start(
            self._model(),
            trainer.optimizer,
            ddp=trainer.model_wrapped,
            global_step=state.global_step,
            rank=rank,
        )
        if state.global_step > 0:
            source = self.resume_from or os.path.join(
                args.output_dir or ".", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            )
            folder = os.path.join(source, STATE_FOLDER)
            self.driver.load(
                folder, rank, self._model(), self._parts(), global_step=state.global_step
            )
        if args.save_strategy == "steps":
            self.driver.warn_mid_round("saving", state.save_steps)
        if args.eval_strategy == "steps":
            self.driver.warn_mid_round("evaluating", state.eval_steps)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.driver.before_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.driver.after_step(state.global_step)
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            self.driver.finish()  # before the Trainer's last save and evaluation

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        run_dir = self.trainer._get_output_dir(trial=None)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        state_folder = os.path.join(folder, STATE_FOLDER)
        self.driver.save(state_folder, args.process_index, self._model(), self._parts())

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or self.driver.algo is None:
            return
        extra = self.driver.metrics()
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if metrics and "eval_loss" in metrics:
            self.driver.evaluated(float(metrics["eval_loss"]))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.driver.finish()
        self.driver.close()


def attach(trainer: Trainer, algorithm: str, **options: Any) -> LowcommCallback:
    """Make ``trainer``'s runs lowcomm runs of ``algorithm`` (module docstring) and return the
    callback. ``options``: the algorithm's keywords (``sync_every=12``, ``compression="int8"``,
    ``shard_outer_state=True``, torchtitan's names accepted), and ``tensorboard=FOLDER``,
    ``jsonl=PATH``, ``process_group=GROUP`` (see :class:`LowcommCallback`)."""
    if any(isinstance(cb, LowcommCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("lowcomm is already attached to this Trainer; attach once")
    callback = LowcommCallback(trainer, algorithm, **options)
    # first, so that the metrics it merges into the logs reach the reporting callbacks
    trainer.callback_handler.callbacks.insert(0, callback)
    if trainer.args.average_tokens_across_devices:
        # an all-gather of token counts every step, and a loss scaled by the other ranks'
        trainer.args.average_tokens_across_devices = False
        logger.info("lowcomm: average_tokens_across_devices turned off (each rank's own loss)")

    if trainer.args.include_num_input_tokens_seen not in ("no", False):
        logger.warning(
            "lowcomm: include_num_input_tokens_seen counts tokens with an all-gather every "
            "micro-batch, a round trip on the slow link each time; turn it off to avoid it"
        )
    train, training_step = trainer.train, trainer.training_step

    def train_with_lowcomm(resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(trainer.args.output_dir)
        callback.resume_from = path if isinstance(path, str) else None
        return train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def training_step_with_loss(*args: Any, **kwargs: Any) -> Any:
        loss = training_step(*args, **kwargs)
        callback.driver.add_loss(loss)
        return loss

    trainer.train = train_with_lowcomm  # type: ignore[method-assign,assignment]
    trainer.training_step = training_step_with_loss  # type: ignore[method-assign]
    return callback


def _check_supported(trainer: Trainer, algorithm: str) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(
            "lowcomm does not run under DeepSpeed: ZeRO shards parameters, gradients and "
            "optimizer state across the ranks, while lowcomm's ranks each train a whole replica "
            "and average it every sync_every steps; drop the DeepSpeed config"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError(
            "lowcomm does not run under FSDP: it shards the model across the ranks, while "
            "lowcomm's ranks each train a whole replica; drop fsdp from TrainingArguments"
        )
    if trainer.args.n_gpu > 1:
        raise ValueError(
            "lowcomm needs one process per device (torchrun --nproc-per-node N), not "
            f"DataParallel over {trainer.args.n_gpu} GPUs in one process"
        )
