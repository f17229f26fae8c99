"""Optimizers: per-step communication-efficient ones used instead of DDP's gradient all-reduce
(DeMo), an inner optimizer for the outer algorithms (Muon with AdamW) and an outer one
(delayed Nesterov)."""

from lowcomm.optim.delayed_nesterov import DelayedNesterov
from lowcomm.optim.demo import DeMo
from lowcomm.optim.muon import MuonAdamW, muon_parameters

__all__ = ["DeMo", "DelayedNesterov", "MuonAdamW", "muon_parameters"]
