"""The directories of a host a mirror must never write: the system's, the home (or above it), its secrets, the host's
other mnft directory. The tree hash refuses such a target before any walk (mnft.onhost.treehash), the share marks
are never left inside a system tree (mnft.onhost.sharemarks), and uninstall never removes one
(mnft.onhost.uninstallhost). Python >= 3.8 and the standard library only.
"""

from __future__ import annotations

import os


# Directories a target must never be, or be above (a mirror with --delete would empty them); compared by real
# path, so a workdir that is a symlink to one of them is caught too.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt", "/proc",
               "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/local", "/var", "/var/lib", "/var/tmp", "/Users")
# ... nor lie inside (they never hold a workdir, and a mirror into them would replace system files)
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")
HOME_SECRETS = (".ssh", ".gnupg")


def _inside(path: str, folder: str) -> bool:
    """path is folder or lies below it (real paths)."""
    folder = folder.rstrip("/") or "/"
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def refusal(root: str, home: str, other=None):
    """Why a mirror (rsync --delete) into the real path root must not happen on this host, or None.

    Judged before any walk, so a target that resolves to / or the home is refused at once, not after an hour of
    hashing. home is the real path of the home; other (optional) the real path of the host's other mnft
    directory (the data_dir for a workdir, and the reverse), which must not overlap root.
    """
    if root == "/":
        return "the target resolves to / on this host"
    if root == home:
        return "the target resolves to the home directory %s on this host" % home
    if _inside(home, root):
        return "the target %s contains the home directory %s on this host" % (root, home)
    for name in HOME_SECRETS:
        secret = os.path.join(home, name)
        if _inside(root, os.path.realpath(secret)):
            return "the target %s is inside %s on this host" % (root, secret)
    for folder in SYSTEM_DIRS:
        real = os.path.realpath(folder)
        if _inside(real, root) or _inside(folder, root):
            return "the target %s is (or contains) the system directory %s on this host" % (root, folder)
    for folder in SYSTEM_TREES:
        real = os.path.realpath(folder)
        if _inside(root, real) or _inside(root, folder):
            return "the target %s is inside the system directory %s on this host" % (root, folder)
    if other:
        if _inside(root, other) or _inside(other, root):
            return "the target %s and the other mnft directory %s overlap on this host" % (root, other)
    return None
