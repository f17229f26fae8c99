"""Outer-loop algorithms on one engine (:mod:`lowcomm.outer.engine`): one short module each,
with its hyperparameters as a dataclass and its math as pure functions (:mod:`.functional`)."""

from lowcomm.outer.co2 import CO2
from lowcomm.outer.cocodc import CoCoDC
from lowcomm.outer.diloco import DiLoCo, SlowMo
from lowcomm.outer.engine import OuterAlgorithm
from lowcomm.outer.local_sgd import LocalSGD
from lowcomm.outer.registry import REGISTRY
from lowcomm.outer.streaming import StreamingDiLoCo

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {
    e.cls.name: e.cls for e in REGISTRY.values() if e.cls is not None and not e.fixed
}
"""The library's algorithm classes by their names (:mod:`lowcomm.outer.registry` has every
``--algo`` value, variants and baselines included)."""

__all__ = [
    "ALGORITHMS",
    "CO2",
    "REGISTRY",
    "CoCoDC",
    "DiLoCo",
    "LocalSGD",
    "OuterAlgorithm",
    "SlowMo",
    "StreamingDiLoCo",
]
