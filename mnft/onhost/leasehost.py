"""mnft host lease, the host side: one operation per host at a time, whoever logs in. Standard library only,
Python 3.8 syntax; shipped to hosts with mnft.hosts.pyrun (mnft.hosts.leases is the controller's side).

    hold    read the holder (one JSON line) from stdin; take the lease, or say who holds it; then keep it until
            stdin closes (the controller released it, or its SSH channel is gone) or no line came for the
            holder's "deadman" seconds (a controller that vanished without closing its connection). While it
            holds the lease it also runs the operation's own host scripts: `run N` and N bytes of JSON
            (payload, argv, stdin) on stdin runs that payload's entry (mnft.hosts.pyrun.run_request) in a forked child (no new SSH
            session, no new interpreter) and answers one line, {"ran": exit status, "out": its stdout}.
            A holder with a "scope" ({"gpus": G or null for all, "workdir": path}) takes devices and a workdir
            instead of the host (see "devices" below); with "wait" it waits in the host's line for them, a
            {"waiting": …} line each time its place or what holds the devices changes, until they are taken
    show    who holds the host's lease now, if anyone
    lab     the host for `mnft lab`: its lease, every device and who holds or uses it, workdirs held, the line
    rundirs RUN   the run directories of the keepers that hold RUN's leases (root's stop of another user's run)

The lease is machine-wide: one file for every login user of the host, mnft-lease.json in the lease directory:
$MNFT_LEASE_DIR if set (an absolute path, the same for every user: tests, or a lab that wants it elsewhere),
else /run/lock when it is a sticky, world-writable directory of root's (Debian, Ubuntu: a tmpfs, never aged),
else /tmp (Fedora, RHEL, whose /run/lock is root's alone). What it holds names the last holder: its operation
id, command (train, sync, provision, setup), run id, the controller's host, user and pid, when it started, and
the login user on this host (login, uid) that took it. It is *held* while a process holds a flock on it: the
`hold` process the controller started (it lives as long as the controller's channel), and a run's keeper
(mnft.onhost.agent opens it for the keeper, so a detached run holds its host to its end). A lease nobody holds a
flock on, and whose run (if any) has no process left carrying its run id, is free: its holder is gone, and it is
taken over (the reply says from whom, unless that holder released it). The run's processes are seen only when
this user may read their environment (its own, or every one as root): between two login users the flock is
what tells, and a keeper holds it to its run's end.

Taking is one critical section under mnft-lease.lock (flock): an exclusive flock on the lease is tried without
waiting (granted: nobody holds it), the new holder is written and a shared flock kept. Releasing, under the lock
too, marks the lease released only if nobody else holds it (a detached run's keeper may).

Both files live where any user may plant anything, and root writes there, so a file is used only as mnft makes
it: an existing one is opened without O_CREAT (fs.protected_regular refuses that for another user's file in a
sticky directory) and never through a link (O_NOFOLLOW); a new one is created with O_EXCL and given its mode
past the umask (lease 0666: every user writes the holder it takes it as; lock 0644: a flock needs only a
read-only descriptor). What is opened must be a regular file with one link (a hard link planted to /etc/shadow
is never truncated), and the lease is written only over a lease (empty or mnft's JSON). Anything else is
refused with one line naming the path, its owner and what to do (`Refused`).
"""

import json
import sys

from .drain import set_drain
from .hold import hold
from .leasefiles import MAX_LEASE_BYTES, Refused, _failure
from .leases import lab, run_dirs, show
from .usageread import usage

# hashlib, shutil and subprocess are imported where a take of devices needs them: a hold of the host's lease alone
# (setup, provision, every sync's tree hash) does not pay their ~15 ms of start-up on every host


def main(argv):
    mode = argv[0] if argv else ""
    if mode == "hold":
        return hold()
    if mode == "rundirs" and len(argv) == 2:
        try:
            print(json.dumps({"run_dirs": run_dirs(argv[1])}))
        except (OSError, Refused) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode in ("drain", "undrain"):
        try:
            request = json.loads(sys.stdin.readline(MAX_LEASE_BYTES) or "{}")
            print(json.dumps(set_drain(dict(request, undrain=mode == "undrain"))))
        except (OSError, Refused, ValueError) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode == "usage" and len(argv) == 2:
        try:
            print(json.dumps(usage(float(argv[1]))))
        except (OSError, ValueError) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    if mode in ("show", "lab"):
        try:
            print(json.dumps(show() if mode == "show" else lab()))
        except (OSError, Refused) as exc:
            print(json.dumps(_failure(exc)))
        return 0
    sys.stderr.write(__doc__)
    return 2
