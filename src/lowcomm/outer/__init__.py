"""Outer-loop algorithms: one module each, a pure update function plus a stateful class."""

from lowcomm.outer.base import OuterAlgorithm
from lowcomm.outer.co2 import CO2
from lowcomm.outer.cocodc import CoCoDC
from lowcomm.outer.diloco import DiLoCo, SlowMo
from lowcomm.outer.local_sgd import LocalSGD
from lowcomm.outer.streaming import StreamingDiLoCo

ALGORITHMS: dict[str, type[OuterAlgorithm]] = {
    "co2": CO2,
    "cocodc": CoCoDC,
    "diloco": DiLoCo,
    "localsgd": LocalSGD,
    "slowmo": SlowMo,
    "streaming": StreamingDiLoCo,
}
"""The algorithms by the names the CLI uses for them."""

__all__ = [
    "ALGORITHMS",
    "CO2",
    "CoCoDC",
    "DiLoCo",
    "LocalSGD",
    "OuterAlgorithm",
    "SlowMo",
    "StreamingDiLoCo",
]
