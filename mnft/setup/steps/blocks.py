"""Pure text edits for files other people also edit: marked blocks and marked lines.

Everything mnft did not write is kept byte for byte and in place; only mnft's own lines move or change.

When mnft appends after a last line that has no final newline, it must add that newline; it then also writes
the `EOL_ADDED` comment line right after it, and removing mnft's last lines later takes the newline away again,
so an undo gives back the original bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


def split_lines(text: str) -> list[str]:
    """Lines with their endings kept, so joining gives the text back exactly."""
    return text.splitlines(keepends=True)


EOL_ADDED = "# mnft: the line above had no final newline; mnft added one (invoke setup --undo takes it away)"


def _is_eol_flag(line: str) -> bool:
    return line.rstrip("\r\n") == EOL_ADDED


def _terminated(lines: list[str]) -> list[str]:
    """The last line gets a newline if it lacks one (its content is unchanged) and the flag line follows it,
    so lines can follow and an undo can take the newline away again."""
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1] + [lines[-1] + "\n", EOL_ADDED + "\n"]
    return lines


def _drop_eol_flag(lines: list[str], at: int) -> list[str]:
    """Remove the flag line at `at`; when nothing follows it, also the newline mnft added to the line before."""
    out = lines[:at] + lines[at + 1 :]
    if at == len(lines) - 1 and at > 0 and out[at - 1].endswith("\n"):
        out[at - 1] = out[at - 1][:-1]
    return out


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
    """The text without the block; a newline mnft added before it (flag line) goes too when nothing follows."""
    lines = split_lines(text)
    span = block.find(lines)
    if span is None:
        return text
    out = lines[: span[0]] + lines[span[1] + 1 :]
    flag = span[0] - 1
    if flag >= 0 and _is_eol_flag(lines[flag]):
        out = _drop_eol_flag(out, flag)
    return "".join(out)


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
    flag: int | None = None  # where the EOL_ADDED line was (index in out)
    for line in lines:
        if flag is None and _is_eol_flag(line):
            flag = len(out)
            continue
        role = line_role(line)
        if role is None or not owns(role):
            out.append(line)
            continue
        if role in wanted and role not in seen:
            seen.add(role)
            ending = line[len(line.rstrip("\r\n")):] or "\n"
            out.append(wanted[role] + ending)
        # else: an owned role no longer wanted (or a duplicate): dropped
    if flag is not None:
        if any(line_role(line) is not None for line in out[flag:]):
            out.insert(flag, EOL_ADDED + "\n")  # mnft's lines still follow: the flag stays where it was
        else:
            out = _drop_eol_flag(out[:flag] + [EOL_ADDED + "\n"] + out[flag:], flag)
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
