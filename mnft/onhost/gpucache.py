"""This user's records of the host's GPUs for this boot, in ~/.cache/mnft (private files, written whole): what does
not change until the next boot (the GPUs and their links: load_static, save_static), kept per boot and nvidia-smi;
save_private writes such a record (the GPUs seen this boot, mnft.onhost.health's, too). Standard library only,
Python 3.8 syntax.
"""

import json
import os

from .leasefiles import MAX_LEASE_BYTES


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return "".join(c for c in fh.read(64) if c.isalnum() or c == "-")
    except OSError:
        return None


def static_path(exe):
    """This user's cache of the GPUs for this boot and this nvidia-smi (a driver installed since is another)."""
    try:
        st = os.stat(exe)
    except OSError:
        return None
    import hashlib

    key = "%s %s %d %d" % (boot_id(), os.path.realpath(exe), st.st_ino, st.st_mtime_ns)
    return os.path.expanduser("~/.cache/mnft/gpus-%s.json" % hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16])


def load_static(exe):
    """This boot's GPUs and links, as this user's cache holds them (None: not cached, or not this boot's)."""
    path = static_path(exe) if boot_id() is not None else None
    if path is None:
        return None
    try:
        with open(path) as fh:
            data = json.loads(fh.read(MAX_LEASE_BYTES))
        devices = [dict((k, d[k]) for k in ("index", "uuid", "name", "memory_total_mib")) for d in data["devices"]]
        links = [(int(a), int(b), int(score)) for a, b, score in data["links"]]
        return {"devices": devices, "links": links} if devices else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_static(exe, devices, links):
    """Keep what does not change until the next boot (best effort: a home that cannot be written keeps nothing)."""
    path = static_path(exe) if boot_id() is not None else None
    if path is None or not devices:
        return
    save_private(path, {"devices": [dict((k, d.get(k)) for k in ("index", "uuid", "name", "memory_total_mib")) for d in devices],
                        "links": [[a, b, score] for (a, b), score in sorted(links.items())]})


def save_private(path, data):
    """A JSON cache of this user's (0600 in a 0700 directory), written whole (another name, then renamed), never
    through a link; best effort: one that cannot be written only costs time."""
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = "%s.%d" % (path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass
