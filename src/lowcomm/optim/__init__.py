"""Optimizers: per-step communication-efficient ones used instead of DDP's gradient all-reduce
(DeMo), and inner optimizers for the outer algorithms (Muon with AdamW)."""

from lowcomm.optim.demo import DeMo
from lowcomm.optim.muon import MuonAdamW, muon_parameters

__all__ = ["DeMo", "MuonAdamW", "muon_parameters"]
