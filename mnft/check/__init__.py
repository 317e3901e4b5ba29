"""`invoke check`: prove every host can join one training job.

    (the host side, a host's facts or a network test in one round-trip, or all of them in one session: the host
    package's probe, facts, nettest)
    findings    what a check produces: options, problems with their fix, the report
    gather      read: probes on every host in parallel, the rendezvous port tested from every host
    session     one command per host for all of it: the probe's facts, then the code hash and workdir marks, the
                listener and the connects in the same interpreter (the probe's session mode, controller side)
    inimage     read with an image (--image): the host's facts, the image's and the probe inside the image, one
                command per host; the facts merged so the rules compare what the job sees
    rules       pure: facts in, problems out (versions, drivers, disk, clocks, code, environment)
    report      the check table and the problems, or --json
"""
