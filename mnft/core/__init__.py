"""What every capability of mnft stands on, and nothing else: the expected errors and their exit codes
(`errors`), strict input files with line numbers (`yamlfile`), the limits every input is read within (`limits`:
file size, line length, YAML nesting and aliases, integer length, hosts), and what a person reads on the terminal
(`output`: the console, plain cells that are never rich markup, sizes, losses, JSON), and what SIGINT and SIGTERM
do (`interrupts`: end every child mnft started here, then unwind; exit 130 or 143), and a tar from elsewhere
unpacked into one folder on every Python mnft runs on (`archive`), and a duration as a person writes it
(`durations`: `30s`, `90m`, `2h`, `7d`).

Imports nothing from mnft.
"""
