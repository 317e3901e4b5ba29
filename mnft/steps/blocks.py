"""Pure text edits for files other people also edit: marked blocks and marked lines.

Everything mnft did not write is kept byte for byte and in place; only mnft's own lines move or change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


def split_lines(text: str) -> list[str]:
    """Lines with their endings kept, so joining gives the text back exactly."""
    return text.splitlines(keepends=True)


def _terminated(lines: list[str]) -> list[str]:
    """The last line gets a newline if it lacks one (its content is unchanged), so lines can follow it."""
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1] + [lines[-1] + "\n"]
    return lines


@dataclass(frozen=True)
class Block:
    begin: str  # the whole marker line, without newline
    end: str

    def render(self, body: Sequence[str]) -> list[str]:
        return [self.begin + "\n", *(line + "\n" for line in body), self.end + "\n"]

    def find(self, lines: list[str]) -> tuple[int, int] | None:
        """(first, last) line indexes of the block, or None. A begin without an end is an error (ValueError)."""
        begin = next((i for i, line in enumerate(lines) if line.rstrip("\r\n") == self.begin), None)
        if begin is None:
            return None
        end = next((i for i in range(begin + 1, len(lines)) if lines[i].rstrip("\r\n") == self.end), None)
        if end is None:
            raise ValueError(f"found {self.begin!r} but no {self.end!r} after it: fix the file by hand")
        return begin, end

    def body(self, text: str) -> list[str] | None:
        lines = split_lines(text)
        span = self.find(lines)
        if span is None:
            return None
        return [line.rstrip("\r\n") for line in lines[span[0] + 1 : span[1]]]


def set_block(text: str, block: Block, body: Sequence[str], insert_before: Callable[[str], bool] | None = None) -> str:
    """The text with the block holding exactly `body`: replaced where it is, else inserted before the first line
    for which `insert_before(line)` is true, else appended at the end."""
    lines = split_lines(text)
    span = block.find(lines)
    rendered = block.render(body)
    if span is not None:
        return "".join(lines[: span[0]] + rendered + lines[span[1] + 1 :])
    if insert_before is not None:
        for i, line in enumerate(lines):
            if insert_before(line):
                return "".join(lines[:i] + rendered + lines[i:])
    return "".join(_terminated(lines) + rendered)


def remove_block(text: str, block: Block) -> str:
    lines = split_lines(text)
    span = block.find(lines)
    if span is None:
        return text
    return "".join(lines[: span[0]] + lines[span[1] + 1 :])


# ---------------------------------------------------------------------------------------------- marked lines


MARK = "mnft:"


def line_role(line: str) -> str | None:
    """The role of an mnft line (its last word is `mnft:<role>`), or None for a line someone else wrote."""
    words = line.split()
    if not words or line.lstrip().startswith("#"):
        return None
    last = words[-1]
    return last[len(MARK):] if last.startswith(MARK) and len(last) > len(MARK) else None


def set_marked_lines(text: str, wanted: Mapping[str, str], owns: Callable[[str], bool]) -> str:
    """Make mnft's marked lines whose role `owns` match `wanted` (role -> whole line without newline).

    A line already right stays; a wrong one is replaced in place; owned roles not wanted are removed; new roles
    are appended at the end in `wanted`'s order. Lines of other roles and unmarked lines are never touched.
    """
    lines = split_lines(text)
    out: list[str] = []
    seen: set[str] = set()
    for line in lines:
        role = line_role(line)
        if role is None or not owns(role):
            out.append(line)
            continue
        if role in wanted and role not in seen:
            seen.add(role)
            ending = line[len(line.rstrip("\r\n")):] or "\n"
            out.append(wanted[role] + ending)
        # else: an owned role no longer wanted (or a duplicate): dropped
    missing = [role for role in wanted if role not in seen]
    if missing:
        out = _terminated(out) + [wanted[role] + "\n" for role in missing]
    return "".join(out)


def rewrite_or_remove(path: str, new_text: str, expect: str | None) -> dict:
    """The op that leaves `new_text` at path; an empty result removes the file (it held only mnft's lines)."""
    if new_text == "":
        return {"op": "remove", "path": path, "expect_sha256": expect}
    return {"op": "write", "path": path, "text": new_text, "expect_sha256": expect}


def key_blob(line: str) -> str | None:
    """The base64 key of an authorized_keys / .pub line (options and comment ignored), or None."""
    words = line.strip().split()
    for i, word in enumerate(words):
        if (word.startswith("ssh-") or word.startswith("ecdsa-") or word.startswith("sk-")) and i + 1 < len(words):
            return words[i + 1]
    return None
