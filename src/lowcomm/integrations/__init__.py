"""lowcomm inside the trainers users already run, and their loggers (optional extras):

* :mod:`lowcomm.integrations.hf`: a Hugging Face ``transformers.Trainer`` run becomes a lowcomm
  run with one line, ``attach(trainer, "co2", sync_every=12)`` (extra ``lowcomm[hf]``);
* :mod:`lowcomm.integrations.lightning`: the same as a ``lightning.pytorch.Callback`` for
  ``lightning.Trainer`` with the DDP strategy (extra ``lowcomm[lightning]``);
* their loggers are :mod:`lowcomm.loggers` (lowcomm's scalars under ``lowcomm/`` with the outer
  step as their x-axis, to TensorBoard, extra ``lowcomm[tensorboard]``, and JSONL), and the
  torchtitan keys they and the job understand :mod:`lowcomm.torchtitan`: leaves that the
  ``lowcomm train`` job reads too, without importing the trainer integrations.

The trainer integrations are imported by name, so ``import lowcomm`` never needs the extras.
"""
