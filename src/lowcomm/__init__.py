"""lowcomm: data-parallel training over slow links.

Workers train locally and exchange model deltas rarely and in the background. The documentation
(``docs/``, built by ``make docs``) has the algorithms and the ``lowcomm train`` job.
"""

import importlib
from typing import TYPE_CHECKING, Any

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
            "StreamingDiLoCo",
        ),
        "lowcomm.outer",
    ),
}
"""Each name of the package's face and the module it comes from, imported when the name is
first used (``import lowcomm.runfiles`` loads no algorithm, ``lowcomm.DiLoCo`` loads them)."""


def __getattr__(name: str) -> Any:
    where = _FACE.get(name)
    if where is None:
        raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FACE})


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
