"""The package's shape, as docs/architecture.md draws it: capabilities in layers, imports only downwards, no
circle between modules, and the host package (mnft.onhost) of small modules that import only each other and the
standard library, each shipped with exactly what it imports.

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
    ("onhost",),
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

# What runs on hosts: mnft.onhost, shipped as payloads (mnft.hosts.payload) and run by whatever Python the host has:
# the standard library and each other only (relative imports), Python 3.8 syntax, no module over MAX_HOST_LINES.
HOST_PACKAGE = "onhost"
MAX_HOST_LINES = 600
# Run as a file of its own (written into a run directory, run by each rank's Python), outside any payload: it
# imports nothing of the package.
STANDALONE = ("onhost.entry", "onhost.xidreader")
# Shipped as a text and started by torchrun in the host's training Python: the standard library and torch.
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


def host_modules() -> list[str]:
    return sorted(m for m in modules() if package_of(m) == HOST_PACKAGE)


@pytest.mark.parametrize("name", host_modules() + list(TORCH_ENTRIES))
def test_host_modules_import_only_each_other_and_the_standard_library(name):
    path = modules()[name]
    text = path.read_text(encoding="utf-8")
    ast.parse(text, feature_version=(3, 8))  # hosts mnft does not control may have an old Python
    tops = {m.split(".")[0] for m in imports(name, path)}
    extra = {"torch"} if name in TORCH_ENTRIES else set()
    siblings = {"mnft"} if name.startswith(HOST_PACKAGE + ".") else set()  # `from . import x`, read as mnft.onhost.x
    outside = sorted(t for t in tops if t not in sys.stdlib_module_names and t not in extra | siblings)
    assert outside == [], f"mnft.{name} runs on hosts from its payload alone: it imports {outside}"
    own = {m for m in imports(name, path) if m.startswith("mnft")}
    assert all(m == "mnft." + HOST_PACKAGE or m.startswith(f"mnft.{HOST_PACKAGE}.") for m in own), \
        f"mnft.{name} imports outside the host package: {sorted(own)}"
    absolute = [n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").startswith("mnft")]
    assert absolute == [], f"mnft.{name}: host modules import each other relatively (`from . import x`), the name they have on a host"


@pytest.mark.parametrize("name", host_modules())
def test_no_host_module_is_long(name):
    lines = len(modules()[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_HOST_LINES, f"mnft/{name.replace('.', '/')}.py has {lines} lines: split it by concern (over {MAX_HOST_LINES})"


@pytest.mark.parametrize("name", STANDALONE)
def test_a_standalone_host_module_imports_nothing_of_the_package(name):
    path = modules()[name]
    assert {m for m in imports(name, path) if m.startswith("mnft")} == set()


def test_the_controller_imports_the_host_package_only_for_what_both_sides_judge():
    """The controller reads host modules for constants and pure functions (written once); it never runs one's main,
    and never reads one's file but through mnft.hosts.payload (which ships them)."""
    offenders = []
    for name, path in modules().items():
        if package_of(name) == HOST_PACKAGE or name == "hosts.payload":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("main", "__file__"):
                base = node.value
                if isinstance(base, ast.Name) and f"mnft.{HOST_PACKAGE}.{base.id}" in imports(name, path):
                    offenders.append(f"mnft.{name}: {base.id}.{node.attr}")
    assert offenders == []


def test_every_host_module_is_shipped_by_some_entry_and_entries_have_a_main():
    from mnft.hosts import payload

    entries = [m.split(".", 1)[1] for m in host_modules() if "def main(" in modules()[m].read_text(encoding="utf-8")]
    shipped = set().union(*(payload.closure(e) for e in entries))
    package = {m.split(".", 1)[1] if "." in m else "__init__" for m in host_modules()}
    assert package - shipped - {s.split(".", 1)[1] for s in STANDALONE} == set(), "a host module no entry imports"


def test_the_command_line_judges_a_recipes_overrides_without_importing_torch():
    import subprocess
    import sys

    code = "import sys; from mnft.cli.recipes import check_overrides; check_overrides('lora', ('max_steps=3',)); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
