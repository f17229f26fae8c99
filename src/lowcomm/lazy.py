"""A package face whose names are imported when first used (PEP 562): ``lowcomm`` and
``lowcomm.train`` use it, so importing one module of the package (the run-folder I/O) loads
nothing else. It imports nothing of lowcomm.

Example (a package's ``__init__.py``)::

    __getattr__, __dir__ = face(__name__, {"TrainConfig": "lowcomm.train.config"}, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["face"]


def face(
    package: str, names: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``names`` comes from the
    module it maps to (the module itself where that module's last part is the name), kept in
    ``namespace`` (the package's globals) once imported; any other name is a submodule
    (``import lowcomm; lowcomm.optim.DeMo``), else ``AttributeError``."""

    def getattr_(name: str) -> Any:
        where = names.get(name)
        if where is not None:
            module = importlib.import_module(where)
            value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
            namespace[name] = value
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def dir_() -> list[str]:
        return sorted({*namespace, *names})

    return getattr_, dir_
