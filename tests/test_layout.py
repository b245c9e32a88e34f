"""The house's layout, read off the source with `ast` (nothing is imported): no import cycle between modules at any
depth, imports that point one way between the packages, no package folder of more than 20 modules, and no import
of an hfsdp module or name that does not exist.

Every import statement counts: at module level, inside functions and under `if TYPE_CHECKING:` (a lazy import that
closes a cycle is a cycle: it hides a dependency the layout should show). `import a.b` depends on `a.b`;
`from a import b` on the submodule `a.b` where there is one, else on `a` itself; relative imports are resolved
against the importing module's package. Importing `a.b` also runs `a/__init__.py`, but that is not counted as a
dependency on `a` (every module would then depend on its package's `__init__`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(REPO.glob("packages/*/src"))
MAX_MODULES = 20
#: Imports point one way (README's Layout): a package may import those of a lower rank, and its own, never higher.
RANK = {"hfsdp.core": 0, "hfsdp.models": 1, "hfsdp.recipes": 1, "hfsdp.planning": 1, "hfsdp.ckpt": 2, "hfsdp.cli": 3}
#: Inside hfsdp.core and hfsdp.cli a subpackage may import only those before it (docs/design.md, "Subpackages").
ORDER = {
    "hfsdp.core": ("rules", "offload", "fp8", "buffers", "outer", "engine", "kernels"),
    "hfsdp.cli": ("settings", "checks", "rank", "launcher", "commands"),
}
#: The one import against ORDER: preflight asks whether TensorBoard is installed before a rank would write with it.
ORDER_EXCEPTIONS = {("hfsdp.cli.checks.preflight", "hfsdp.cli.rank.tensorboard_log")}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    where: str  # "module level" or "in f()"

    def __str__(self) -> str:
        return f"{self.source} imports {self.target} ({_path(self.source)}:{self.line}, {self.where})"


def _modules() -> dict[str, Path]:
    out = {}
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _path(module: str) -> str:
    return str(MODULES[module].relative_to(REPO))


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _imports(module: str) -> list[tuple[str, str | None, int, str]]:
    """(module imported, name taken from it or None, line, where) for every import statement of `module`."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"in {child.name}()")
            elif isinstance(child, ast.Import):
                out.extend((alias.name, None, child.lineno, where) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                out.extend((base, alias.name, child.lineno, where) for alias in child.names)
            else:
                visit(child, where)

    visit(tree, "module level")
    return out


@cache
def _bound_names(module: str) -> set[str] | None:
    """The names `module` binds at its top level (None: it has a module `__getattr__`, so any name may exist)."""
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(getattr(node, field, []))

    visit(ast.parse(MODULES[module].read_text()).body)
    return None if "__getattr__" in names else names


@cache
def _graph() -> tuple[dict[str, list[Edge]], list[str]]:
    """Every module's dependencies on other hfsdp modules, and the imports that name nothing that exists."""
    edges: dict[str, list[Edge]] = {m: [] for m in MODULES}
    missing = []
    for module in MODULES:
        for base, name, line, where in _imports(module):
            if base.split(".")[0] != "hfsdp":
                continue
            here = f"{_path(module)}:{line}"
            if name is not None and f"{base}.{name}" in MODULES:
                target = f"{base}.{name}"
            elif base in MODULES:
                target = base
                bound = _bound_names(base) if name is not None else None
                if bound is not None and name not in bound:
                    missing.append(f"{here}: `from {base} import {name}`: {base} has no submodule or name {name!r}")
            else:
                missing.append(f"{here}: {base} is not a module of hfsdp")
                continue
            if target != module:
                edges[module].append(Edge(module, target, line, where))
    return edges, missing


def _cycles(edges: dict[str, list[Edge]]) -> list[list[Edge]]:
    """One cycle through each strongly connected component of more than one module (Tarjan, then a shortest path
    back to the component's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in edges[v]:
            w = edge.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        paths: dict[str, list[Edge]] = {start: []}
        frontier = [start]
        while frontier and not any(e.target == start for v in frontier for e in edges[v]):
            nxt = []
            for v in frontier:
                for e in edges[v]:
                    if e.target in component and e.target not in paths:
                        paths[e.target] = [*paths[v], e]
                        nxt.append(e.target)
            frontier = nxt
        last = next(e for v in frontier for e in edges[v] if e.target == start)
        cycles.append([*paths[last.source], last])
    return cycles


def test_no_import_cycle_between_modules_at_any_depth():
    """No module depends on itself through other modules, counting imports inside functions and TYPE_CHECKING."""
    cycles = _cycles(_graph()[0])
    shown = [
        " -> ".join([c[0].source, *(e.target for e in c)]) + "\n" + "\n".join(f"    {e}" for e in c) for c in cycles
    ]
    assert not cycles, f"{len(cycles)} import cycle(s); move what both sides need down a layer:\n" + "\n".join(shown)


def test_imports_point_one_way_between_the_packages():
    """cli -> ckpt -> models, recipes, planning -> core: the engine imports no model, recipe, planner, checkpoint or
    command code; models, recipes and planning no checkpoint or command code; ckpt nothing of the cli."""

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    upward = [
        str(e)
        for out in _graph()[0].values()
        for e in out
        if RANK.get(package(e.target), -1) > RANK.get(package(e.source), 99)
    ]
    assert not upward, "imports against the one-way rule (cli -> ckpt -> models, recipes, planning -> core):\n" + (
        "\n".join(upward)
    )


def test_subpackages_import_only_those_below_them():
    """hfsdp.core: rules <- offload <- buffers <- outer <- engine <- kernels; hfsdp.cli: settings <- checks <- rank
    <- launcher <- commands (each may import those to its left; the modules at a package's root, anything)."""

    def place(module: str) -> tuple[str, int] | None:
        parts = module.split(".")
        package = ".".join(parts[:2])
        if package in ORDER and len(parts) > 3 and parts[2] in ORDER[package]:
            return package, ORDER[package].index(parts[2])
        return None

    against = []
    for out in _graph()[0].values():
        for e in out:
            source, target = place(e.source), place(e.target)
            upward = source and target and source[0] == target[0] and target[1] > source[1]
            if upward and (e.source, e.target) not in ORDER_EXCEPTIONS:
                against.append(str(e))
    assert not against, "imports of a subpackage above the importer (docs/design.md, Subpackages):\n" + "\n".join(
        against
    )


def test_no_package_folder_holds_more_than_20_modules():
    """A folder of more than 20 modules is several concepts in one room: group them into subpackages."""
    crowded = []
    for src in SOURCES:
        for folder in sorted({p.parent for p in src.rglob("*.py")}):
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            if count > MAX_MODULES:
                crowded.append(f"{folder.relative_to(REPO)}: {count} modules")
    assert not crowded, f"package folders of more than {MAX_MODULES} modules:\n" + "\n".join(crowded)


def test_every_hfsdp_import_names_a_module_or_name_that_exists():
    """An import of a moved or misspelt hfsdp module (`from hfsdp.cli import stopping` after the move to
    `hfsdp.cli.rank`) fails here, at any depth, before a code path that runs it does."""
    missing = _graph()[1]
    assert not missing, "imports of hfsdp modules or names that do not exist:\n" + "\n".join(missing)


def test_the_checks_see_the_imports_they_count():
    """The parser itself: a function-level import and a `from package import submodule` are edges."""
    edges = {e.target for e in _graph()[0]["hfsdp.cli.commands.train"]}
    assert "hfsdp.cli.rank.worker" in edges  # imported inside a function
    assert "hfsdp.cli.settings.autoresume" in edges  # `from hfsdp.cli.settings import autoresume`, in a function
