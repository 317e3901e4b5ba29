"""What every capability of mnft stands on, and nothing else: the expected errors and their exit codes
(`errors`), strict input files with line numbers (`yamlfile`), and what a person reads on the terminal
(`output`: the console, plain cells that are never rich markup, sizes, losses, JSON).

Imports nothing from mnft.
"""
