"""The `mnft` console command: an Invoke Program over mnft's task collection (as Fabric's `fab` is over
Fabric's): the same tasks, options, help and exit codes as `invoke TASK` in the mnft checkout, from any directory
(the user's own repository). `mnft --version`; `mnft --print-completion-script bash|zsh|fish` for shell completion.
"""

from __future__ import annotations

from invoke import Config, Program

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


def program() -> MnftProgram:
    return MnftProgram(name="mnft", binary="mnft", binary_names=["mnft"], namespace=ns, version=__version__, config_class=MnftConfig)


def main() -> None:
    program().run()
