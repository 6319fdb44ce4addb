"""The layout's rules, read from the code's own imports: which folder may import which, no
torch in the engine's core, no import circles, and one installed name.

Imports inside functions count (they run too); those under ``if TYPE_CHECKING:`` do not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("engine", "plugins", "attention_backends", "native", "server", "cli", "benchmarks", "simulator")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("pagoda", *parts))


def _modules() -> dict[str, Path]:
    files = [ROOT / "__init__.py", ROOT / "__main__.py", ROOT / "environment.py"]
    for folder in PACKAGE_FOLDERS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return {_module_name(path): path for path in files}


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> set[str]:
    """Every module name the code imports, outside TYPE_CHECKING blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                # `from pagoda.engine import model_loader` imports a module, not a name.
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


IMPORTS = {name: _imports(ast.parse(path.read_text(), str(path))) for name, path in MODULES.items()}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


E = "pagoda.engine"
SHARED = [name for name, path in MODULES.items()
          if path.parent == ROOT / "engine" and name != E]  # engine/*.py: read by both processes

# (who, may not import, why)
RULES = [
    ([f"{E}.core"], ["torch", f"{E}.frontend", f"{E}.worker", f"{E}.models", "pagoda.attention_backends"],
     "the core runs in the engine process without torch and knows nothing of the frontend or the worker"),
    ([f"{E}.worker", f"{E}.models"], [f"{E}.core", f"{E}.frontend", f"{E}.executor"],
     "the worker process knows nothing of the engine process's modules"),
    ([f"{E}.executor"], [f"{E}.frontend", f"{E}.core"], "executors only carry messages to and from workers"),
    (SHARED, [f"{E}.core", f"{E}.frontend", f"{E}.executor", f"{E}.worker", f"{E}.models"],
     "the modules both processes read are leaves of the engine"),
    (["pagoda.plugins", "pagoda.attention_backends"], [E, "pagoda.server", "pagoda.cli", "pagoda.benchmarks"],
     "plugins and attention backends depend on nothing of ours above them"),
    (["pagoda.native"], [E, "pagoda.attention_backends", "pagoda.plugins", "pagoda.server", "pagoda.cli",
                          "pagoda.benchmarks", "pagoda.simulator"],
     "the CPU kernels are the floor: they import nothing of Pagoda's above them"),
    ([f"{E}.families"], ["torch", "pagoda.native", f"{E}.core", f"{E}.frontend", f"{E}.executor", f"{E}.worker", f"{E}.models",
                         "pagoda.attention_backends", "pagoda.plugins"],
     "model families are descriptions both processes read: no torch, no kernels, nothing of the engine"),
    ([E], ["pagoda.server", "pagoda.cli", "pagoda.benchmarks", "pagoda.simulator"],
     "the engine never imports the server, the CLI or the tools built on it"),
    (["pagoda.simulator"], ["torch", f"{E}.frontend", f"{E}.worker", f"{E}.models", f"{E}.executor",
                            "pagoda.attention_backends", "pagoda.server"],
     "the simulator runs the engine core alone, in place of the worker, without torch"),
    (["pagoda.environment"], ["torch", *(f"pagoda.{folder}" for folder in PACKAGE_FOLDERS)],
     "the environment registry imports nothing of Pagoda's, so that every layer may read it"),
]


@pytest.mark.parametrize("who, forbidden, why", RULES, ids=[rule[2].split(" ")[1] + str(i) for i, rule in
                                                          enumerate(RULES)])
def test_folder_imports_follow_the_layering(who, forbidden, why):
    broken = sorted(f"{module} imports {target}" for module, targets in IMPORTS.items() if _in(module, *who)
                    for target in targets if _in(target, *forbidden))
    assert not broken, f"{why}:\n" + "\n".join(broken)


def test_no_import_circles():
    graph = {module: {t for t in targets if t in MODULES and t != module} for module, targets in IMPORTS.items()}
    # Tarjan's strongly connected components, iteratively.
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def connect(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_core_runs_without_torch():
    # NOTE: what the rules above imply, checked by running it: no shared module pulls torch in.
    code = ("import sys\nimport pagoda.engine.core.engine_core, pagoda.engine.core.kv_sizing, "
            "pagoda.engine.core.plugin_manager, pagoda.plugins, pagoda.simulator.cli, pagoda.simulator.simulator, "
            "pagoda.simulator.report\n"
            "print(sorted(m for m in ('torch',) if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_package_folder_is_installed_and_nothing_else():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"pagoda": "."}
    folders = {_module_name(path.parent) for folder in PACKAGE_FOLDERS for path in (ROOT / folder).rglob("__init__.py")}
    assert set(config["packages"]) == folders | {"pagoda"}
