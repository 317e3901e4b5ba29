"""mnft run agent: the host side of a training run. Standard library only; shipped to hosts with mnft.hosts.pyrun.

    launch                 read a JSON spec line from stdin, start the run under a keeper, then (attached) stream
                           events as JSON lines and obey the controller: "hb" lines keep it alive, "stop" or EOF
                           or no heartbeat for `deadman` seconds tears the run's process group down
    keep RUN_DIR           (internal) session leader of the run: runs the command, records its exit code
    stop RUN_DIR [GRACE]   kill that run's process group (recorded pgid, its leader verified: see below), then any
                           process still carrying the run id; print what was killed and what remains ("ended":
                           true and nothing killed when nothing of the run is alive); a run still going is marked
                           stopped_by first (its shutdown is then kept from the terminal, its end said `stopped`)
    status RUN_DIR         state, exit code, last metrics line
    tail RUN_DIR [N] [--follow]   the run's output (follow until stdin closes)
    pack RUN_DIR [PATH…] [--checkpoints=DIR]   the run directory and extra paths (files, directories, globs) as
                           a base64 tar.gz, and the names in the job's checkpoints directory (for invoke logs)
    checkpoints DIR        a checkpoints directory's entries and their files (for a resume)
    session-prepare, session RUN_DIR, watch RUN_DIR   an interactive session (`mnft shell`): its run directory, its
                           keeper on the controller's terminal, its dead-man

This module is the entry: it dispatches each mode to the module that does it. launch: mnft.onhost.launcher (the
run's samples: mnft.onhost.samples; files followed: mnft.onhost.follow); keep: mnft.onhost.keeper (its leases:
mnft.onhost.runleases; its GPUs watched: mnft.onhost.watches; its container: mnft.onhost.containers); stop:
mnft.onhost.runprocs, which says which processes are provably the run's (see below); status, tail, pack,
checkpoints: mnft.onhost.queries; sessions: mnft.onhost.sessions; a run directory's files: mnft.onhost.runfiles.

Processes are found by the recorded process group and by MNFT_RUN_ID in their environment, never by name, and
only what is provably the run's is signalled (mnft.onhost.runprocs). The keeper also holds the run's leases
(mnft.onhost.leasehost: its devices and workdir, named in the spec's "leases"; else the host's) when they name its
run, so they stay the run's to its end (mnft.onhost.runleases).
"""

import json
import os
import sys

from .keeper import keep
from .launcher import launch
from .queries import CHECKPOINTS_OPTION, list_checkpoints, pack, status, tail
from .runfiles import STOPPED_BY, _once, _path, mark_stop
from .runprocs import terminate
from .sessions import session, session_prepare, watch


def main(argv):
    if not argv:
        sys.stderr.write(__doc__)
        return 2
    mode, args = argv[0], argv[1:]
    if mode == "launch":
        return launch()
    if mode == "keep":
        return keep(args[0])
    if mode == "session-prepare":
        return session_prepare()
    if mode == "session":
        return session(_path(args[0]))
    if mode == "watch":
        return watch(_path(args[0]))
    if mode == "stop":
        run_dir = _path(args[0])
        if len(args) > 2 and args[2] == "session":  # `mnft stop` of a session: its end is this, whichever signal lands first
            _once(os.path.join(run_dir, "reason"), "stopped by mnft stop")
        marked = mark_stop(run_dir)  # before any signal: what the run prints from now on is its shutdown
        result = terminate(run_dir, float(args[1]) if len(args) > 1 else 10.0)
        if marked and result.get("ended"):  # nothing of it was alive: it had ended by itself, not by this stop
            os.unlink(os.path.join(run_dir, STOPPED_BY))
        print(json.dumps(result))
        return 0
    if mode == "status":
        print(json.dumps(status(_path(args[0]))))
        return 0
    if mode == "checkpoints":
        print(json.dumps(list_checkpoints(args[0])))
        return 0
    if mode == "pack":
        named = [a for a in args[1:] if a.startswith(CHECKPOINTS_OPTION)]
        return pack(_path(args[0]), [a for a in args[1:] if not a.startswith(CHECKPOINTS_OPTION)],
                    named[-1][len(CHECKPOINTS_OPTION):] if named else None)
    if mode == "tail":
        follow = "--follow" in args
        rest = [a for a in args if a != "--follow"]
        return tail(_path(rest[0]), int(rest[1]) if len(rest) > 1 else 0, follow)
    sys.stderr.write("unknown mode %r\n" % mode)
    return 2
