"""Layering of the package: no import cycles between modules, no imports of private names.

Edges are read from the source (``ast``): ``import a.b`` and ``from a.b import c`` at module
level or inside functions both count (``from a.b import c`` is an edge to ``a.b.c`` when that is
a module, else to ``a.b``); imports under ``if TYPE_CHECKING:`` do not. A package's
``__init__`` is the module named after the package; importing a submodule is not counted as an
edge to its parent package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lowcomm"
LOWER_LAYERS = (
    "lowcomm.buckets",
    "lowcomm.comm",
    "lowcomm.counters",
    "lowcomm.link",
    "lowcomm.compress",
)
"""Modules (and packages, with their submodules) held to the rules strictly now."""


def _module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``
    (``__init__`` as the package's own name)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, *, type_checking: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree``, at any depth; those under ``if TYPE_CHECKING:``
    only with ``type_checking``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node, type_checking=type_checking)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph(*, type_checking: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """Import edges between the package's modules (with those only for type checkers if
    ``type_checking``), and the private-name imports found."""
    files = _module_files()
    edges: dict[str, set[str]] = {m: set() for m in files}
    private: list[str] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree, type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
                names: list[str] = []
            else:
                source = _absolute(module, node, is_package)
                names = [alias.name for alias in node.names]
                targets = [f"{source}.{n}" if f"{source}.{n}" in files else source for n in names]
            for target in targets:
                while target and target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]  # `import a.b.c`, c not a module
                if target in files and target != module:
                    edges[module].add(target)
            for target in targets:
                if target.split(".")[0] == PACKAGE and any(
                    p.startswith("_") and not p.startswith("__") for p in target.split(".")
                ):
                    private.append(f"{module}: imports module {target}")
            if isinstance(node, ast.ImportFrom) and source.split(".")[0] == PACKAGE:
                for n in names:
                    if n.startswith("_") and not n.startswith("__"):
                        private.append(f"{module}: imports {n} from {source}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def _in_lower_layers(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in LOWER_LAYERS)


def test_checker_finds_cycles_and_private_imports() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import x\n"
        "if TYPE_CHECKING:\n    import hidden\nelse:\n    import shown\n"
        "def f():\n    from y import _z\n"
    )
    found = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in _imports(tree)]
    assert found == ["typing", "x", "shown", "y"]
    assert len(list(_imports(tree, type_checking=True))) == 5


def test_comm_link_and_compress_have_no_cycles_or_private_imports() -> None:
    edges, private = _graph()
    assert "lowcomm.compress.feedback" in edges and "lowcomm.comm" in edges
    assert [c for c in _cycles(edges) if any(_in_lower_layers(m) for m in c)] == []
    assert [p for p in private if _in_lower_layers(p.split(":")[0])] == []
    # the transport does not know about compression, not even for type checkers
    typed, _ = _graph(type_checking=True)
    for transport in ("lowcomm.buckets", "lowcomm.comm", "lowcomm.counters", "lowcomm.link"):
        assert not any(m.startswith("lowcomm.compress") for m in typed[transport]), transport


def test_package_has_no_cycles_or_private_imports() -> None:
    edges, private = _graph()
    assert _cycles(edges) == []
    assert private == []


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reaching(edges: dict[str, set[str]], target: str, *, outside: str) -> list[str]:
    """The imports of a module of ``target`` (a package or module) by modules outside
    ``outside``."""
    return sorted(
        f"{m} -> {t}"
        for m, ts in edges.items()
        if not _within(m, outside)
        for t in ts
        if _within(t, target)
    )


TOOLS = (
    "lowcomm.__main__",
    "lowcomm.cli",
    "lowcomm.train",
    "lowcomm.bench",
    "lowcomm.plan",
    "lowcomm.zo",
    "lowcomm.integrations",
    "lowcomm.testing",
)
"""The commands, the job and the harnesses; everything else is the library they stand on."""


def _between(edges: dict[str, set[str]], sources: list[str], targets: Sequence[str]) -> list[str]:
    """The imports by ``sources`` (modules) of a module within one of ``targets``."""
    return sorted(
        f"{m} -> {t}" for m in sources for t in edges[m] if any(_within(t, x) for x in targets)
    )


FLOORS = ("lowcomm.runfiles", "lowcomm.procs", "lowcomm.lazy")
"""Modules every command and the job stand on, that import nothing of lowcomm outside
themselves: the run-folder I/O, the process runner and the lazy package face."""


def test_package_rules_hold() -> None:
    edges, _ = _graph()
    # shipping code does not import the test harness (the harness may import anything)
    assert _reaching(edges, "lowcomm.testing", outside="lowcomm.testing") == []
    # the job reads torchtitan's keys and the loggers from leaves, not from the trainer
    # integrations (which stand on the job)
    assert _reaching(edges, "lowcomm.integrations", outside="lowcomm.integrations") == [
        f"lowcomm.testing.trainers -> lowcomm.integrations.{m}" for m in ("hf", "lightning")
    ]
    # the library imports no tool, and the job none of the other tools (it tunes its link
    # through lowcomm.tune, not lowcomm plan)
    library = [m for m in edges if not any(_within(m, t) for t in TOOLS)]
    assert _between(edges, library, TOOLS) == []
    # the test harness runs the job through its own command, not the command line
    harness = [m for m in edges if _within(m, "lowcomm.testing")]
    assert _between(edges, harness, ["lowcomm.cli", "lowcomm.__main__"]) == []
    job = [m for m in edges if _within(m, "lowcomm.train")]
    assert _between(edges, job, [t for t in TOOLS if t != "lowcomm.train"]) == []
    for leaf in ("lowcomm.loggers", "lowcomm.torchtitan"):
        assert not any(_within(t, "lowcomm.train") for t in edges[leaf]), leaf
    for floor in FLOORS:
        above = [t for m in edges if _within(m, floor) for t in edges[m] if not _within(t, floor)]
        assert above == [], f"{floor} imports {above}"
    # the checker sees a rule broken
    broken = {"lowcomm.bench.x": {"lowcomm.testing.y"}, "lowcomm.testing.y": set()}
    assert _reaching(broken, "lowcomm.testing", outside="lowcomm.testing") == [
        "lowcomm.bench.x -> lowcomm.testing.y"
    ]
    assert _between({"lowcomm.train.x": {"lowcomm.plan.y"}}, ["lowcomm.train.x"], TOOLS) == [
        "lowcomm.train.x -> lowcomm.plan.y"
    ]


def test_importing_the_run_folder_io_loads_few_lowcomm_modules() -> None:
    # the package face and the job's package import their names when first used
    import subprocess
    import sys

    code = (
        "import sys, lowcomm.runfiles, lowcomm.train.metrics, lowcomm.procs.workers; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lowcomm'))\n"
        # names and submodules still come when asked for
        "import lowcomm\n"
        "print(lowcomm.DiLoCo.__name__, lowcomm.optim.DeMo.__name__, "
        "lowcomm.train.TrainConfig.__name__, lowcomm.train.config.__name__)\n"
        "try:\n    lowcomm.nothing_of_that_name\nexcept AttributeError as e:\n    print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=SRC
    ).stdout.splitlines()
    loaded = ast.literal_eval(out[0].strip())
    assert "lowcomm.outer" not in loaded and "lowcomm.train.loop" not in loaded, loaded
    assert len(loaded) <= 15, loaded
    assert out[1:] == [
        "DiLoCo DeMo TrainConfig lowcomm.train.config",
        "module 'lowcomm' has no attribute 'nothing_of_that_name'",
    ]
