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


# Lower layers never import higher ones; a module may import its own layer's and those below.
LAYERS = [
    ["nmt.version", "nmt.errors", "nmt.switches", "nmt.options", "nmt.log", "nmt.files", "nmt.parallel",
     "nmt.recipe", "nmt.scoring", "nmt.commands", "nmt.device_options", "nmt.device", "nmt.huge_pages",
     "nmt.tuning", "nmt.demo_data"],
    ["nmt.data"],
    ["nmt.backends"],  # what decoding computes with: below the model, which calls it
    ["nmt.models"],
    ["nmt.checkpoint"],
    ["nmt.export"],
    ["nmt.generation"],
    ["nmt.training"],
    ["nmt.serving", "nmt.plot", "nmt.pipeline", "nmt.demo"],
    ["nmt.cli"],
    ["nmt.__main__", "nmt"],
]


def layer_of(module: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) for name in layer if module == name or module.startswith(name + ".")]
    assert found, f"{module} is in no layer of LAYERS"
    return max(found)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
              if layer_of(target) > layer_of(module)]
    assert not upward, f"imports that run upward: {upward}"


# The CPU fast path (nmt/backends/cpu_backend.py, int8 and what only they use): plugged in when a model is
# prepared for decoding, never imported by the model or the search, which read as plain PyTorch.
FAST_PATH = {"nmt.backends.cpu_backend", "nmt.backends.indexed_cache", "nmt.backends.kernels",
             "nmt.backends.kernel_build", "nmt.backends.int8", "nmt.generation.fused_layers"}
PLAIN = ["nmt.models.transformer", "nmt.models.attention", "nmt.generation.search", "nmt.generation.searchable"]


def imported_by(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every nmt module that importing ``module`` imports, directly or not."""
    seen, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("module", PLAIN)
def test_the_model_and_the_search_import_nothing_of_the_fast_path(module):
    graph = import_graph()
    assert FAST_PATH <= set(graph), "FAST_PATH names a module that is gone"
    assert not imported_by(module, graph) & FAST_PATH
