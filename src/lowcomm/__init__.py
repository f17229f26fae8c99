"""lowcomm: data-parallel training over slow links.

Workers train locally and exchange model deltas rarely and in the background. The documentation
(``docs/``, built by ``make docs``) has the algorithms and the ``lowcomm train`` job.
"""

from lowcomm import compress, zo
from lowcomm.comm import CommStats, Communicator
from lowcomm.optim import DeMo
from lowcomm.outer import (
    ALGORITHMS,
    CO2,
    CoCoDC,
    DiLoCo,
    LocalSGD,
    NoLoCo,
    SlowMo,
    StreamingDiLoCo,
)

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "CO2",
    "CoCoDC",
    "CommStats",
    "Communicator",
    "DeMo",
    "DiLoCo",
    "LocalSGD",
    "NoLoCo",
    "SlowMo",
    "StreamingDiLoCo",
    "__version__",
    "compress",
    "zo",
]
