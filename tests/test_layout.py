"""The floor plan README's Layout section states: every folder's import path is `mpfa.` and its path, no module-level
import cycle, and no layer imports a layer above it (the order as README lists it)."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("mpfa_cli", "backends", "kernels", "profiles", "scenarios")


def _modules() -> dict[str, Path]:
    """Every module of the project by its import path under the layout rule."""
    found = {"mpfa": ROOT / "__init__.py"}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = ["mpfa", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, *, module_level_only: bool) -> set[str]:
    """The project modules `module` imports (relative imports resolved; `from P import name` is P.name when that
    is a module, else P)."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # module level includes imports under `if TYPE_CHECKING:` or try/except at top level
        nodes = [n for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 for n in ast.walk(top)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
                elif target in MODULES:
                    found.add(target)
    found.discard(module)
    return found


def _layers() -> list[list[str]]:
    """README's layer list, top first: each line of the Layout section's numbered list names its packages."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [re.findall(r"`(mpfa[\w.]*)`", line) for line in section.splitlines() if re.match(r"\d+\. ", line)]
    assert rows, "README's Layout section lists no layers"
    return rows


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """Index of the layer holding `module` (the longest package prefix that a layer names)."""
    best = max(((len(name), i) for i, row in enumerate(layers) for name in row
                if module == name or module.startswith(name + ".")), default=None)
    assert best is not None, f"{module} is in no layer of README's Layout section"
    return best[1]


def test_every_package_is_its_folder() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"mpfa": "."}, "the root is the package mpfa; no other folder is remapped"
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert set(config["packages"]) == packages, "pyproject lists exactly the folders that hold an __init__.py"
    for top in TOPS:
        for folder in (ROOT / top).rglob("*"):
            if folder.is_dir() and any(folder.glob("*.py")) and "__pycache__" not in folder.parts:
                assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} holds modules but is no package"


def test_imports_within_the_project_are_relative() -> None:
    """An absolute `mpfa.` import hides the file it names from a reader who follows paths; relative ones spell it."""
    absolute = [f"{m}: {n.module}" for m in MODULES for n in ast.walk(ast.parse(MODULES[m].read_text()))
                if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").startswith("mpfa")]
    absolute += [f"{m}: {a.name}" for m in MODULES for n in ast.walk(ast.parse(MODULES[m].read_text()))
                 if isinstance(n, ast.Import) for a in n.names if a.name.startswith("mpfa")]
    assert absolute == []


def test_no_module_level_import_cycle() -> None:
    graph = {m: _imports(m, module_level_only=True) for m in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_layer_imports_a_higher_one() -> None:
    layers = _layers()
    upward = []
    for module in MODULES:
        if module == "mpfa":
            continue
        own = _layer_of(module, layers)
        upward += [f"{module} -> {target}" for target in sorted(_imports(module, module_level_only=False))
                   if target != "mpfa" and _layer_of(target, layers) < own]
    assert upward == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "mpfa"))
def test_every_module_is_in_a_layer(module: str) -> None:
    _layer_of(module, _layers())
