"""The same files on every host, proven by hash.

    source      the local tree: which directory, which files (git's ignores, configured excludes), its hash
    gitignore   git's ignore files as filter rules with git's meaning
    treehash    a tree's identity (paths, sizes, sha256); host side too (stdlib only, shipped through pyrun)
    targets     where a --delete mirror may go, judged before anything is touched
    rsync       rsync's argv with verified host keys, its run with progress, what its exit means
    mirror      `invoke sync`: read each host's copy, plan, rsync, verify
    relay       one directory to many hosts, relayed host to host so the controller uploads it about once
    report      the sync table
"""
