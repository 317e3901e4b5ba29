"""An Ansible INI inventory (`/etc/ansible/hosts`, Ansible's default format), read as Ansible's `ini` inventory
plugin reads it and turned into the same shape as an Ansible YAML inventory, which `mnft.hosts.ansible` then
translates: same variables, same precedence, same errors and limits.

What is read, as Ansible reads it:

* `[group]` sections of host lines: `name-or-range [key=value …]` (split like a shell line, so values may be
  quoted; `#` starts a comment); hosts before the first section are in `ungrouped`;
* `[group:vars]`: one `key=value` a line, everything after the first `=` the value (a trailing comment is kept
  as part of a value that is not a Python literal, as Ansible does);
* `[group:children]`: one group a line; a child or a `:vars` section of a group that is never declared
  (`[name]` or `[name:children]`) is an error, as in Ansible;
* lines starting with `#` or `;` are comments;
* values are Python literals where they parse as one (`ansible_port=2222` is a number, `"'2222'"` text, `True` a
  boolean, `yes` and `true` text, which mnft reads as true), else text; an integer is at most
  NUMBER_CHARS characters;
* `host:port` and ranges `node[01:16]`, `db-[a:f]`, `n[1:9:2]`.

Hosts are in node_rank order by their first appearance in the file (line order), the rule the YAML form follows
(document order). Nothing here touches a host.
"""

from __future__ import annotations

import ast
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.yamlfile import LineMap
from mnft.hosts import ansible
from mnft.hosts.settings import Inventory

# Ansible's own patterns (plugins/inventory/ini.py): a section header, a group name on a :children line
SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:\#.*)?$")
GROUP_NAME = re.compile(r"^([^:\]\s]+)\s*(?:\#.*)?$")
_INTEGER = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+|[0-9][0-9_]*)")


def looks_like_ini(text: str) -> bool:
    """A `[group]` / `[group:vars]` / `[group:children]` header line, or (with no header) a host line setting an
    `ansible_*` or `mnft_*` variable: an INI inventory, not a DeepSpeed hostfile or YAML."""
    saw_ansible_var = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if SECTION.match(line) or (raw[0] == "[" and line.endswith("]") and "," not in line):
            return True  # a header, or one Ansible would refuse as a header (not a YAML flow list)
        words = line.split()
        if len(words) > 1 and ":" not in words[0] and any(re.match(r"(ansible|mnft)_\w*=", w) for w in words[1:]):
            saw_ansible_var = True
    return saw_ansible_var


def parse(text: str, path: Path | None, where: str, python: str | None = None) -> Inventory:
    doc, first_seen = to_document(text, where)
    return ansible.parse(doc, path, where, first_seen=first_seen, fmt="ansible-ini", python=python)


def _body(line: int) -> LineMap:
    body = LineMap()
    body.line, body.key_lines = line, {}
    for key in ansible.GROUP_KEYS:
        part = LineMap()
        part.line, part.key_lines = line, {}
        body[key] = part
        body.key_lines[key] = line
    return body


def to_document(text: str, where: str) -> tuple[LineMap, dict[str, int]]:
    """The INI text as an Ansible YAML document ({'all': {'hosts', 'vars', 'children'}, other top-level groups}),
    each mapping a LineMap with the lines its keys came from, and each host's first line."""
    groups: dict[str, LineMap] = {"all": _body(0), "ungrouped": _body(0)}
    declared = {"all", "ungrouped"}  # [name] or [name:children] seen (Ansible: a group exists)
    vars_only: dict[str, int] = {}  # [name:vars] of a group not (yet) declared -> its line
    wanted_children: dict[str, tuple[int, str]] = {}  # child named but not (yet) declared -> (line, parent)
    has_parent: set[str] = set()
    first_seen: dict[str, int] = {}
    expanded = 0
    group, state = "ungrouped", "hosts"

    def group_body(name: str, number: int) -> LineMap:
        if name not in groups:
            groups[name] = _body(number)
        return groups[name]

    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        at = f"{where}:{number}"
        header = SECTION.match(line)
        if header:
            group, state = header.group(1), header.group(2) or "hosts"
            if state not in ("hosts", "children", "vars"):
                raise InputError(f"{at}: section [{group}:{state}] has unknown type {state!r} (use [{group}], "
                                 f"[{group}:vars] or [{group}:children])")
            group_body(group, number)
            if state == "vars":
                if group not in declared:
                    vars_only.setdefault(group, number)
            else:
                declared.add(group)
                vars_only.pop(group, None)
                wanted_children.pop(group, None)
            continue
        if line.startswith("[") and line.endswith("]"):
            raise InputError(f"{at}: invalid section header {limits.shown(line)}: write [group], [group:vars] or "
                             "[group:children], with no spaces")
        body = groups[group]
        if state == "hosts":
            pattern, variables = _host_line(line, at)
            hosts = body["hosts"]
            if pattern in hosts:
                hosts[pattern].update(variables)
                hosts[pattern].key_lines.update(variables.key_lines)
            else:
                hosts[pattern] = variables
                hosts.key_lines[pattern] = number
            bare = ansible._split_host_port(pattern)[0]
            try:
                names = ansible.expand_host_pattern(bare)
            except ValueError as exc:
                raise InputError(f"{at}: host {limits.shown(pattern)}: {exc}") from None
            expanded += len(names)
            if expanded > limits.GROUP_VISITS:
                raise InputError(f"{at}: more than {limits.GROUP_VISITS} host entries once ranges are expanded "
                                 "(a limit of mnft's input, see docs/security.md)")
            for name in names:
                first_seen.setdefault(name, number)
            if len(first_seen) > limits.HOSTS:
                raise InputError(f"{at}: more than {limits.HOSTS} hosts (a limit of mnft's input, see docs/security.md)")
        elif state == "vars":
            key, sep, value = line.partition("=")
            key = key.strip()
            if not sep or not key:
                raise InputError(f"{at}: [{group}:vars]: expected key=value, got {limits.shown(line)}")
            gvars = body["vars"]
            gvars[key] = _value(value.strip(), at, key)
            gvars.key_lines[key] = number
        else:
            child = GROUP_NAME.match(line)
            if not child:
                raise InputError(f"{at}: [{group}:children]: expected a group name, got {limits.shown(line)}")
            name = child.group(1)
            if name == group:
                raise InputError(f"{at}: group {name!r} contains itself")
            children = body["children"]
            if name not in children:
                children[name] = group_body(name, number)
                children.key_lines[name] = number
            has_parent.add(name)
            if name not in declared:
                wanted_children.setdefault(name, (number, group))

    for name, number in vars_only.items():
        raise InputError(f"{where}:{number}: section [{name}:vars] is for a group that is never declared "
                         f"(add a [{name}] or [{name}:children] section, as Ansible requires)")
    for name, (number, parent) in wanted_children.items():
        raise InputError(f"{where}:{number}: [{parent}:children] names group {name!r}, which is never declared "
                         f"(add a [{name}] section listing its hosts, as Ansible requires)")
    _refuse_cycles(groups, where)
    doc = LineMap()
    doc.line, doc.key_lines = 1, {}
    doc["all"] = groups["all"]
    doc.key_lines["all"] = 1
    for name, body in groups.items():  # Ansible makes every group without a parent a child of 'all'
        if name != "all" and name not in has_parent:
            doc[name] = body
            doc.key_lines[name] = body.line
    return doc, first_seen


def _refuse_cycles(groups: dict[str, LineMap], where: str) -> None:
    """A group that is its own descendant ([a:children] b, [b:children] a) is refused, as Ansible does: depth
    first over the children, iteratively (a chain of thousands of groups is no recursion)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in groups:
        if state.get(root):
            continue
        stack = [(root, iter(groups[root]["children"]))]
        state[root] = 1
        while stack:
            name, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[name] = 2
                stack.pop()
            elif state.get(child) == 1:
                line = groups[name]["children"].key_lines.get(child, 0)
                raise InputError(f"{where}:{line}: group {child!r} as a child of {name!r} makes a loop: "
                                 f"{' > '.join([n for n, _ in stack] + [child])}")
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(groups[child]["children"])))


def _host_line(line: str, at: str) -> tuple[str, LineMap]:
    """`name [key=value …]`, split as a shell line with comments (Ansible's shlex_split), values parsed."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise InputError(f"{at}: cannot split the host line ({exc}): {limits.shown(line)}") from None
    if not words:
        raise InputError(f"{at}: expected a host name, got {limits.shown(line)}")
    pattern = words[0]
    if pattern.endswith(":"):
        raise InputError(f"{at}: host {limits.shown(pattern)}: a host pattern does not end in ':' (write host:port)")
    variables = LineMap()
    variables.line, variables.key_lines = int(at.rsplit(":", 1)[1]), {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise InputError(f"{at}: host {limits.shown(pattern)}: expected key=value after the host name, got "
                             f"{limits.shown(word)}")
        variables[key] = _value(value, at, key)
        variables.key_lines[key] = variables.line
    return pattern, variables


def _value(text: str, at: str, key: str) -> Any:
    """A value as Ansible's INI plugin makes it: a Python literal where the text is one, else the text."""
    if _INTEGER.fullmatch(text.strip()):
        limits.integer_text(text.strip(), f"{at}: key {key!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return _coerce(value, at, key)


def _coerce(value: Any, at: str, key: str) -> Any:
    """As Ansible: tuples and sets become lists, complex numbers and `...` text, bytes text; integers bounded."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_coerce(v, at, key) for v in value]
    if isinstance(value, dict):
        return {k: _coerce(v, at, key) for k, v in value.items()}
    if value is ...:
        return "..."
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{at}: key {key!r}: a bytes value that is not UTF-8") from None
    limits.integer(value, f"{at}: key {key!r}")
    return value
