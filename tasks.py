"""Invoke's entry for this checkout: `invoke TASK …` here runs the same tasks as the installed `mnft` command.

The tasks themselves live in mnft/cli/tasks.py (installed with the package); run `invoke --list` for them.
"""

from mnft.cli.tasks import ns  # noqa: F401
