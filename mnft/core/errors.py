"""Exit codes and the expected errors that map onto them.

Expected errors print as one line and never carry a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # some host failed a check or a command
    BAD_INPUT = 2  # the inventory, playbook or arguments are wrong; nothing was changed remotely
    UNREACHABLE = 4  # some host could not be reached or its host key was rejected
    INTERRUPTED = 130


class MnftError(Exception):
    """An expected failure: printed as one line, mapped to an exit code."""

    exit_code = ExitCode.FAILED


class InputError(MnftError):
    """Bad input (file, host, key): raised before anything touches a host."""

    exit_code = ExitCode.BAD_INPUT
