"""The host's line of waiting runs: a ticket file each waiter holds an exclusive flock on (make_ticket; join_line
refuses a user already at the lab's max_waiting), the line as it came (tickets, order), the line in its fair order
(fair_line, fair_key, held_by_user, ahead_of, placed), and what a waiting run is told of its place (waiting_reply). Standard library
only, Python 3.8 syntax.

The fair order. Each ticket has the key (over_limit, held, queued, ticket):

- held: the devices the ticket's user (its uid) holds on this host now; fewest first. 0 for a run over several
  hosts (below).
- over_limit: 1 when the lab's policy sets max_gpus_while_others_wait N (mnft.onhost.labpolicy), the ticket's user
  holds N or more here, and a ticket of another user waits here: that user's runs wait behind the others'.
- queued, ticket: first come, first served (the controller's queue time, the same on every host of a run).

The line is the tickets sorted by that key, but for one thing: the tickets of runs over several hosts (the
holder's `hosts` > 1, or no `hosts`: a ticket from an older controller) keep the order they came in among
themselves. Such a run keeps what it took on some hosts while it waits for the others: if two of them were ordered
one way on one host and the other way on another (by what their users hold there, which differs from host to host),
each could hold a host the other waits for, for ever. Their order among themselves, by queue time and ticket, is
the same on every host, so the line never closes on itself. A run that waits for one host alone (a sweep's points,
a 1-node run) holds nothing while it waits, so ordering it by what its user holds there cannot close a circle. So
the line is two sorted lists merged: the one-host tickets by their key, the several-host tickets as they came, the
smaller key of the two heads first (fair_line). A several-host ticket whose user is over the limit here waits behind
one-host tickets of others, and the several-host tickets that came after it with it.

A waiting run takes its devices only when no ticket is before its own in the line; a run without a ticket (one
that does not wait) has every ticket ahead of it.
"""

import fcntl
import os

from .labpolicy import lab_policy
from .leasefiles import _existing, _lock_mutex, _login, _read, _write, lease_dir

TICKET_PREFIX = "mnft-wait-"


def tickets(skip=None):
    """The line of waiting runs on this host, first come first: [(order, holder)] of every ticket whose waiter
    still holds its flock (a ticket left by a waiter that is gone is no one's place in line). Each holder's "uid" is
    the ticket file's owner (the waiter made it, O_EXCL: whatever its text says)."""
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
            holder = dict(_read(fd) or {}, uid=os.fstat(fd).st_uid)
        finally:
            os.close(fd)
        line.append((order(holder), holder))
    return sorted(line, key=lambda item: item[0])


def order(holder):
    """A waiting run's place: when its controller queued it (the same on every host of the run), then its ticket."""
    queued = holder.get("queued")
    return (queued if isinstance(queued, (int, float)) and not isinstance(queued, bool) else float("inf"), str(holder.get("ticket") or ""))


def _count(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def single_host(holder):
    """Whether a ticket's run waits for this host alone (its controller said `hosts: 1`); a ticket without `hosts`
    (an older controller's) may span several."""
    return _count(holder.get("hosts")) == 1


def held_by_user(states):
    """uid -> the devices its leases hold on this host now (device_states' "held" ones, by the uid a lease names)."""
    held = {}
    for state in states:
        holder = state.get("holder") if state.get("state") == "held" else None
        uid = _count(holder.get("uid")) if isinstance(holder, dict) else None
        if uid is not None:
            held[uid] = held.get(uid, 0) + 1
    return held


def fair_key(holder, held, waiting, limit):
    """A ticket's key in the fair order, (over_limit, held, queued, ticket) (the module's docstring): held is
    held_by_user's, waiting the uids with a ticket in this host's line, limit the policy's max_gpus_while_others_wait
    (None: no limit). held is 0 for a run over several hosts."""
    uid = _count(holder.get("uid"))
    mine = held.get(uid, 0) if uid is not None else 0
    over = 1 if limit and mine >= limit and any(other != uid for other in waiting) else 0
    return (over, mine if single_host(holder) else 0) + order(holder)


def fair_line(line, held, limit):
    """[(key, holder)] of the line's tickets (their holders, each with its "uid") in the fair order: the one-host
    tickets sorted by their key and the several-host ones as they came, merged by the smaller key of the two heads."""
    waiting = set(_count(h.get("uid")) for h in line)
    keyed = [(fair_key(h, held, waiting, limit), h) for h in line]
    one = sorted((k for k in keyed if single_host(k[1])), key=lambda item: item[0])
    several = sorted((k for k in keyed if not single_host(k[1])), key=lambda item: item[0][2:])
    merged = []
    while one and several:
        merged.append(one.pop(0) if one[0][0] < several[0][0] else several.pop(0))
    return merged + one + several


def placed(line, states, policy):
    """The line in its fair order as `mnft lab` is told it: each holder with "fair": {"over_limit", "held" (its key's),
    "holds" (the devices its user holds here)}."""
    held = held_by_user(states)
    return [dict(h, fair={"over_limit": key[0], "held": key[1], "holds": held.get(_count(h.get("uid")), 0)})
            for key, h in fair_line(line, held, policy.get("max_gpus_while_others_wait"))]


def ahead_of(holder, states, policy=None):
    """The tickets before a run that takes devices now in the host's line (states: the host's devices,
    device_states'), in the fair order; every ticket for a run without one (a run that does not wait)."""
    limit = (lab_policy() if policy is None else policy).get("max_gpus_while_others_wait")
    others = [h for _, h in tickets(ticket_name(holder) if holder.get("ticket") else None)]
    held = held_by_user(states)
    if not holder.get("ticket"):
        return [h for _, h in fair_line(others, held, limit)]
    me = dict(holder, uid=os.getuid())
    ranked = [h for _, h in fair_line(others + [me], held, limit)]
    return ranked[:next(i for i, h in enumerate(ranked) if h is me)]


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


def join_line(holder, policy=None):
    """This run's place in the host's line: (fd, path, None) of its ticket, or (None, None, the line-full reply) when
    its user has the lab's max_waiting runs waiting here already: {"busy": True, "what": "line-full", "waiting": n,
    "max_waiting": m, "path": the policy's file}. Counted and made in the critical section, so two runs of one user
    never both slip under the limit."""
    policy = lab_policy() if policy is None else policy
    limit = policy.get("max_waiting")
    mutex = _lock_mutex()
    try:
        if limit:
            uid = os.getuid()
            waiting = sum(1 for _, h in tickets() if h.get("uid") == uid)
            if waiting >= limit:
                return None, None, {"busy": True, "what": "line-full", "waiting": waiting, "max_waiting": limit, "path": policy.get("path")}
        fd, path = make_ticket(holder)
        return fd, path, None
    finally:
        os.close(mutex)


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
