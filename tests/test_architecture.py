"""The package's shape, as docs/architecture.md draws it: capabilities in layers, imports only downwards, no
circle between modules, and the host-side scripts standard library only.

Imports are read from the source (every `import`, also those inside functions), never executed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

MNFT = Path(__file__).resolve().parent.parent / "mnft"

# Bottom to top. A package imports its own modules and those of packages in lower layers, never one beside it or
# above it. recipes stands apart: it runs under torchrun on the hosts and needs only core.
LAYERS = (
    ("core",),
    ("hosts",),
    ("sync",),
    ("env", "image"),
    ("check",),
    ("run", "setup", "uninstall"),
    ("perf", "slurm", "board"),
    ("cli",),
)
APART = {"recipes": ("core",)}
# ... and only the command line reads one of its modules: a recipe's --set judged on the controller as the recipe
# judges it (mnft.cli.recipes imports mnft.recipes.config, which needs only core and yaml, never torch)
APART_READERS = {"recipes": ("cli",)}

# Shipped to a host as source (mnft.hosts.pyrun) and run by whatever Python the host has: one file, the standard
# library only, Python 3.8 syntax, and a `source()` that returns the file's text.
HOST_SCRIPTS = (
    "run.agent",
    "run.entry",
    "check.probe",
    "sync.treehash",
    "hosts.leasehost",
    "env.envhost",
    "uninstall.uninstallhost",
    "image.imagehost",
    "setup.steps.remote",
    "perf.linkagent",
    "perf.torchlaunch",
    "slurm.node",
)
# Shipped the same way but started by torchrun in the host's training Python: the standard library and torch.
TORCH_ENTRIES = ("perf.allreduce",)


def modules() -> dict[str, Path]:
    """'hosts.fleet' -> its file, for every module under mnft/ ('' for mnft/__init__.py)."""
    found = {}
    for path in sorted(MNFT.rglob("*.py")):
        parts = path.relative_to(MNFT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports (absolute names, `mnft.` kept), top level or inside a function."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["mnft", *package[: len(package) - node.level + 1]]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # `from mnft.run import agent`
    return out


def mnft_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    return {m.removeprefix("mnft.") for m in imports(name, path) if m.startswith("mnft.") and m.removeprefix("mnft.") in known}


def package_of(module: str) -> str:
    return module.split(".")[0]


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def allowed(importer: str, imported: str) -> bool:
    if importer == imported or imported == "":  # its own modules; mnft/__init__ (the version) from anywhere
        return True
    if importer in APART:
        return imported in APART[importer]
    if imported in APART:
        return importer in APART_READERS.get(imported, ())
    return layer_of(imported) < layer_of(importer)


def test_every_subpackage_is_in_exactly_one_layer_and_says_its_job():
    packages = {package_of(m) for m in modules() if m}
    placed = [p for layer in LAYERS for p in layer] + list(APART)
    assert sorted(placed) == sorted(set(placed)), "a package is placed twice"
    assert packages == set(placed), "every subpackage of mnft/ is placed in a layer (and only those are)"
    for package in packages:
        init = MNFT / package / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"mnft/{package}/__init__.py says what the package is for"


def test_no_module_lives_at_the_top_of_the_package():
    assert [p.name for p in MNFT.glob("*.py")] == ["__init__.py"], "every module belongs to a capability's subpackage"


def test_the_test_bed_is_not_shipped():
    assert not any(path.name == "testbed.py" for path in MNFT.rglob("*.py"))


def test_imports_go_only_downwards():
    known = modules()
    wrong = []
    for name, path in known.items():
        for target in mnft_imports(name, path, known):
            if not allowed(package_of(name), package_of(target)):
                wrong.append(f"mnft.{name} imports mnft.{target}")
    assert wrong == [], "imports that break the layers of docs/architecture.md:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_of_imports_between_modules():
    known = modules()
    graph = {name: mnft_imports(name, path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():  # the test above cannot pass by finding nothing
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_rule_refuses_upward_and_sideways_imports():
    assert allowed("run", "check") and allowed("cli", "core") and allowed("recipes", "core")
    assert not allowed("check", "run")  # upwards
    assert not allowed("run", "setup")  # beside
    assert not allowed("recipes", "hosts") and not allowed("run", "recipes") and allowed("cli", "recipes")


@pytest.mark.parametrize("name", HOST_SCRIPTS + TORCH_ENTRIES)
def test_host_scripts_are_one_file_of_the_standard_library(name):
    path = modules()[name]
    text = path.read_text(encoding="utf-8")
    ast.parse(text, feature_version=(3, 8))  # hosts mnft does not control may have an old Python
    tops = {m.split(".")[0] for m in imports(name, path)}
    extra = {"torch"} if name in TORCH_ENTRIES else set()
    outside = sorted(t for t in tops if t not in sys.stdlib_module_names and t not in extra)
    assert outside == [], f"mnft.{name} runs on hosts from its source alone: it imports {outside}"


@pytest.mark.parametrize("name", HOST_SCRIPTS)
def test_host_scripts_ship_their_own_source(name):
    import importlib

    module = importlib.import_module(f"mnft.{name}")
    assert module.source() == modules()[name].read_text(encoding="utf-8")


def test_the_command_line_judges_a_recipes_overrides_without_importing_torch():
    import subprocess
    import sys

    code = "import sys; from mnft.cli.recipes import check_overrides; check_overrides('lora', ('max_steps=3',)); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
