"""The package's layering, read from its source with `ast`: no import cycle among vit_finetune's modules, counting
the imports inside functions too (a lazy import that dodges a cycle is still one; `if TYPE_CHECKING:` imports
aside), no source file over 500 lines and no function or class over 300. That `import vit_finetune` and
`vitft --help` import no torch is checked in test_cli.py (test_help_starts_without_torch and
test_import_is_lazy_and_the_public_api_still_works).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Iterable, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vit_finetune"
MAX_FILE_LINES = 500
MAX_DEFINITION_LINES = 300



def module_name(path: Path, package: Path = PACKAGE) -> str:
    """vit_finetune/hub/push.py -> vit_finetune.hub.push; a package's __init__.py is the package."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(nodes: Iterable[ast.AST], in_function: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement among `nodes` and below, and whether it runs inside a function; the bodies of
    `if TYPE_CHECKING:` (not their else branches) left out."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, in_function)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(ast.iter_child_nodes(node), inside)


def import_graph(package: Path = PACKAGE, *, module_level_only: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports. Relative imports are resolved; `from . import x` and
    `from pkg import x` point at the submodule x when there is one, else at pkg itself."""
    files = source_files(package)
    root = package.name
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = graph.setdefault(name, set())
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node, in_function in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)).body):
            if module_level_only and in_function:
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == root)
                continue
            base = here[:len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != root:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                targets.add(submodule if submodule in files else target)
        targets.discard(name)
    return graph


def _cycle_from(graph: dict[str, set[str]], start: str) -> Optional[list[str]]:
    """A path start -> ... -> start in `graph` (depth first, in name order), or None."""
    path, seen = [start], {start}
    branches = [iter(sorted(graph.get(start, ())))]
    while branches:
        nxt = next(branches[-1], None)
        if nxt is None:
            branches.pop()
            path.pop()
        elif nxt == start:
            return path + [start]
        elif nxt not in seen:
            seen.add(nxt)
            path.append(nxt)
            branches.append(iter(sorted(graph.get(nxt, ()))))
    return None


def find_cycle(graph: dict[str, set[str]], through: Optional[str] = None) -> Optional[list[str]]:
    """An import cycle (a -> b -> ... -> a) in `graph`, through the module `through` when given; None without."""
    for start in [through] if through else sorted(graph):
        cycle = _cycle_from(graph, start)
        if cycle:
            return cycle
    return None


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


MODULES = sorted(source_files())
FILES = sorted(PACKAGE.rglob("*.py"))


def test_the_graph_sees_relative_function_level_and_submodule_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")  # a submodule through `from PACKAGE import NAME`
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # relative, inside a function
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                                  "else:\n    import pkg.sub\n\ng = 1\n")
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.sub"}}
    assert import_graph(package, module_level_only=True)["pkg.sub.b"] == set()
    assert find_cycle(graph) is None
    (package / "c.py").write_text("def h():\n    from . import a\n")  # a lazy import closing a circle
    assert find_cycle(import_graph(package)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    assert find_cycle(import_graph(package, module_level_only=True)) is None


def test_no_module_level_import_cycle():
    cycle = find_cycle(import_graph(module_level_only=True))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", MODULES)
def test_no_import_cycle_through_the_module_even_inside_functions(module):
    cycle = find_cycle(import_graph(), through=module)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("path", FILES, ids=module_name)
def test_source_file_is_at_most_500_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_FILE_LINES, f"{_relative(path)} has {lines} lines"


def _long_definitions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and node.end_lineno - node.lineno + 1 > MAX_DEFINITION_LINES]


@pytest.mark.parametrize("path", FILES, ids=module_name)
def test_no_function_or_class_over_300_lines(path):
    assert _long_definitions(path) == [], f"{_relative(path)}: (name, lines) over the limit"


@pytest.mark.parametrize("script", sorted(p.stem for p in (REPO / "scripts").glob("*.py")))
def test_every_script_imports(script, monkeypatch):
    """The benchmarks and helpers import what the package has now (a script importing a moved name fails here,
    not when someone next runs it); scripts/ is on sys.path as when a script runs."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    importlib.import_module(script)
