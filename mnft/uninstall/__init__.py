"""`mnft uninstall`: what mnft put on the hosts and on this machine taken off again, what runs wrote kept.

    (the host side, what of mnft's is there and its size, its removal: the host package's uninstallhost)
    plan           what mnft owns (one line each), and per place the items to remove or keep (pure)
    uninstall      read -> plan -> apply, under the whole host's lease; this machine's wheelhouse, snapshots, caches
    report         the table and --json
"""
