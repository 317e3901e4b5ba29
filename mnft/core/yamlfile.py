"""Strict YAML input files (inventories, playbooks, job files): safe loading that refuses duplicate keys,
remembers each key's line for error messages, and turns every YAML problem into a one-line `InputError` naming
file and line. Loading is bounded (mnft.core.limits): the file's size and line length, nesting depth, nodes and
alias uses while composing, the document's size with every alias expanded (an alias bomb is refused before it is
built), and the length of an integer before it is converted. Events come from libyaml when PyYAML has it (five
times faster than the pure-Python scanner); composing stays in Python, where the limits are counted.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, SequenceNode
from yaml.resolver import Resolver

from mnft.core import limits
from mnft.core.errors import InputError


def read_text(path: Path, what: str, flag: str, limit: int = limits.JOB_BYTES) -> str:
    """A file's text (at most `limit` bytes, lines at most LINE_CHARS), or a one-line InputError saying what is
    wrong and which option names the file."""
    return limits.text_of(limits.read_bytes(path, limit, what, flag), str(path), what)


class LineMap(dict):
    """A YAML mapping that remembers the line of each key (for error messages)."""

    line: int = 0
    key_lines: dict[Any, int]


try:  # libyaml's event parser (iterative: no recursion however deep the input), Python's composer on top
    from yaml._yaml import CParser

    class _Events(Composer, CParser):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)

except ImportError:  # PyYAML built without libyaml: the pure-Python reader, scanner and parser
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Events(Reader, Scanner, Parser, Composer):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)


class _Limit(Exception):
    def __init__(self, message: str, mark: Any = None):
        super().__init__(message)
        self.line = mark.line + 1 if mark is not None else None


class _Loader(_Events, SafeConstructor, Resolver):
    """yaml.SafeLoader's behaviour, with limits counted while composing and checked before constructing."""

    def __init__(self, stream: str) -> None:
        _Events.__init__(self, stream)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = self._nodes = self._aliases = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        self._nodes += 1
        if self._nodes > limits.YAML_NODES:
            raise _Limit(f"more than {limits.YAML_NODES} YAML nodes", event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > limits.YAML_ALIASES:
                raise _Limit(f"more than {limits.YAML_ALIASES} YAML aliases", event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > limits.YAML_DEPTH:
            raise _Limit(f"YAML nested deeper than {limits.YAML_DEPTH} levels", event.start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):  # type: ignore[override]
        node = super().get_single_node()
        if node is not None:
            _check_expanded(node)
        return node

    def construct_yaml_int(self, node):  # type: ignore[override]
        if len(node.value) > limits.NUMBER_CHARS:  # 9999…: converting thousands of digits is quadratic
            raise _Limit(f"an integer of {len(node.value)} characters: longer than {limits.NUMBER_CHARS}", node.start_mark)
        try:
            return super().construct_yaml_int(node)
        except (ValueError, IndexError):  # `!!int ''`, `!!int x`: PyYAML's own constructor fails with an IndexError
            raise yaml.constructor.ConstructorError(None, None, f"{node.value[:40]!r} is not an integer", node.start_mark) from None

    def construct_yaml_float(self, node):  # type: ignore[override]
        try:
            return super().construct_yaml_float(node)
        except (ValueError, IndexError):  # `!!float ''`
            raise yaml.constructor.ConstructorError(None, None, f"{node.value[:40]!r} is not a number", node.start_mark) from None

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
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


def _check_expanded(root: Any) -> None:
    """The document's size with every alias expanded, counted over the node graph (each node once, shared ones
    by their expanded size): `a: &a [x, x, …] b: &b [*a, *a, …] …` is a handful of nodes that expand to billions,
    and every consumer walking it (merging vars, printing a value) would. An alias to its own collection is refused
    too (it expands for ever)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            if total > limits.YAML_NODES:
                raise _Limit(f"the YAML document expands to more than {limits.YAML_NODES} nodes through its aliases "
                             "(an alias bomb?)", node.start_mark)
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in open_:
            raise _Limit("a YAML alias refers to the collection that holds it (it would expand for ever)", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_:
                raise _Limit("a YAML alias refers to the collection that holds it (it would expand for ever)", child.start_mark)
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: Any) -> list:
    if isinstance(node, SequenceNode):
        return node.value
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


def load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except _Limit as exc:
        line = f":{exc.line}" if exc.line else ""
        raise InputError(f"{where}{line}: {exc} (a limit of mnft's input, see docs/security.md)") from None
    except _DuplicateKey as exc:
        raise InputError(f"{where}:{exc.line}: duplicate key {exc.key!r} (a host or setting is listed twice)") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise InputError(f"{where}{line}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:  # a reader error (a control character, not UTF-8) spans lines: one line here
        raise InputError(f"{where}: YAML error: {' '.join(str(exc).split())}") from None
    except (ValueError, TypeError, IndexError, OverflowError) as exc:  # a constructor of a tag (!!timestamp …) failed
        raise InputError(f"{where}: YAML value error: {' '.join(str(exc).split())[:200]}") from None


def line_of(mapping: Any, key: str | None = None) -> str:
    if isinstance(mapping, LineMap):
        line = mapping.key_lines.get(key, mapping.line) if key is not None else mapping.line
        return f":{line}"
    return ""


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
