"""The project's layers, read from the source with `ast` (no module is imported, torch is not needed).

- `common/` is the floor: it imports nothing of the project but itself, no step, no `scripts/`, no top-level command.
- The installed package (`common`, the steps, `exercises`) imports neither `scripts/` nor the top-level commands
  (`compare.py`, `tour.py`): they are not installed, so a plain `pip install -e .` would miss them.
- The notebooks import only the installed package: they run after a plain `pip install -e .`.
- No import circle among the project's modules.

Every import counts, the ones inside functions and under `TYPE_CHECKING` too: a lazy import still ties one
module to another. A package's `__init__.py` is the module of the package's own name, with its own imports.
Importing `a.b` runs `a/__init__.py` first, but that is not counted as an edge: a package that re-exports its
modules (`exercises/__init__.py`) would otherwise seem to form a circle with each of them that imports a sibling.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = ("common", "exercises")  # and every step*
COMMANDS = ("compare", "tour")  # the top-level command files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    """Every module of the project by its dotted name: the package, scripts/ and the top-level commands."""
    folders = [REPO / name for name in (*PACKAGE, "scripts")] + sorted(REPO.glob("step[0-9]*"))
    files = [f for folder in folders for f in folder.rglob("*.py")] + [REPO / f"{c}.py" for c in COMMANDS]
    return {module_name(f): f for f in files}


def imported(path: Path, modules: dict[str, Path], source: str | None = None) -> set[str]:
    """The project modules that `path` (or `source`, read from it) imports anywhere in it. `from a import b` names
    the module `a.b` where there is one, else `a`."""
    roots = {name.partition(".")[0] for name in modules}
    text = path.read_text(encoding="utf-8") if source is None else source
    found = set()
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.partition(".")[0] in roots}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_files()
    return {name: imported(path, modules) for name, path in modules.items()}


def in_package(module: str) -> bool:
    root = module.partition(".")[0]
    return root in PACKAGE or root.startswith("step")


def test_common_imports_nothing_of_the_project_but_itself() -> None:
    wrong = {f"{module} imports {target}" for module, targets in import_graph().items()
             if module.partition(".")[0] == "common"
             for target in targets if target.partition(".")[0] != "common"}
    assert not wrong, "common/ is the floor below every step: " + "; ".join(sorted(wrong))


def test_the_package_imports_neither_scripts_nor_the_top_level_commands() -> None:
    wrong = {f"{module} imports {target}" for module, targets in import_graph().items() if in_package(module)
             for target in targets if target.partition(".")[0] in ("scripts", *COMMANDS)}
    assert not wrong, "not installed by pip install -e .: " + "; ".join(sorted(wrong))


def test_the_notebooks_import_only_the_installed_package() -> None:
    """No notebook reaches for scripts/ or compare.py, by import or by running the file (`runpy`)."""
    modules = project_files()
    wrong = []
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        wrong += [f"{notebook.name} imports {target}" for target in sorted(imported(notebook, modules, source))
                  if not in_package(target)]
        wrong += [f"{notebook.name} runs a file with runpy"] if "runpy" in source else []
    assert not wrong, "; ".join(wrong)


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that import one another, each directly or through others (the strongly connected
    components of more than one module, or of one that imports itself), by Tarjan's algorithm."""
    order: dict[str, int] = {}  # when each module was first reached
    lowest: dict[str, int] = {}  # the earliest module still open that it reaches
    open_modules: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        open_modules.append(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in open_modules:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:  # the first of its group reached: the group closes here
            group = set()
            while not group or module not in group:
                group.add(open_modules.pop())
            if len(group) > 1 or module in graph.get(module, ()):
                found.append(group)

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_circles_finds_each_circle_and_only_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"e"}, "f": {"d"}}
    assert sorted(map(sorted, circles(graph))) == [["a", "b", "c"], ["e"]]
    assert circles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_among_the_projects_modules() -> None:
    found = circles(import_graph())
    assert found == [], (
        "modules that import one another: " + "; ".join(" <-> ".join(sorted(group)) for group in found))
