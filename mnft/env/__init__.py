"""`invoke provision`: the same Python environment on every host, from a lock file, offline, verified.

    lockfile    a lock read strictly: every package pinned exactly (requirements.lock or pylock.toml)
    diff        environments compared: a host's distributions against a lock or another host (pure)
    wheelhouse  every locked wheel for every host platform, fetched once on the controller
    (the host side, facts, build, switch, roll back: the host package's envhost and envfacts)
    plan        what each host needs (pure: facts and lock in, a plan out)
    record      the controller's record of provisioned hosts, and the inventory it implies
    provision   read -> plan -> apply: wheels relayed, installed with uv, switched atomically
    report      the provision table and --json
"""
