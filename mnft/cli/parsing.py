"""Invoke glue for mnft's tasks: the verbatim words after `--`, and an optional positional argument
(`invoke logs [RUN]`).

Invoke hands a task the words after `--` only as one space-joined string (`core.remainder`), which loses the
boundaries between arguments. `remainder()` gives the list itself: from mnft's Program when it parsed the
command line (`set_argv`), else from sys.argv, which Invoke's own Program parses when run as `invoke`.

Invoke's parser treats every positional argument as required (pyinvoke/invoke#159, open since 2014): while
parsing, a positional without a value *eats* the next token; when the task's context is completed, a positional
without a value is an error. mnft's `logs`, `status` and `stop` take an optional RUN (default: the latest run), so
their RUN keeps eating a token but is not reported missing when none came, nor eats a word starting with '-'
(`mnft logs --help` is the task's help, never a run id '--help'; no run id or host name starts with '-'). Use as
`@task(klass=OptionalPositionalTask, positional=["run"])`: the positionals are the optional ones.

Invoke gives each flag a short one, the first character of its name not yet taken, a '-' too: train's
`--idle-stop` (i, d, l, e taken) got `--`, listed as `--=STRING` and never usable (`--` ends the flags). Every
mnft task is a `LetterFlagsTask`: its short flags are letters and digits only.
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


# invoke.parser.ParseMachine's methods that ask for the missing positionals: at the end of a task's words, and
# for one word (its local `token`), before it is taken as a flag of the core (--help) or the next task
_COMPLETING = "complete_context"
_HANDLING = "handle"


class _OptionalPositional(Argument):
    @property
    def value(self):
        value = Argument.value.fget(self)
        if value is None and _not_wanted():
            return ""  # "given" as far as the parser's question goes; the task itself still receives its default
        return value

    @value.setter
    def value(self, arg) -> None:
        self.set_value(arg, cast=True)


def _not_wanted(depth: int = 6) -> bool:
    """Whether the parser asking is completing the task's words, or handling a word that starts with '-'."""
    frame = sys._getframe(2)
    for _ in range(depth):  # value <- (list comprehension, before 3.12) <- missing_positional_args <- caller
        if frame is None:
            return False
        if frame.f_code.co_name == _COMPLETING:
            return True
        if frame.f_code.co_name == _HANDLING:
            return str(frame.f_locals.get("token", "")).startswith("-")
        frame = frame.f_back
    return False


class LetterFlagsTask(Task):
    """A task whose automatic short flags are letters or digits, never '-' (a name's character, as invoke picks)."""

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict:
        opts = super().arg_opts(name, default, taken_names)
        opts["names"] = [n for n in opts["names"] if len(n) > 1 or n.isalnum()]
        return opts


class OptionalPositionalTask(LetterFlagsTask):
    """A task whose positional arguments may be left out; the task then receives their defaults."""

    def get_arguments(self, ignore_unknown_help: bool | None = None) -> list[Argument]:
        args = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        for arg in args:
            if arg.positional:
                arg.__class__ = _OptionalPositional
        return args
