"""The model and inner optimizer of a ``lowcomm train`` job, as every rank builds them (and the
benchmarks that measure the same job in pieces)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.models.gpt import GPT, GPTConfig
from lowcomm.train.config import TrainConfig

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["build_gpt", "inner_optimizer", "zero_optimizer"]


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


def inner_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The job's optimizer over ``model`` (weight decay on matrices and embeddings only): the
    inner AdamW, or :class:`~lowcomm.optim.MuonAdamW` (``optimizer`` muon), or with ``algo``
    demo :class:`~lowcomm.optim.DeMo` over every process (on ``cfg.link``'s emulated link when
    set), which replaces DDP's gradient all-reduce."""
    if cfg.algo == "demo":
        from lowcomm.link import EmulatedLink
        from lowcomm.optim import DeMo

        comm = EmulatedLink.parse(cfg.link).communicator() if cfg.link is not None else None
        return DeMo(
            _param_groups(model, cfg), lr=cfg.lr, process_group=comm, **cfg.algorithm_kwargs()
        )
    if cfg.optimizer == "muon":
        from lowcomm.optim import MuonAdamW

        return MuonAdamW.for_model(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(_param_groups(model, cfg), lr=cfg.lr, betas=(0.9, 0.95))


def zero_optimizer(
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
