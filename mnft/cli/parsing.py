"""Invoke glue for mnft's tasks: the verbatim words after `--`, and an optional positional argument
(`invoke logs [RUN]`).

Invoke hands a task the words after `--` only as one space-joined string (`core.remainder`), which loses the
boundaries between arguments. `remainder()` gives the list itself: from mnft's Program when it parsed the
command line (`set_argv`), else from sys.argv, which Invoke's own Program parses when run as `invoke`.

Invoke's parser treats every positional argument as required (pyinvoke/invoke#159, open since 2014): while
parsing, a positional without a value *eats* the next token; when the task's context is completed, a positional
without a value is an error. mnft's `logs`, `status` and `stop` take an optional RUN (default: the latest run), so
their RUN keeps eating a token but is not reported missing when none came. Use as
`@task(klass=OptionalPositionalTask, positional=["run"])`: the positionals are the optional ones.
"""


from __future__ import annotations

import sys

from invoke import Task
from invoke.parser import Argument

_ARGV: list[str] | None = None  # the command line mnft's Program parsed


def set_argv(argv: list[str]) -> None:
    """The command line mnft's Program parsed (mnft.cli.main)."""
    global _ARGV
    _ARGV = list(argv)


def remainder() -> list[str]:
    """The words after the first `--` of the command line, exactly as given (Invoke's parser splits there too)."""
    argv = _ARGV if _ARGV is not None else sys.argv
    return list(argv[argv.index("--") + 1:]) if "--" in argv else []


_COMPLETING = "complete_context"  # invoke.parser.ParseMachine's method that reports missing positionals


class _OptionalPositional(Argument):
    @property
    def value(self):
        value = Argument.value.fget(self)
        if value is None and _asked_by_completion():
            return ""  # "given" as far as the completeness check goes; the task itself still receives its default
        return value

    @value.setter
    def value(self, arg) -> None:
        self.set_value(arg, cast=True)


def _asked_by_completion(depth: int = 6) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):  # value <- (list comprehension, before 3.12) <- missing_positional_args <- caller
        if frame is None:
            return False
        if frame.f_code.co_name == _COMPLETING:
            return True
        frame = frame.f_back
    return False


class OptionalPositionalTask(Task):
    """A task whose positional arguments may be left out; the task then receives their defaults."""

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        args = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        for arg in args:
            if arg.positional:
                arg.__class__ = _OptionalPositional
        return args
