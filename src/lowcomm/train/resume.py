"""Where a ``lowcomm train`` job continues from, and the per-rank state a checkpoint restores
beyond what the model, optimizer and algorithm ``state_dict()`` hold: the RNG states and the
communication counters. The checkpoint files themselves are :mod:`lowcomm.train.checkpoint`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist

import lowcomm.train.checkpoint as ckpt
from lowcomm.train.config import ConfigError, TrainConfig
from lowcomm.train.failures import attempt

__all__ = ["resume_source", "restore_stats", "rng_state", "set_rng_state"]

logger = logging.getLogger(__name__)


def resume_source(cfg: TrainConfig, rank: int, world: int) -> str | None:
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
                folder, _ = ckpt.newest_intact(cfg.out or ".")
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


def rng_state(gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states a checkpoint keeps: torch's global CPU generator (dropout draws from it),
    ``gen`` (this rank's batches: the data position) and, on GPU, ``device``'s."""
    state = {"torch": torch.get_rng_state(), "data": gen.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore the global generators of :func:`rng_state` (the caller restores ``gen``)."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def restore_stats(stats: Any, saved: dict[str, Any]) -> None:
    """Continue the communication counters from a checkpoint's."""
    for field in dataclasses.fields(stats):
        if field.name in saved:
            setattr(stats, field.name, type(getattr(stats, field.name))(saved[field.name]))
