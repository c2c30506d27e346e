"""The code's layout: the test tree mirrors ``kvtier/runtime``, no test module imports another,
and no class in ``kvtier/`` is over ``MAX_CLASS_LINES`` lines.

Shared set-up lives in ``conftest.py`` fixtures or in helper modules whose names do not start
with ``test_``: a test module imported by another runs its module-level set-up twice (once per
name it is imported under) and hides which file owns a helper.

A class too large to read at once is split by responsibility into parts with explicit
collaborators (STYLE.md, lesson 17), never spread over files by mixins.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
RUNTIME = REPO / "kvtier" / "runtime"
PACKAGE = REPO / "kvtier"

MAX_CLASS_LINES = 500
# Classes allowed over the limit, keyed "path::Class" (path relative to the repository), each
# with the reason. Empty: a class that grows past the limit is split, not listed.
OVERSIZED: dict[str, str] = {}


def imported_modules(source: str, path: Path) -> list[str]:
    """Every module the source of ``path`` imports, as dotted names, including imports inside
    functions; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a module)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the file's package
                pkg = list(path.relative_to(REPO).parent.parts)
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            out += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return out


def imported_test_modules(path: Path) -> list[str]:
    names = imported_modules(path.read_text(), path)
    return [m for m in names if m.split(".")[-1].startswith("test_")]


def test_no_test_module_imports_another() -> None:
    bad = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for name in imported_test_modules(path)
    ]
    assert not bad, "move shared set-up into conftest.py or a helper module:\n" + "\n".join(bad)


def test_the_import_check_flags_every_form(tmp_path: Path) -> None:
    """The check above passes trivially if it cannot see an import: each form must be flagged."""
    where = TESTS / "runtime" / "l3"
    forms = [
        "from tests.runtime.test_cache import run_turn\n",
        "import tests.runtime.test_tp as tp\n",
        "from tests.runtime import test_cache\n",
        "def f():\n    from ..test_cache import P\n",
    ]
    for source in forms:
        names = imported_modules(source, where / "test_probe.py")
        assert any(n.startswith("tests.runtime.test_") for n in names), (source, names)
    clean = imported_modules("from tests.runtime.synthetic import P\n", where / "test_probe.py")
    assert not [n for n in clean if n.split(".")[-1].startswith("test_")], clean


def test_tests_mirror_the_runtime_packages() -> None:
    """Each folder of ``kvtier/runtime`` has a test package of the same path with tests in it."""
    missing = []
    for pkg in sorted(p.parent for p in RUNTIME.rglob("__init__.py")):
        mirror = TESTS / "runtime" / pkg.relative_to(RUNTIME)
        if not (mirror / "__init__.py").is_file():
            missing.append(f"{mirror.relative_to(REPO)}/__init__.py (for {pkg.relative_to(REPO)})")
        elif not any(mirror.glob("test_*.py")):
            missing.append(f"{mirror.relative_to(REPO)}/test_*.py (for {pkg.relative_to(REPO)})")
    assert not missing, "tests/runtime must mirror kvtier/runtime; missing:\n" + "\n".join(missing)


def class_sizes(source: str, path: str) -> dict[str, int]:
    """Lines of every class in ``source`` (nested ones too), keyed ``path::Name``: from the
    ``class`` line to its last line (decorators not counted)."""
    return {
        f"{path}::{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source, path))
        if isinstance(node, ast.ClassDef)
    }


def package_class_sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        sizes.update(class_sizes(path.read_text(), path.relative_to(REPO).as_posix()))
    return sizes


def test_no_class_is_over_the_limit() -> None:
    sizes = package_class_sizes()
    over = [
        f"{name}: {n} lines"
        for name, n in sorted(sizes.items())
        if n > MAX_CLASS_LINES and name not in OVERSIZED
    ]
    assert not over, (
        f"classes over {MAX_CLASS_LINES} lines; split each by responsibility into parts with "
        "explicit collaborators:\n" + "\n".join(over)
    )


def test_oversized_entries_name_existing_classes() -> None:
    """An entry that names no class (renamed, moved, a typo) would let any class grow past
    the limit unnoticed under its new name: each must name a class that exists."""
    sizes = package_class_sizes()
    stale = [name for name in OVERSIZED if name not in sizes]
    assert not stale, "OVERSIZED names classes that do not exist:\n" + "\n".join(stale)


def test_the_class_size_check_counts_every_class() -> None:
    """The check above passes trivially if it miscounts or misses a class: count known ones."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES - 1))
    source = (
        f"class Fits:\n{body}"  # exactly the limit
        f"\n@decorated\nclass Over:\n{body}    y = 0\n"  # one line over
        "\ndef f():\n    class Inner:\n        pass\n"  # nested in a function
    )
    sizes = class_sizes(source, "probe.py")
    assert sizes == {
        "probe.py::Fits": MAX_CLASS_LINES,
        "probe.py::Over": MAX_CLASS_LINES + 1,
        "probe.py::Inner": 2,
    }, sizes
