"""The layering of the four packages, checked over the import graph (issue 32).

protocol/ imports no other package of the project and no asyncio, aiohttp or socket; swarm/ imports
protocol/ only; daemon/ imports swarm/ and protocol/ (and simulations/ only from
daemon/simulate_cli.py, the ``simulate`` command); simulations/ imports swarm/ and protocol/.  No
module imports itself back through others (no circles).  Every import counts: at module level,
inside functions and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = "patchswarm"
PACKAGES = ("protocol", "swarm", "daemon", "simulations")
MAY_IMPORT = {
    "protocol": {"protocol"},
    "swarm": {"protocol", "swarm"},
    "daemon": {"protocol", "swarm", "daemon"},
    "simulations": {"protocol", "swarm", "simulations"},
}
SIMULATE_COMMAND = f"{TOP}.daemon.simulate_cli"  # the one daemon module that may load the simulator
NO_IO_IN_PROTOCOL = frozenset({"asyncio", "aiohttp", "socket"})


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # as written, resolved to an absolute name
    line: int
    member: bool = False  # ``a.b`` of ``from a import b`` (b may be a module or a name in a)

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.imported}"


def project_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source of every module of the four packages."""
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = [pkg, *path.relative_to(root / pkg).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([TOP, *parts])] = path.read_text()
    return out


def imports_of(module: str, source: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import statement anywhere in ``source`` (functions and TYPE_CHECKING blocks included);
    ``from a import b`` yields both ``a`` and ``a.b`` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield Import(module, base, node.lineno)
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}", node.lineno, member=True)


def project_edges(sources: Mapping[str, str], packages: frozenset[str] = frozenset()) -> dict[str, list[Import]]:
    """Module -> its imports of other project modules (``from a import b``: ``a.b`` if that is a module)."""
    edges: dict[str, list[Import]] = {}
    for module, source in sources.items():
        found: dict[str, Import] = {}
        for imp in imports_of(module, source, is_package=module in packages):
            if imp.imported in sources and imp.imported != module:
                found.setdefault(imp.imported, imp)
            elif imp.imported == TOP:
                found.setdefault(TOP, imp)  # the top-level package re-exports the daemon: above every layer
        # ``from a import b`` with a.b a module is an import of a.b, not of the package a
        for name in list(found):
            if any(other.startswith(name + ".") and found[other].line == found[name].line for other in found):
                del found[name]
        edges[module] = list(found.values())
    return edges


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == TOP and parts[1] in PACKAGES else None


def upward_imports(edges: Mapping[str, list[Import]]) -> list[str]:
    bad = []
    for module, imps in edges.items():
        layer = layer_of(module)
        if layer is None:
            continue
        for imp in imps:
            target = layer_of(imp.imported)
            if target in MAY_IMPORT[layer]:
                continue
            if layer == "daemon" and target == "simulations" and module == SIMULATE_COMMAND:
                continue
            bad.append(f"{imp}: {layer}/ may import only {', '.join(sorted(MAY_IMPORT[layer]))}")
    return bad


def io_imports(sources: Mapping[str, str]) -> list[str]:
    bad = []
    for module, source in sources.items():
        if layer_of(module) != "protocol":
            continue
        for imp in imports_of(module, source):
            if not imp.member and imp.imported.split(".")[0] in NO_IO_IN_PROTOCOL:
                bad.append(f"{imp}: protocol/ is sans-IO")
    return sorted(set(bad))


def circles(edges: Mapping[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {m: [i.imported for i in imps if i.imported in edges] for m, imps in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def describe_circle(edges: Mapping[str, list[Import]], comp: list[str]) -> str:
    members = set(comp)
    links = [str(i) for m in comp for i in edges[m] if i.imported in members]
    return "circle: " + "; ".join(links)


def check(sources: Mapping[str, str], packages: frozenset[str] = frozenset()) -> list[str]:
    edges = project_edges(sources, packages)
    return upward_imports(edges) + io_imports(sources) + [describe_circle(edges, c) for c in circles(edges)]


def _packages() -> frozenset[str]:
    return frozenset(f"{TOP}.{p}" for p in PACKAGES)


# ---------------------------------------------------------------- the project


def test_the_project_keeps_its_layers() -> None:
    sources = project_sources()
    assert {layer_of(m) for m in sources} == set(PACKAGES)  # the walk found the packages
    assert len(sources) > 50
    problems = check(sources, _packages())
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the checker catches what it must


def test_the_checker_finds_an_upward_import_anywhere() -> None:
    sources = {
        "patchswarm.protocol.a": "def f():\n    from patchswarm.swarm.b import x\n",
        "patchswarm.swarm.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import patchswarm.daemon.c\n",
        "patchswarm.daemon.c": "from patchswarm.simulations import d\n",
        "patchswarm.daemon.simulate_cli": "from patchswarm.simulations.d import run\n",
        "patchswarm.simulations.d": "run = 1\n",
    }
    problems = check(sources)
    assert problems == [
        "patchswarm.protocol.a (line 2) imports patchswarm.swarm.b: protocol/ may import only protocol",
        "patchswarm.swarm.b (line 3) imports patchswarm.daemon.c: swarm/ may import only protocol, swarm",
        "patchswarm.daemon.c (line 1) imports patchswarm.simulations.d: "
        "daemon/ may import only daemon, protocol, swarm",
    ]


def test_the_checker_finds_io_in_protocol() -> None:
    sources = {
        "patchswarm.protocol.a": "import math\ndef f():\n    import asyncio.tasks\n    from socket import socket\n"
    }
    assert check(sources) == [
        "patchswarm.protocol.a (line 3) imports asyncio.tasks: protocol/ is sans-IO",
        "patchswarm.protocol.a (line 4) imports socket: protocol/ is sans-IO",
    ]


def test_the_checker_finds_a_circle_hidden_in_a_function() -> None:
    sources = {
        "patchswarm.daemon.a": "from patchswarm.daemon.b import x\n",
        "patchswarm.daemon.b": "from patchswarm.daemon import c\n",
        "patchswarm.daemon.c": "def f():\n    from . import a\n",
        "patchswarm.daemon.d": "import patchswarm.daemon.a\n",
    }
    assert check(sources) == [
        "circle: patchswarm.daemon.a (line 1) imports patchswarm.daemon.b; "
        "patchswarm.daemon.b (line 1) imports patchswarm.daemon.c; "
        "patchswarm.daemon.c (line 2) imports patchswarm.daemon.a"
    ]


def test_the_checker_refuses_the_top_level_package_inside_the_layers() -> None:
    sources = {"patchswarm.swarm.a": "from patchswarm import Publisher\n"}
    assert check(sources) == ["patchswarm.swarm.a (line 1) imports patchswarm: swarm/ may import only protocol, swarm"]


def imports_of_test_modules(root: Path) -> list[str]:
    """Imports of a test module by a test module under ``root``/tests (its helpers belong in tests/support)."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [
                f"{path.relative_to(root)} (line {node.lineno}) imports {name}"
                for name in names
                if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")
            ]
    return found


def test_no_imports_of_test_modules_another() -> None:
    found = imports_of_test_modules(ROOT)
    assert found == [], "\n".join(found)


def test_the_checker_finds_a_test_module_imported_by_another(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("from tests.unit.test_b import helper\n")
    (tmp_path / "tests" / "unit" / "test_b.py").write_text("from tests.support.boards import Keys\n")
    assert imports_of_test_modules(tmp_path) == ["tests/unit/test_a.py (line 1) imports tests.unit.test_b"]
