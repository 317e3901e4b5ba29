"""Drain: an admin's mark that keeps the host, or single GPUs of it, out of service; see the comment below.
Standard library only, Python 3.8 syntax.
"""

import errno
import os
import pwd
import stat
import time

from .leasefiles import Refused, _lock_mutex, _read, _write, lease_dir, refusal
from .procs import user_name
from .rootfiles import root_text

# ------------------------------------------------------------------------------------------------ drain
# An admin marks a host, or single GPUs of it, out of service: mnft-drain.json in the lease directory names who
# (the login that wrote it, as this host knows it), when and why. A drained GPU is never leased; runs holding it
# go on to their end; only undrain clears the mark. Admins: root, or members of the group this host names in a
# file only root can have written (ADMIN_FILES, or mnft-admin-group in the lease directory: root's, not writable
# by group or others), never a controller's inventory. The mark itself is honoured only when root or such an
# admin wrote it (its owner), so a user of the shared lease directory can neither plant nor clear one.

DRAIN_NAME, ADMIN_NAME = "mnft-drain.json", "mnft-admin-group"
ADMIN_FILES = ("/etc/mnft/admin-group",)


def admin_group():
    """(group name, gid, where it is named) of the host's mnft admins, or None when the host names none."""
    import grp

    for path in ADMIN_FILES + (os.path.join(lease_dir(), ADMIN_NAME),):
        text = root_text(path, 4096)
        names = [w.strip() for w in (text or "").splitlines() if w.strip() and not w.strip().startswith("#")]
        if names:
            try:
                return names[0], grp.getgrnam(names[0]).gr_gid, path
            except KeyError:
                continue
    return None


def _in_group(uid, gid):
    import grp

    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def is_admin():
    if os.geteuid() == 0:
        return True
    group = admin_group()
    return bool(group) and (group[1] in os.getgroups() or group[1] == os.getegid())


def _trusted_mark(st):
    """Whether root or an admin wrote the drain file (and nobody else may write it: the admins' group at most)."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_mode & 0o002:
        return False
    group = admin_group()
    if st.st_mode & 0o020 and not (group and st.st_gid == group[1]):
        return False
    return st.st_uid == 0 or bool(group) and _in_group(st.st_uid, group[1])


def drain_marks():
    """({"host": mark or None, "gpus": {"0": mark, …}}, a problem with the file or None). A mark is {"login", "at",
    "reason", "by"}."""
    empty = {"host": None, "gpus": {}}
    path = os.path.join(lease_dir(), DRAIN_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        return empty, (None if exc.errno == errno.ENOENT else "%s: %s" % (path, exc.strerror))
    try:
        st = os.fstat(fd)
        if not _trusted_mark(st):
            return empty, refusal(path, st, "was not written by root or an admin of this host, and is ignored")
        marks = _read(fd) or {}
    finally:
        os.close(fd)
    gpus = marks.get("gpus") if isinstance(marks.get("gpus"), dict) else {}
    return {"host": marks.get("host") if isinstance(marks.get("host"), dict) else None,
            "gpus": dict((str(k), v) for k, v in gpus.items() if isinstance(v, dict))}, None


def drain_of(marks, device):
    """The mark that drains a device (the host's, else its own), or None."""
    if marks.get("host"):
        return dict(marks["host"], scope="host")
    if device.get("index") is None and device.get("uuid"):  # a GPU gone from the bus: only the host's mark is its
        return None
    key = "cpu" if device.get("index") is None else str(device.get("index"))
    mark = (marks.get("gpus") or {}).get(key)
    return dict(mark, scope="gpu") if mark else None


def set_drain(request):
    """Drain or undrain ({"gpus": [indices] or null for the host, "reason", "by", "undrain": bool}) as an admin:
    ({"drained": marks}) or Refused naming who may."""
    if not is_admin():
        group = admin_group()
        who = ("root or a member of group %s (named in %s)" % (group[0], group[2]) if group else
               "root (this host names no admin group: root names one with `mnft setup --admin-group NAME`, in %s)" % ADMIN_FILES[0])
        raise Refused("%s may not %s: only %s may" % (user_name(os.getuid()), "undrain" if request.get("undrain") else "drain", who))
    reason = " ".join(str(request.get("reason") or "").split())[:500]
    if not request.get("undrain") and not reason:
        raise Refused("drain needs --reason TEXT: what is wrong, for whoever finds it drained")
    mutex = _lock_mutex()
    try:
        path = os.path.join(lease_dir(), DRAIN_NAME)
        fd = _open_drain(path)
        try:
            marks = _read(fd) or {}
            marks = {"host": marks.get("host") if isinstance(marks.get("host"), dict) else None,
                     "gpus": marks.get("gpus") if isinstance(marks.get("gpus"), dict) else {}}
            gpus = request.get("gpus")
            mark = {"login": user_name(os.getuid()), "uid": os.getuid(), "at": time.time(), "reason": reason,
                    "by": str(request.get("by") or "")[:200]}
            if request.get("undrain"):
                if gpus is None:
                    marks = {"host": None, "gpus": {}}
                for index in gpus or []:
                    marks["gpus"].pop(str(index), None)
            elif gpus is None:
                marks["host"] = mark
            else:
                for index in gpus:
                    marks["gpus"][str(index)] = mark
            _write(fd, marks)
        finally:
            os.close(fd)
    finally:
        os.close(mutex)
    return {"drained": marks}


def _fit(fd, st, group):
    """The open drain file root's, writable by the admins' group (0664), or by root alone when none is named (0644);
    whether it changed."""
    gid, mode = (group[1], 0o664) if group else (0, 0o644)
    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, mode):
        return False
    os.fchown(fd, 0, gid)
    os.fchmod(fd, mode)
    return True


def fit_drain(was=None):
    """As root, after the host's admins changed (mnft setup --admin-group, or its undo): the drain file, when root or
    an admin of before (`was`, a group name) or of now wrote it, becomes root's, writable by the admins of now (0664)
    or by root alone when none is named (0644). Its marks stay honoured, and a drain file root wrote before any group
    was named is the admins' to write too. Returns whether it was changed."""
    import grp

    group = admin_group()
    gids = [group[1]] if group else []
    if was:
        try:
            gids.append(grp.getgrnam(was).gr_gid)
        except KeyError:  # the group before is gone from the host: its members cannot be told
            pass
    path = os.path.join(lease_dir(), DRAIN_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_mode & 0o002:  # never a file linked elsewhere
            return False
        if st.st_uid != 0 and not any(_in_group(st.st_uid, gid) for gid in gids):
            return False
        return _fit(fd, st, group)
    finally:
        os.close(fd)


def _open_drain(path):
    """The drain file for writing: an existing one only if root or an admin wrote it (root replaces another);
    a new one the admins' group may write."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    group = admin_group()
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        if os.geteuid() != 0:
            raise Refused("%s: %s (remove it as root)" % (path, exc.strerror))
        fd = None
        os.unlink(path)
    if fd is not None:
        st = os.fstat(fd)
        if _trusted_mark(st):
            if os.geteuid() == 0 and group and st.st_uid == 0:  # written before the host named its admins: theirs to write from now on
                _fit(fd, st, group)
            return fd
        os.close(fd)
        if os.geteuid() != 0:
            raise Refused(refusal(path, st, "was not written by root or an admin of this host"))
        os.unlink(path)  # planted: root makes its own
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    if group:
        os.fchown(fd, -1, group[1])
        os.fchmod(fd, 0o664)
    else:
        os.fchmod(fd, 0o644)
    return fd
