"""torchrun's command line as its argparse parser reads it: which of a job's torchrun options, and which
environment variables, set something mnft owns (nodes, ranks, rendezvous, restarts, logs, how the entry point is
run), however argparse would accept them: exact, `--opt=value`, or abbreviated (`--nnod` is `--nnodes`).

torchrun (`torch.distributed.run.get_args_parser()`) is an argparse parser with `allow_abbrev`: a long option may
be written as any prefix that matches it, a short one with its value attached (`-t3`), flags combined (`-mt3`),
and every option also read from the environment as `PET_<DEST>` when not given. So an option is recognised here
the way argparse resolves it, from the table of torchrun's options below (torch 2.13; tests/test_job.py holds it
to the installed torch's parser): a word is refused when *any* option it could resolve to is mnft's, so an
abbreviation that a host's Python would call ambiguous (3.11 counts `--nproc` twice: `--nproc-per-node` and
`--nproc_per_node`) is refused too. Options not in the table pass unchanged (a newer torch's own).
"""

from __future__ import annotations

import re
from typing import Sequence

# (option strings, dest, takes a value): torchrun's parser in torch 2.13, in its order
OPTIONS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("-h", "--help"), "help", False),
    (("--nnodes",), "nnodes", True),
    (("--nproc-per-node", "--nproc_per_node"), "nproc_per_node", True),
    (("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", True),
    (("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", True),
    (("--rdzv-id", "--rdzv_id"), "rdzv_id", True),
    (("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", True),
    (("--standalone",), "standalone", False),
    (("--max-restarts", "--max_restarts"), "max_restarts", True),
    (("--monitor-interval", "--monitor_interval"), "monitor_interval", True),
    (("--start-method", "--start_method"), "start_method", True),
    (("--event-log-handler", "--event_log_handler"), "event_log_handler", True),
    (("--role",), "role", True),
    (("-m", "--module"), "module", False),
    (("--no-python", "--no_python"), "no_python", False),
    (("--run-path", "--run_path"), "run_path", False),
    (("--log-dir", "--log_dir"), "log_dir", True),
    (("-r", "--redirects"), "redirects", True),
    (("-t", "--tee"), "tee", True),
    (("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", True),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), "duplicate_stdout_filters", True),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), "duplicate_stderr_filters", True),
    (("--node-rank", "--node_rank"), "node_rank", True),
    (("--master-addr", "--master_addr"), "master_addr", True),
    (("--master-port", "--master_port"), "master_port", True),
    (("--local-addr", "--local_addr"), "local_addr", True),
    (("--logs-specs", "--logs_specs"), "logs_specs", True),
    (("--numa-binding", "--numa_binding"), "numa_binding", True),
    (("--signals-to-handle", "--signals_to_handle"), "signals_to_handle", True),
    (("--shutdown-timeout", "--shutdown_timeout"), "shutdown_timeout", True),
    (("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank", False),
)

# What mnft sets itself, or what would break supervision, logs or ranks (or print help instead of running).
OWNED = frozenset({
    "help", "nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
    "rdzv_id", "rdzv_conf", "standalone", "max_restarts", "tee", "redirects", "log_dir", "logs_specs", "module",
    "no_python", "run_path", "local_ranks_filter",
})
# torch's `env` and `check_env` actions read an option not given from PET_<DEST> (torch.distributed.argparse_util)
OWNED_ENV = frozenset(f"PET_{dest.upper()}" for dest in OWNED if dest != "help")

_BY_STRING = {string: (dest, value) for strings, dest, value in OPTIONS for string in strings}
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's: a value, not an option


def canonical(dest: str) -> str:
    """The option's first long spelling: --nproc-per-node."""
    return next(next(s for s in strings if s.startswith("--")) for strings, d, _ in OPTIONS if d == dest)


def _prefixed(prefix: str) -> list[str]:
    return [string for string in _BY_STRING if string.startswith(prefix)]


def matches(word: str) -> tuple[set[str], bool]:
    """The dests `word` may resolve to as argparse reads an option word, and whether its value is attached
    (`--opt=v`, `-t3`). An empty set: not one of torchrun's options (a newer torch's, or a typo)."""
    if word in _BY_STRING:
        return {_BY_STRING[word][0]}, False
    flag, eq, _ = word.partition("=")
    if eq and flag in _BY_STRING:
        return {_BY_STRING[flag][0]}, True
    found: set[str] = set()
    attached = False
    if word.startswith("--"):  # an abbreviation: every long option the prefix (before any '=') starts
        found = {_BY_STRING[string][0] for string in _prefixed(flag)}
        attached = bool(eq)
    else:  # -t3 (a short option and its value), -mt3 (flags combined), or a prefix of a single-dash option
        short = word[:2]
        if short in _BY_STRING:
            found.add(_BY_STRING[short][0])
            attached = True
            if not _BY_STRING[short][1] and len(word) > 2:  # a flag: the rest are more short options
                for letter in word[2:]:
                    if f"-{letter}" in _BY_STRING:
                        found.add(_BY_STRING[f"-{letter}"][0])
        found |= {_BY_STRING[string][0] for string in _prefixed(word)}
    return found, attached


def refusal(options: Sequence[str]) -> str | None:
    """Why a job's torchrun options cannot be used, or None: one of mnft's options however written, a word that
    torchrun would take as the entry point, or `--`."""
    expects_value = False
    for index, word in enumerate(options):
        if word == "--" or not word.startswith("-") or " " in word or _NEGATIVE_NUMBER.match(word):
            if expects_value and word != "--":
                expects_value = False
                continue
            return f"{word!r} is not an option (torchrun would run it as the entry point, which goes in 'script' or 'module')"
        dests, attached = matches(word)
        mine = sorted(dests & OWNED)
        if mine:
            meant = " or ".join(canonical(d) for d in mine)
            written = word.partition("=")[0] if word.startswith("--") else word
            spelled = {string for string, (dest, _) in _BY_STRING.items() if dest in mine}
            meant, read_as = (written, "") if written in spelled else (meant, f" (torchrun reads {written} as {meant})")
            return f"torchrun option {meant}{read_as} is set by mnft (nodes, ranks, rendezvous, restarts and logs are its job)"
        spellings = _prefixed(word.partition("=")[0]) if word.startswith("--") and word.partition("=")[0] not in _BY_STRING else []
        if len(spellings) > 1:  # Python 3.11's argparse refuses a prefix of two spellings, even of one option
            return f"torchrun option {word.partition('=')[0]} is ambiguous (it could be {', '.join(spellings)}): write it in full"
        known = list(dests)
        # after an option that takes a value and has none attached, the next word is its value; an unknown option
        # may take one (a newer torch's): its next word is let through as a value too
        expects_value = not attached and (not known or any(value for dest, value in _BY_STRING.values() if dest in known))
    return None


def owned_env(name: str) -> bool:
    """An environment variable torchrun reads as one of mnft's options (PET_NNODES, PET_STANDALONE, …)."""
    return name in OWNED_ENV
