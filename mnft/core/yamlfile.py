"""Strict YAML input files (inventories, playbooks): safe loading that refuses duplicate keys, remembers each
key's line for error messages, and turns every YAML problem into a one-line `InputError` naming file and line."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml

from mnft.core.errors import InputError


def read_text(path: Path, what: str, flag: str) -> str:
    """A file's text, or a one-line InputError saying what is wrong and which option names the file."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise InputError(f"{path}: {what} not found (pass {flag} with an existing file)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the {what}: {exc.__class__.__name__}: {exc}") from None


class LineMap(dict):
    """A YAML mapping that remembers the line of each key (for error messages)."""

    line: int = 0
    key_lines: dict[Any, int]


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        self.flatten_mapping(node)
        mapping = LineMap()
        mapping.line = node.start_mark.line + 1
        mapping.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                )
            key = str(key) if key is not None else key
            if key in mapping:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            mapping[key] = self.construct_object(value_node, deep=deep)
            mapping.key_lines[key] = key_node.start_mark.line + 1
        return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


def load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _DuplicateKey as exc:
        raise InputError(f"{where}:{exc.line}: duplicate key {exc.key!r} (a host or setting is listed twice)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise InputError(f"{where}{line}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{where}: YAML error: {exc}") from None


def line_of(mapping: Any, key: str | None = None) -> str:
    if isinstance(mapping, LineMap):
        line = mapping.key_lines.get(key, mapping.line) if key is not None else mapping.line
        return f":{line}"
    return ""


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
