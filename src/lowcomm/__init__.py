"""lowcomm: data-parallel training over slow links.

Workers train locally and exchange model deltas rarely and in the background. The documentation
(``docs/``, built by ``make docs``) has the algorithms and the ``lowcomm train`` job.
"""

from typing import TYPE_CHECKING

from lowcomm.lazy import face

if TYPE_CHECKING:
    from lowcomm import compress, zo
    from lowcomm.comm import CommStats, Communicator
    from lowcomm.optim import DeMo
    from lowcomm.outer import (
        CO2,
        CoCoDC,
        DiLoCo,
        LocalSGD,
        NoLoCo,
        SlowMo,
        SparseLoCo,
        StreamingDiLoCo,
    )
    from lowcomm.registry import ALGORITHMS

_FACE = {
    "compress": "lowcomm.compress",
    "zo": "lowcomm.zo",
    "CommStats": "lowcomm.comm",
    "Communicator": "lowcomm.comm",
    "DeMo": "lowcomm.optim",
    "ALGORITHMS": "lowcomm.registry",
    **dict.fromkeys(
        (
            "CO2",
            "CoCoDC",
            "DiLoCo",
            "LocalSGD",
            "NoLoCo",
            "SlowMo",
            "SparseLoCo",
            "StreamingDiLoCo",
        ),
        "lowcomm.outer",
    ),
}
"""Each name of the package's face and the module it comes from, imported when the name is
first used (``import lowcomm.runfiles`` loads no algorithm, ``lowcomm.DiLoCo`` loads them)."""


__getattr__, __dir__ = face(__name__, _FACE, globals())

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
    "SparseLoCo",
    "StreamingDiLoCo",
    "__version__",
    "compress",
    "zo",
]
