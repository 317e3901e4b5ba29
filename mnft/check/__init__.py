"""`invoke check`: prove every host can join one training job.

    probe       the host side: a host's facts, or a network test, in one round-trip (stdlib only)
    findings    what a check produces: options, problems with their fix, the report
    gather      read: probes on every host in parallel, the rendezvous port tested from every host
    rules       pure: facts in, problems out (versions, drivers, disk, clocks, code, environment)
    report      the check table and the problems, or --json
"""
