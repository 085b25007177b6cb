"""The package's import structure: no module imports itself back through others, and the command
line starts without torch (its options are torch-free; each command imports its library when it runs)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nmt"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each nmt module -> the nmt modules it imports, at module level or inside functions alike (also under
    TYPE_CHECKING). A package's __init__ importing its modules (nmt.models registers its archs) is not an
    edge from those modules: importing a submodule runs its package's __init__ first, as in fairseq."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_module_imports_itself_back_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_is_absolute_so_the_graph_sees_it():
    relative = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, f"relative imports: {relative}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("argv", [["--help"], ["score", "--help"], ["generate", "--help"], ["train", "--help"],
                                  ["serve", "--help"], ["--version"]])
def test_the_command_line_starts_without_torch(argv):
    code = ("import sys\nfrom nmt.cli import app\ntry:\n    app(" + repr(argv) + ", standalone_mode=False)\n"
            "finally:\n    print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().endswith("NO TORCH"), f"`nmt {' '.join(argv)}` imported torch"
