"""The peers of mnft's SSH mesh on this host, as `mnft setup` wrote them into ~/.ssh/config (its mesh block): the
hosts provision and `sync --image` relay from, host to host. Standard library only.
"""

import os

MESH_BEGIN = "# BEGIN mnft mesh"
MESH_END = "# END mnft mesh"
MESH_KEY = "~/.ssh/mnft_mesh_ed25519"
CONFIG_BYTES = 4 << 20  # ~/.ssh/config read at most (setup edits none larger): past it, no mesh is seen


def mesh_peers() -> list:
    """The host names of mnft's mesh block in ~/.ssh/config (empty when `invoke setup` made no mesh here)."""
    if not os.path.exists(os.path.expanduser(MESH_KEY)):
        return []
    try:
        with open(os.path.expanduser("~/.ssh/config"), encoding="utf-8") as f:
            text = f.read(CONFIG_BYTES + 1)
    except (OSError, ValueError):
        return []
    if len(text) > CONFIG_BYTES:  # setup writes no mesh into one this large: the wheels then come from the controller
        return []
    inside, names = False, []
    for line in text.splitlines():
        if line.startswith(MESH_BEGIN):
            inside = True
        elif line.startswith(MESH_END):
            inside = False
        elif inside and line.split()[:1] == ["Host"]:
            names += line.split()[1:]
    return names
