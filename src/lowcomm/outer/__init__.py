"""Outer-loop algorithms on one engine (:mod:`lowcomm.outer.engine`): one short module each,
with its hyperparameters as a dataclass and its math as pure functions (:mod:`.functional`).
Every ``--algo`` name, variants and baselines included, and the classes by name
(``ALGORITHMS``) are in :mod:`lowcomm.registry`, the one list."""

from lowcomm.outer.co2 import CO2
from lowcomm.outer.cocodc import CoCoDC
from lowcomm.outer.diloco import DiLoCo, SlowMo
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.local_sgd import LocalSGD
from lowcomm.outer.noloco import NoLoCo
from lowcomm.outer.sparseloco import SparseLoCo
from lowcomm.outer.streaming import StreamingDiLoCo

__all__ = ["CO2", "CoCoDC", "DiLoCo", "LocalSGD", "NoLoCo", "OuterAlgorithm"]
__all__ += ["SlowMo", "SparseLoCo", "StreamingDiLoCo"]
