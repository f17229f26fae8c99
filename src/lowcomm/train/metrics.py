"""What a ``lowcomm train`` run leaves in its folder, and how it is written.

* ``config.json``: the resolved configuration;
* ``metrics.jsonl``: one JSON object per line:

  - ``{"kind": "step", "step", "steps", "loss", "lr", "tokens", "elapsed_s"}`` every
    ``log_every`` inner steps, before every evaluation and at the last step: ``loss`` is rank 0's
    training loss averaged over the ``steps`` inner steps that end at ``step`` (every step's loss
    is in exactly one record), ``lr`` the inner learning rate of step ``step``;
  - ``{"kind": "eval", "step", "val_loss", "tokens", "elapsed_s", "train_s", "rounds",
    <rank 0's CommStats>}`` per evaluation; ``train_s`` is the training time before it (the
    wall time since the start less every evaluation's time);
  - ``{"kind": "resume", "step", "checkpoint", "restart"}`` where a resumed or restarted run
    continued from the checkpoint of ``step``: the records after ``step`` written by the run
    that was stopped are removed first, so every step still appears in exactly one ``step``
    record and times continue from the checkpoint's;

* ``checkpoint.pt``: **rank 0's** final state (after ``algo.finish()``): its model, inner
  optimizer (with ``node_sharding="zero"`` the whole AdamW state, gathered from node 0's shards,
  in AdamW's own format) and algorithm state (``"rank": 0``), with the config, world size and
  step. It is the trained model to load; the resume points are the per-rank checkpoints under
  ``checkpoints/`` (``--checkpoint-every``, see :mod:`lowcomm.train.checkpoint`). Plain dicts,
  tensors, numbers and strings, so ``torch.load(weights_only=True)`` reads it;
* ``checkpoints/step-NNNNNN/``: resumable checkpoints of every rank (with ``--checkpoint-every``);
* ``loss.png``: training and validation loss against step;
* ``summary.json``: totals, throughput, validation loss start and end, communication counters per
  worker and their mean, ``replicas_identical`` (every rank ended with the same parameters, by
  a checksum of each rank's), and ``layout``: ``null``, or with ``nodes`` / ``node_sharding``
  the node layout (``nodes``, ``procs_per_node``, ``node_sharding``, ``across_nodes``,
  ``link_per_process``, ``cross_node_wire_bytes_per_node`` and ``intra_node``, the mean
  counters of DDP inside the nodes); with node groups the ``comm_*`` counters are those of the
  algorithm's cross-node group; ``peak_gpu_memory_bytes``: each worker's
  ``torch.cuda.max_memory_allocated`` on a GPU, ``null`` on the CPU;
* ``error-rank<r>.txt``: the traceback of a worker that failed, if one did.

A folder holding :data:`RUN_FILES` or a ``checkpoints`` folder is a previous run: ``lowcomm train``
refuses it unless told to overwrite it (and then removes :func:`previous_run_files` and the
checkpoints first) or to resume it.
"""

from __future__ import annotations

import glob
import os

__all__ = ["CHECKPOINT_NOTE", "RUN_FILES", "previous_run_files"]

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoint.pt")
"""Files whose presence marks a folder as holding a run."""

CHECKPOINT_NOTE = (
    "rank 0's final state only (model, inner optimizer, algorithm), after algo.finish(); "
    "resume points with every rank's state are under checkpoints/ (--checkpoint-every)"
)
"""The ``"note"`` stored in ``checkpoint.pt``."""


def previous_run_files(folder: str) -> list[str]:
    """Paths of the files a ``lowcomm train`` run writes that exist in ``folder``: the
    :data:`RUN_FILES`, ``loss.png`` and ``error-rank*.txt``."""
    names = [*RUN_FILES, "loss.png"]
    paths = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
    return paths + sorted(glob.glob(os.path.join(glob.escape(folder), "error-rank*.txt")))
