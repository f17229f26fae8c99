"""The package's shape: no source file over 900 lines (one concept may take that many), and no
import circle between modules.

The import graph is read from the source with ``ast`` (nothing is imported, torch included):

* every ``import`` and ``from … import`` statement counts, at module level, inside functions,
  methods, ``try`` blocks and ordinary ``if`` blocks alike: an import run only when a function
  is called closes a circle as surely as one run at import time; only the body of an
  ``if TYPE_CHECKING:`` block is skipped (its ``else`` branch is not), since type checkers
  alone run it;
* relative imports are resolved against the importing module (a package's ``__init__`` is the
  module named after the package, and its ``from . import x`` is relative to itself);
* ``from a.b import c`` is an edge to the module ``a.b.c`` when that is a module, else to
  ``a.b``; ``import a.b.c`` is an edge to ``a.b.c`` (or its longest prefix that is a module);
* a package's ``__init__`` is a node like any other: ``from lowcomm.outer import X`` where
  ``X`` is a name defined or re-exported in ``lowcomm/outer/__init__.py`` is an edge to
  ``lowcomm.outer``, and if that ``__init__`` imports the importing module, that is a circle.

One class of edges is left out on purpose: the implicit import of a module's parent packages.
Importing ``lowcomm.outer.engine`` runs ``lowcomm/outer/__init__.py`` first, but that cannot
close a circle at run time. The import system puts the package in ``sys.modules`` with its
``__path__`` set before its ``__init__`` runs, and a submodule import needs nothing else from
the parent: when ``lowcomm/outer/__init__.py`` imports ``engine`` and ``engine`` imports
``lowcomm.outer.fragment``, the half-initialised package is enough to find and load
``fragment``, and no name is read from the unfinished ``__init__``. Counting those edges would
make every package whose ``__init__`` re-exports its submodules a circle with each of them. An
explicit ``from lowcomm.outer import X`` does read a name from the ``__init__``, so it counts.

The same graph with the imports under ``if TYPE_CHECKING:`` added is kept free of circles as
well (:func:`test_no_import_circle_for_type_checkers`). Such a circle cannot fail at run time,
but it still ties two modules that each need the other's names; the piece both need belongs in
a module both import (a ``Protocol``, a type alias, a spec dataclass), as for a run-time circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

# the import reader test_layering.py holds the transport's layering rules with
from test_layering import SRC, _absolute, _imports, _module_files

MAX_LINES = 900


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def import_graph(root: Path = SRC, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (edges to itself dropped; with
    ``type_checking``, the imports only type checkers run as well)."""
    modules = _module_files(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree, type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _absolute(module, node, path.name == "__init__.py")
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            for target in targets:
                found = _known_prefix(target, modules)
                if found is not None and found != module:
                    edges[module].add(found)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, …, a]``, or None; deterministic (sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def _graph_of(tmp_path: Path, sources: dict[str, str]) -> dict[str, set[str]]:
    for name, text in sources.items():
        file = tmp_path.joinpath(*name.split("/"))
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8")
    return import_graph(tmp_path)


def test_checker_reads_imports_as_python_does(tmp_path: Path) -> None:
    edges = _graph_of(
        tmp_path,
        {
            "lowcomm/__init__.py": "from lowcomm.outer import Engine\n",
            "lowcomm/outer/__init__.py": "from .engine import Engine\nfrom . import fragment\n",
            "lowcomm/outer/engine.py": (
                "from typing import TYPE_CHECKING\n"
                "import lowcomm.comm\n"
                "from . import fragment\n"
                "from ..guard import check\n"
                "if TYPE_CHECKING:\n    from lowcomm.outer.guards import G\n"
                "else:\n    from lowcomm import hparams\n"
                "class Engine:\n    def f(self):\n        from lowcomm.outer import X\n"
            ),
            "lowcomm/outer/fragment.py": "from .guards import G\n",
            "lowcomm/outer/guards.py": "import torch\n",
            "lowcomm/comm.py": "",
            "lowcomm/guard.py": "",
            "lowcomm/hparams.py": "",
        },
    )
    assert edges["lowcomm"] == {"lowcomm.outer"}
    assert edges["lowcomm.outer"] == {"lowcomm.outer.engine", "lowcomm.outer.fragment"}
    assert edges["lowcomm.outer.engine"] == {
        "lowcomm.comm",
        "lowcomm.outer.fragment",
        "lowcomm.guard",
        "lowcomm.hparams",
        "lowcomm.outer",
    }
    assert edges["lowcomm.outer.fragment"] == {"lowcomm.outer.guards"}
    assert find_cycle(edges) == ["lowcomm.outer", "lowcomm.outer.engine", "lowcomm.outer"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    typed = import_graph(tmp_path, type_checking=True)
    assert typed["lowcomm.outer.engine"] == edges["lowcomm.outer.engine"] | {"lowcomm.outer.guards"}


def test_no_source_file_over_900_lines() -> None:
    too_long = []
    for path in _python_files():
        with path.open(encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            too_long.append(f"{path.relative_to(SRC.parent)}: {lines} lines")
    assert not too_long, f"over {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_no_import_circle() -> None:
    edges = import_graph()
    assert "lowcomm.outer.engine" in edges and edges["lowcomm.outer.engine"]
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_import_circle_for_type_checkers() -> None:
    cycle = find_cycle(import_graph(type_checking=True))
    assert cycle is None, "import circle (imports under TYPE_CHECKING included): " + " -> ".join(
        cycle or []
    )
