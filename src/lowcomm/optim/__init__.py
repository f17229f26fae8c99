"""Per-step communication-efficient optimizers, used instead of DDP's gradient all-reduce."""

from lowcomm.optim.demo import DeMo

__all__ = ["DeMo"]
