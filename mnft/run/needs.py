"""What a job needs on every host before it can start, read from its source and never executed: its entry point,
in the tree as it will be after sync, and the modules it imports.

The entry script's module-level imports are read with `ast`. An import that names a module of the project (a file
of the synced tree, found where Python will find it on the host: the script's own directory first, then the
tree's top, which mnft puts on PYTHONPATH) is followed into that module, so the project's own modules add their
imports too. What remains are the top-level names of installed packages, which every host's Python must resolve
(mnft.onhost.probe looks each up with `importlib.util.find_spec`: nothing is imported). Imports in a `try` that
catches ImportError, under `if TYPE_CHECKING:`, or inside a function are optional or late: not required. A recipe
adds its declared dependencies, a job file its `requires:` list.

A script that changes sys.path itself may import from places this reading cannot see: its missing modules are
then warnings, not errors.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

from mnft.check.findings import Need
from mnft.core import limits
from mnft.core.errors import InputError
from mnft.run.job import Job

MAX_FILES = 400  # project modules followed at most (a bound for a huge tree; the rest is not read)
MAX_BYTES = limits.SOURCE_BYTES  # a larger source file is not read (its imports are not followed: a generated file, not code)
OPTIONAL_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class Import:
    module: str  # as written: "torch.nn", "" for `from . import x`
    level: int  # 0 absolute, 1 for `from .`, …
    names: tuple[str, ...]  # `from module import names` (empty for `import module`)
    line: int


@dataclass(frozen=True)
class JobNeeds:
    files: tuple[str, ...] = ()  # paths every host must hold: a script outside the synced tree
    modules: tuple[Need, ...] = ()  # installed modules every host's Python must resolve
    read: int = 0  # project files read


def module_imports(source: str, filename: str = "<source>") -> tuple[list[Import], bool]:
    """The imports a module runs when it is imported (module level, into if/else, with and try bodies that do
    not catch ImportError), and whether it changes sys.path itself. A file that does not parse gives none."""
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return [], False
    found: list[Import] = []
    changes_path = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal changes_path
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(Import(alias.name, 0, (), node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.module != "__future__":
                    found.append(Import(node.module or "", node.level, tuple(a.name for a in node.names), node.lineno))
            elif isinstance(node, ast.If):
                if not _type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
                if not any(_catches_import_error(h) for h in node.handlers):
                    visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                visit(node.body)
            if not changes_path and _touches_sys_path(node):
                changes_path = True

    visit(tree.body)
    return found, changes_path


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any((t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "") in OPTIONAL_ERRORS for t in types)


def _touches_sys_path(node: ast.stmt) -> bool:
    """`sys.path.insert(…)`, `sys.path.append(…)`, `sys.path = …`, `site.addsitedir(…)` at module level."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "path" and isinstance(sub.value, ast.Name) and sub.value.id == "sys":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "addsitedir":
            return True
    return False


class Project:
    """The synced tree as the host's Python will see it: which imports are the project's own files."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = [r for r in roots if r.is_dir()]

    def find(self, dotted: str) -> list[Path]:
        """The files importing `dotted` runs (each package's __init__.py on the way, then the module), or [] when it
        is not the project's. Python's order on each root: a package (a directory with __init__.py), a module file,
        a namespace package (a directory without)."""
        parts = dotted.split(".")
        for root in self.roots:
            files, here = [], root
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                package, module = here / part, here / f"{part}.py"
                if (package / "__init__.py").is_file():
                    files.append(package / "__init__.py")
                elif module.is_file():
                    if last:
                        return files + [module]
                    break  # a module has no submodules: not this root's
                elif not package.is_dir():
                    break
                here = package
                if last:
                    return files or [package]  # a namespace package: nothing of its own runs
        return []


def _absolute(imp: Import, importer: str) -> str:
    """The absolute module name of a relative import made in module `importer` (a package's __init__ counts as the
    package)."""
    if not imp.level:
        return imp.module
    base = importer.split(".")[: max(0, len(importer.split(".")) - imp.level)]
    return ".".join(base + ([imp.module] if imp.module else []))


def _module_name(path: Path, roots: list[Path]) -> str:
    for root in roots:
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts and parts[-1] == "__init__":
            parts = parts[:-1]
        return ".".join(parts)
    return path.stem


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def distribution_of(module: str) -> str | None:
    """The distribution this machine has that provides a top-level module (PyYAML for yaml), or None."""
    names = _distributions().get(module) or []
    return names[0] if names else None


def job_needs(job: Job, tree: Path | None, synced: bool) -> JobNeeds:
    """The entry point and the modules `job` needs on every host. tree: the local tree mnft syncs (None: no tree,
    e.g. a script given by absolute path). An entry point that should be in the synced tree and is not is bad
    input (InputError, before any host is touched)."""
    files: list[str] = []
    start: list[tuple[Path, str]] = []  # (file, its module name)
    roots: list[Path] = []
    external: dict[str, str] = {}  # top-level module -> where it is first imported
    script = job.script
    if script is not None:
        if script.startswith(("/", "~")) or not synced or tree is None:
            files.append(script)  # not in the synced tree: each host must hold it (checked there)
            local = Path(script).expanduser() if script.startswith(("/", "~")) else (tree / script if tree else None)
            if local is not None and local.is_file():
                roots = [local.parent] + ([tree] if tree else [])
                start.append((local, "__main__"))
        else:
            path = tree / script
            if not path.is_file():
                raise InputError(f"{script}: no such file in {tree} (the tree mnft syncs; a relative script path is relative "
                                 "to it: run from your repository or pass --src)")
            roots = [path.parent, tree]
            start.append((path, "__main__"))
    elif job.kind in ("module", "recipe"):
        module = job.entry[1]
        roots = [tree] if tree is not None else []
        found = Project(roots).find(module)
        if found:
            main = found[-1].parent / "__main__.py" if found[-1].name == "__init__.py" else None
            start.extend((f, _module_name(f, roots)) for f in [*found, *([main] if main and main.is_file() else [])] if f.is_file())
        else:
            external.setdefault(module.split(".")[0], f"-m {module}")
    project = Project(roots)
    seen: set[Path] = set()
    queue = list(start)
    warn = False
    while queue and len(seen) < MAX_FILES:
        path, name = queue.pop(0)
        real = path.resolve()
        if real in seen or not path.is_file():
            continue
        seen.add(real)
        try:
            source = limits.read_file(path, MAX_BYTES, "source file", "SOURCE_BYTES").decode("utf-8", "replace")
        except InputError:  # too large (measured before it is read) or unreadable: its imports are not followed
            continue
        imports, touches = module_imports(source, str(path))
        warn = warn or touches
        where_base = str(path.relative_to(tree)) if tree is not None and path.is_relative_to(tree) else str(path)
        for imp in imports:
            absolute = _absolute(imp, name if path.name != "__init__.py" or name == "__main__" else name + ".__init__")
            if not absolute and not imp.names:
                continue
            candidates = [absolute] if absolute else []
            if imp.names:  # `from pkg import sub`: sub may be a module of the package
                candidates = [f"{absolute}.{n}" if absolute else n for n in imp.names if n != "*"] + candidates
            local = False
            for dotted in candidates:
                hit = project.find(dotted)
                if hit:
                    local = True
                    queue.extend((f, _module_name(f, project.roots)) for f in hit if f.is_file())
            if local or imp.level:
                continue  # the project's own, or a relative import that stays inside it
            top = absolute.split(".")[0]
            if top and top not in sys.stdlib_module_names and top != "__main__":
                external.setdefault(top, f"{where_base}:{imp.line}")
    for module in job.requires:
        external.setdefault(module.split(".")[0], f"{job.source or job.label}: requires")
    needs = tuple(Need(module, where, distribution_of(module), optional=warn) for module, where in sorted(external.items()))
    return JobNeeds(tuple(files), needs, len(seen))
