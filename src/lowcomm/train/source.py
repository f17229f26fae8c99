"""The data source of a ``lowcomm train`` job: the corpus, each step's training batch (and its
forward and backward pass), the validation batches, and what a checkpoint keeps of the stream.

Windows (the default): every step draws ``batch_size`` windows of ``block_size`` tokens from
the generator the topology names for it (:meth:`~lowcomm.train.topology.Topology.batches`:
this rank's own stream, or in an elastic job one that is a function of the step). Documents
(``--documents``): whole documents balanced across the ranks by
:class:`~lowcomm.train.documents.DocumentJob`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowcomm.balance import DocumentCorpus, load_documents
from lowcomm.data import eval_batches, get_batch, load_corpus
from lowcomm.device import to_device
from lowcomm.guard import check_same_across_ranks, checksum
from lowcomm.train.checkpoint import RESUME_FREE_KEYS
from lowcomm.train.config import TrainConfig
from lowcomm.train.documents import DocumentJob, val_micro_batches
from lowcomm.train.topology import Topology

__all__ = ["DataSource", "check_same_job"]


class DataSource:
    """One rank's data: :meth:`load` the corpus (before the model, which takes its vocabulary
    size), :meth:`prepare` the streams once the model exists, then :meth:`loss` every step."""

    corpus: Any
    docs: DocumentJob | None
    """Documents mode: the stream, its step and its records."""
    gen: torch.Generator
    """This rank's own batch stream (windows)."""
    val: list[Any]
    """Validation batches: ``(x, y)`` windows, or ``(x, y, packed)`` documents."""

    def __init__(self, cfg: TrainConfig, topology: Topology, device: torch.device) -> None:
        self.cfg, self.topology, self.device = cfg, topology, device
        self.docs = None

    @classmethod
    def load(cls, cfg: TrainConfig, topology: Topology, device: torch.device) -> DataSource:
        """Read the corpus and check that every rank runs the same job on it."""
        source = cls(cfg, topology, device)
        source.corpus = load_documents(cfg.data) if cfg.documents else load_corpus(cfg.data)
        check_same_job(cfg, source.corpus)
        return source

    @property
    def vocab_size(self) -> int:
        return int(self.corpus.vocab_size)

    def prepare_documents(self, gpt: nn.Module, state: dict[str, Any] | None) -> None:
        """Documents mode: fit the cost model (every rank together, before any optimizer step)
        and open the stream, where ``state`` left it when resuming."""
        if self.cfg.documents:
            assert isinstance(self.corpus, DocumentCorpus)
            self.docs = DocumentJob(self.cfg, self.corpus, gpt, device=self.device, state=state)

    def prepare(self, rng: dict[str, Any] | None) -> None:
        """This rank's batch stream (from a checkpoint's ``rng``) and the validation batches."""
        cfg, device = self.cfg, self.device
        self.gen = self.topology.generator()
        if rng is not None:
            self.gen.set_state(rng["data"])
        if isinstance(self.corpus, DocumentCorpus):
            batches = val_micro_batches(self.corpus, cfg.block_size, cfg.eval_batches, device)
            self.val = list(batches)
        else:
            self.val = [
                (x.to(device), y.to(device))
                for x, y in eval_batches(
                    self.corpus.val, cfg.batch_size, cfg.block_size, cfg.eval_batches
                )
            ]

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        """Train ``model`` on the batch of ``step``: forward and backward (gradients
        accumulated); returns the loss (on the device)."""
        if self.docs is not None:
            return self.docs.step(model, ddp=isinstance(model, nn.parallel.DistributedDataParallel))
        gen = self.topology.batches(step, self.gen)
        x, y = get_batch(self.corpus.train, self.cfg.batch_size, self.cfg.block_size, gen)
        # from pinned memory, not stalling the stream (the batch is drawn on the CPU)
        _, loss = model(to_device(x, self.device), to_device(y, self.device))
        loss.backward()
        return loss

    def step_done(self, step: int) -> None:
        """After the step's optimizer and outer step (documents: a plan unit may end)."""
        if self.docs is not None:
            self.docs.unit_done(step % self.docs.unit_steps == 0)

    def documents_state(self) -> dict[str, Any] | None:
        return self.docs.state_dict() if self.docs is not None else None

    def report(self) -> dict[str, Any] | None:
        """``balance.json`` (documents mode; every rank takes part), else ``None``."""
        return self.docs.report() if self.docs is not None else None

    def describe(self) -> str:
        """``"N train / M val tokens"``; with documents, their counts as well."""
        corpus = self.corpus
        if isinstance(corpus, DocumentCorpus):
            train, val = corpus.train, corpus.val
            return (
                f"{len(train):,} train / {len(val):,} val documents, "
                f"{sum(len(d) for d in train):,} / {sum(len(d) for d in val):,} tokens"
            )
        return f"{len(corpus.train):,} train / {len(corpus.val):,} val tokens"


def check_same_job(cfg: TrainConfig, corpus: Any) -> None:
    """Fail on every rank unless all run the same training settings on the same corpus (under
    torchrun each node parses its own flags). Settings that only change what is measured,
    reported or kept may differ, as on resume."""
    settings = [
        (f"setting {k}", repr(v))
        for k, v in cfg.to_dict().items()
        if k not in RESUME_FREE_KEYS and k != "data"
    ]
    train, val = corpus.train, corpus.val
    if isinstance(train, list):  # documents
        train, val = torch.cat(train), torch.cat(val)
    tokens = f"{len(train)} train + {len(val)} val tokens"
    text = checksum(torch.cat([train, val]).to(torch.uint8))
    check_same_across_ranks(
        [*settings, ("corpus size", tokens), ("corpus (checksum)", text)],
        what="lowcomm train settings",
        hint="start every rank with the same flags, config file and --data contents",
    )
