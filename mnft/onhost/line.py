"""The host's line of waiting runs, first come first served: a ticket file each waiter holds an exclusive flock on
(make_ticket), the line in order (tickets, order), and what a waiting run is told of its place (waiting_reply).
Standard library only, Python 3.8 syntax.
"""

import fcntl
import os

from .leasefiles import _existing, _login, _read, _write, lease_dir

TICKET_PREFIX = "mnft-wait-"


def tickets(skip=None):
    """The line of waiting runs on this host, first come first: [(order, holder)] of every ticket whose waiter
    still holds its flock (a ticket left by a waiter that is gone is no one's place in line)."""
    try:
        names = [n for n in os.listdir(lease_dir()) if n.startswith(TICKET_PREFIX) and n.endswith(".json") and n != skip]
    except OSError:
        return []
    line = []
    for name in names:
        fd = _existing(name)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            continue  # nobody waits on it
        except BlockingIOError:
            holder = _read(fd) or {}
        finally:
            os.close(fd)
        line.append((order(holder), holder))
    return sorted(line, key=lambda item: item[0])


def order(holder):
    """A waiting run's place: when its controller queued it (the same on every host of the run), then its ticket."""
    queued = holder.get("queued")
    return (queued if isinstance(queued, (int, float)) and not isinstance(queued, bool) else float("inf"), str(holder.get("ticket") or ""))


def ticket_name(holder):
    ticket = "".join(c for c in str(holder.get("ticket") or "") if c.isalnum())[:32]
    return TICKET_PREFIX + ticket + ".json"


def make_ticket(holder):
    """This run's place in the host's line: a ticket file it holds an exclusive flock on while it waits."""
    path = os.path.join(lease_dir(), ticket_name(holder))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    os.fchmod(fd, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _write(fd, dict(holder, **_login()))
    return fd, path


def _brief(holder):
    holder = holder if isinstance(holder, dict) else {}
    return dict((k, holder.get(k)) for k in ("command", "run_id", "user", "login", "controller", "pid", "started", "taken", "queued", "want"))


def waiting_reply(reply):
    """What a waiting run is told of its place: its position in the host's line, the runs ahead, and what holds the
    devices now (only what changes the picture: a new line is printed when it does)."""
    devices = [dict(index=d.get("index"), state=d.get("state"), holder=_brief(d.get("holder")), processes=d.get("processes") or [])
               for d in reply.get("devices") or [] if d.get("state") != "free"]
    return {"waiting": True, "what": reply.get("what"), "position": len(reply.get("ahead") or []) + 1,
            "ahead": [_brief(h) for h in reply.get("ahead") or []], "devices": devices, "holder": _brief(reply.get("holder")),
            "want": reply.get("want"), "count": reply.get("count")}
