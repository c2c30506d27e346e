"""The package's imports point one way: no circles, and runtime's parts never reach the facade.

Walks every module's ``import`` statements with ``ast`` (including imports inside functions and
under ``TYPE_CHECKING``: a circle hidden from the interpreter is still a circle for a reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvtier"

# Layers, outermost first: a module may import only its own layer or the ones after it.
LAYERS = [
    ("kvtier.__main__", "kvtier.example"),
    ("kvtier.runtime",),
    ("kvtier.events",),  # the runtime calls its sink; it sees runtime objects only duck-typed
    ("kvtier.kernels", "kvtier.storage"),
    ("kvtier.metrics", "kvtier.nvtx", "kvtier.checks"),
]
# runtime's parts get their collaborators from the builder: they never import it or the facade.
PARTS = (
    "kvtier.runtime.pools",
    "kvtier.runtime.tree",
    "kvtier.runtime.l3",
    "kvtier.runtime.request",
    "kvtier.runtime.slots",
    "kvtier.runtime.inserts",
)
FACADE = ("kvtier.runtime.cache", "kvtier.runtime.build")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule when one exists
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            if t.startswith("kvtier"):
                # the deepest known module the name refers to
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in known and t != name:
                    out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer_of(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_circles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if m.startswith(n + "."):
                continue  # a package importing its own submodules is no circle
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)


def test_imports_point_one_way():
    bad = []
    for name, deps in graph().items():
        mine = layer_of(name)
        for dep in deps:
            theirs = layer_of(dep)
            if mine is not None and theirs is not None and theirs < mine:
                bad.append(f"{name} imports {dep} (an outer layer)")
            if under(name, PARTS) and under(dep, FACADE):
                bad.append(f"{name} imports {dep}: runtime's parts never import the facade")
    assert not bad, "\n".join(sorted(bad))


def test_every_folder_says_what_it_holds():
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.strip(), f"{init.parent} has no docstring saying what it holds"
