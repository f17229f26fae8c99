"""The no-sync ceiling of ``lowcomm train`` (``--ceiling-steps``): the throughput the same
worker processes reach without any synchronisation, measured inside the job."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.data import get_batch, make_generator
from lowcomm.device import synchronize, to_device
from lowcomm.train.config import TrainConfig
from lowcomm.train.model import inner_optimizer

__all__ = ["Ceiling"]


class Ceiling:
    """The no-sync ceiling measured inside the job: the same worker processes time inner steps
    on a private copy of the model and inner optimizer with no synchronisation at all, half
    before training and half after, so the ceiling sees the machine as the training saw it.

    Every rank runs its segment at the same time (a barrier on each side), drawing batches from
    its own generator: the training's data order and model are untouched.
    """

    def __init__(
        self, gpt: nn.Module, cfg: TrainConfig, corpus: Any, rank: int, device: torch.device
    ) -> None:
        self.model = copy.deepcopy(gpt)
        self.optimizer = inner_optimizer(self.model, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr
        self.cfg = cfg
        self.corpus = corpus
        self.device = device
        self.gen = make_generator(cfg.seed + 1_000_003, rank)
        self.segments: list[tuple[int, float]] = []  # (steps, seconds) on this rank
        self._step()  # untimed: optimizer state and allocator warm-up

    def _step(self) -> None:
        x, y = get_batch(self.corpus.train, self.cfg.batch_size, self.cfg.block_size, self.gen)
        bf16 = self.cfg.precision == "bf16"  # the job's arithmetic, for a fair ceiling
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = self.model(to_device(x, self.device), to_device(y, self.device))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> None:
        if steps <= 0:
            return
        synchronize(self.device)  # the device's earlier work (the training's) is not timed
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            self._step()
        synchronize(self.device)
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
