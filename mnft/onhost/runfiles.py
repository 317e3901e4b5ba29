"""A run directory's files, and the small helpers every part of the run agent (mnft.onhost.agent) shares. Standard
library only.

A run directory holds: spec.json (no secrets), pgid, pgid_start, output.log, exit_code, started, ended, agent.payload,
entry.py (the launch wrapper, mnft.onhost.entry), done/rank-<R> for each rank whose entry point returned, and
stopped_by when `mnft stop` ended the run (written before its first signal: what the run prints after it is its
shutdown, and its exit code is the signal's, not a failure). Secrets
arrive in the spec's "secrets", are written to secrets.json (0600) for the keeper, which deletes it after reading.
"""

import json
import os
import sys

from . import boot


TAG_VAR = "MNFT_RUN_TAG"  # run id @ inventory host name: what processes are found (and killed) by
LEASE_FDS_VAR = "MNFT_LEASE_FDS"  # the keeper's inherited lease descriptors (it locks the files anew itself)


def emit(event, **fields):
    fields["event"] = event
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _path(p):
    return os.path.abspath(os.path.expanduser(p))


def done_ranks(run_dir):
    """The ranks whose entry point returned (mnft.onhost.entry writes done/rank-<R> in the run directory)."""
    try:
        names = os.listdir(os.path.join(run_dir, "done"))
    except OSError:
        return []
    return sorted(int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit())


def _expand(value):
    """`~/x` (or `key=~/x`) means the home directory of the user the run belongs to."""
    if value == "~" or value.startswith("~/"):
        return os.path.expanduser(value)
    key, sep, rest = value.partition("=")
    if sep and (rest == "~" or rest.startswith("~/")):
        return key + "=" + os.path.expanduser(rest)
    return value


def _write(path, text, mode=0o600):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


RUN_FILE_BYTES = 64 << 20  # a file of the run directory read at most (spec.json, pgid, exit_code …): past it, as missing


def _read(path, default=None):
    try:
        with open(path) as fh:
            text = fh.read(RUN_FILE_BYTES + 1)
    except (OSError, ValueError):
        return default
    return text.strip() if len(text) <= RUN_FILE_BYTES else default


STOPPED_BY = "stopped_by"  # the run directory's mark that `mnft stop` is ending the run (see the module's doc)


def mark_stop(run_dir, by="mnft stop"):
    """Mark a run that has not ended (no exit code yet) as being stopped by `mnft stop`, before any signal; True when
    this call marked it (its caller takes the mark back if nothing of the run was alive to stop)."""
    if _read(os.path.join(run_dir, "exit_code")) is not None:
        return False
    return _once(os.path.join(run_dir, STOPPED_BY), by)


def stopped_by(run_dir):
    """Who is stopping (or stopped) the run: mark_stop's text, or None."""
    return _read(os.path.join(run_dir, STOPPED_BY))


def _is_glob(path):
    return any(c in path for c in "*?[")


def _once(path, text):
    """Write a file only if it is not there yet (the first reason a session ends is its reason)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
    return True


def _duration(seconds):
    seconds = int(round(seconds))
    if seconds < 60:
        return "%ds" % seconds
    if seconds < 3600:
        return "%dm%s" % (seconds // 60, "%02ds" % (seconds % 60) if seconds % 60 else "")
    return "%dh%02dm" % (seconds // 3600, seconds % 3600 // 60)


PAYLOAD_NAME = "agent.payload"  # in a run directory: the agent's payload, which the keeper (or a session) starts from


def _own_payload(run_dir):
    """This agent's payload, written into the run directory (0600, in the run's own 0700 directory) for the
    processes that outlive this one's channel: the keeper and a session start from it (boot.FILE_BOOTSTRAP), never
    from a file another could write. Written whole under a name of this process's own (created, never reused), then
    renamed into place."""
    own = os.path.join(run_dir, PAYLOAD_NAME)
    data = boot.current()
    tmp = "%s.%d.tmp" % (own, os.getpid())
    try:
        os.unlink(tmp)  # a leftover of a killed agent with this pid: never written through
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, own)
    return own


def _own_argv(own, *args):
    """The command line of a process that runs this agent's payload from its copy `own`: this Python, as this one runs."""
    return [sys.executable] + (["-S"] if sys.flags.no_site else []) + ["-c", boot.FILE_BOOTSTRAP, own] + list(args)
