"""The same files on every host, proven by hash.

    source      the local tree: which directory, which files (git's ignores, configured excludes), its hash
    gitignore   git's ignore files as filter rules with git's meaning
    (a tree's identity, the record of what mnft placed in a directory, a job's directory linked from its snapshot,
    computed alike here and on hosts: the host package's treehash, checkout, sharemarks)
    targets     where a sync may go, judged before anything is touched
    rsync       rsync's argv with verified host keys, its run with progress, what its exit means
    mirror      `invoke sync`: read each host's copy, plan (never removing or replacing what mnft did not place), rsync, verify
    snapshot    a run's code: fixed here when it starts, a read-only snapshot on every host, its job's directory
    relay       one directory to many hosts, relayed host to host so the controller uploads it about once
    report      the sync table
"""
