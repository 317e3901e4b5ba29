"""The `mnft` console command: an Invoke Program over mnft's task collection (as Fabric's `fab` is over
Fabric's): the same tasks, options, help and exit codes as `invoke TASK` in the mnft checkout, from any directory
(the user's own repository). `mnft --version`; `mnft --print-completion-script bash|zsh|fish` for shell completion.
"""

from __future__ import annotations

from invoke import Config, Exit, ParseError, Program

from mnft import __version__
from mnft.cli import parsing
from mnft.cli.tasks import ns


class MnftConfig(Config):
    """Configuration files named mnft.yaml (/etc/mnft.yaml, ~/.mnft.yaml) and MNFT_* variables for existing keys."""

    prefix = "mnft"


class MnftProgram(Program):
    def normalize_argv(self, argv) -> None:
        super().normalize_argv(argv)
        parsing.set_argv(self.argv)

    def parse_core(self, argv) -> None:
        try:
            super().parse_core(argv)
        except ParseError as exc:
            raise bad_usage(exc) from None

    def parse_tasks(self) -> None:
        """A flag the task does not have (`mnft check --gpus 2`) is bad input: one line, exit 2, before anything runs
        (invoke's own parser says it and exits 1)."""
        try:
            super().parse_tasks()
        except ParseError as exc:
            raise bad_usage(exc) from None


def bad_usage(exc: ParseError) -> Exit:
    """invoke's parse error as mnft's bad input: one line naming the task and where its flags are listed, exit 2."""
    task = getattr(getattr(exc, "context", None), "name", None)
    where = f"`mnft {task} --help`" if task else "`mnft --help`"
    said = str(exc).rstrip(".!") or "cannot parse the command line"
    return Exit(f"mnft{' ' + task if task else ''}: {said} (its flags: {where})", code=2)


def program() -> MnftProgram:
    return MnftProgram(name="mnft", binary="mnft", binary_names=["mnft"], namespace=ns, version=__version__, config_class=MnftConfig)


def main() -> None:
    program().run()
