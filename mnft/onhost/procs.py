"""Whose a process is: its run (MNFT_RUN_ID where its environment is readable) or its descent from a lease's lockers,
judged alike by the lease script (mnft lab's collisions) and a run's keeper (its collision watch), and by the
controller in its tests. Standard library only.
"""

import pwd

RUN_ID_VAR = "MNFT_RUN_ID"  # as the agent sets it on every process of a run (an attempt's is <run id>-a<k>)


def user_name(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "uid %d" % uid


MAX_ANCESTORS = 64


def process_facts(pid):
    """What tells whose a process is: its MNFT_RUN_ID ("run", "" when it has none) where its environment is
    readable ("readable": its own user's, or root's look), and its ancestors' pids (/proc/<pid>/stat, readable by
    every user)."""
    facts = {"pid": pid, "readable": False, "run": None, "ancestors": []}
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            entries = fh.read().split(b"\0")
        key = (RUN_ID_VAR + "=").encode()
        facts["readable"] = True
        facts["run"] = next((e[len(key):].decode("utf-8", "replace") for e in entries if e.startswith(key)), "")
    except OSError:
        pass
    current = pid
    for _ in range(MAX_ANCESTORS):
        try:
            with open("/proc/%d/stat" % current) as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        if parent <= 1:
            break
        facts["ancestors"].append(parent)
        current = parent
    return facts


def foreign(facts, run_id, keepers, in_image=False):
    """Whether a compute process on a held GPU is not of the holder's run: True (a collision), False (the run's),
    None (cannot be told). Its environment, where readable, decides: the run's tag (MNFT_RUN_ID, any attempt of it)
    or not. Else its descent: a process below one of the lease's lockers (the run's keeper, the controller's
    hold) is the run's. A process neither readable nor below them is another's, except beside a run in a container
    image, whose processes a container engine starts outside the keeper's tree: then it cannot be told."""
    if facts.get("readable") and run_id:
        tag = facts.get("run") or ""
        ours = tag == run_id or tag.startswith(run_id + "-a") and tag[len(run_id) + 2:].isdigit()
        return not ours
    if set(facts.get("ancestors") or []) & set(keepers) or facts.get("pid") in set(keepers):
        return False
    return None if in_image else True
