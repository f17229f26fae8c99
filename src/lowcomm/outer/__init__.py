"""Outer-loop algorithms on one engine (:mod:`lowcomm.outer.engine`): one short module each,
with its hyperparameters as a dataclass and its math as pure functions (:mod:`.functional`).
Every ``--algo`` name, variants and baselines included, is in :mod:`lowcomm.registry`."""

from lowcomm.outer.co2 import CO2
from lowcomm.outer.cocodc import CoCoDC
from lowcomm.outer.diloco import DiLoCo, SlowMo
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.local_sgd import LocalSGD
from lowcomm.outer.noloco import NoLoCo
from lowcomm.outer.streaming import StreamingDiLoCo

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {
    cls.name: cls for cls in (CO2, CoCoDC, DiLoCo, LocalSGD, NoLoCo, SlowMo, StreamingDiLoCo)
}
"""The library's algorithm classes by their names."""

__all__ = ["ALGORITHMS", "CO2", "CoCoDC", "DiLoCo", "LocalSGD", "NoLoCo", "OuterAlgorithm"]
__all__ += ["SlowMo", "StreamingDiLoCo"]
