"""`invoke train` and a run's life afterwards: launch, supervise, recover, status, stop, logs.

    job          what torchrun starts on every host, how it resumes, where its metrics come from (data)
    launch       one torchrun command per host (pure: inventory, job and facts in, commands out)
    torchrunargs torchrun's options as its argparse reads them: which a job may not set, however written
    (the host side of a run, started under a keeper, its events, stop, status, logs, sessions, and the launch
    wrapper every rank runs its entry point through: the host package's agent and its modules, entry)
    needs        what a job needs on every host, read from its source: its entry point and the modules it imports
    gang         every host's agent started in parallel and supervised as one gang
    train        the launch sequence: check, sync, resume point, plan, gang, recovery, finish
    guard        what one train holds and leaves right: its devices and workdir leased (or waited for), an interrupt recorded
    progress     the live progress lines a person reads while a run goes
    rerun        a previous run's settings reused (`--resume`, `logs`/`status` of an old run)
    recover      why an attempt failed and what to do next (pure rules)
    diagnose     why a run ended badly, for a person: one cause line and one fix line (pure)
    straggler    which host holds the gang back (pure rules over the agents' samples)
    checkpoints  the latest complete checkpoint, made whole on every host before a resume
    scrape       training metrics from what a job writes (pure parsers)
    timeline     a run's metrics as one timeline across attempts: steps derived where the format prints none (pure)
    goodput      where a run's wall time went, per attempt, and its goodput (pure)
    records      runs/<id>/run.json: the local record of a run
    control      a started run afterwards: status and stop on every host
    others       another user's run, seen from its leases: status shown, stop only by its holder or root
    logs         `invoke logs`: every host's logs and metrics collected, summary and loss plot
    report       the status, stop and time tables
    session      `mnft shell`: an interactive session on leased GPUs, its keeper and dead-man on the host
    notify       `--notify CMD` run here when a waited run starts and when a run ends; `mnft wait RUN`
    supervisor   `train --detach`: the run handed to its supervisor on the lab; afterwards refreshed, attached, stopped
    supervised   the supervisor process on the lab: this package's train, run there for as long as its run lasts
    superops     one op of the supervisor's host side run on a host: its answer, or a one-line error
    bundle       what the supervisor runs there: mnft and the controller's libraries as one tar.gz, and who can run it
    sweepspec    what a sweep asks (--sweep, a job file's sweep:, --max-parallel, --after), judged (pure)
    sweep        a sweep's points, each point's job, where the next points start, its table rows (pure)
    sweeper      a sweep's supervisor on the lab: its queue, each point a train of its own, stop, the end told once
    sweepreport  `status SWEEP`: the table of every point, the best one marked
    after        `--after RUN[:any]`: waited for before a run takes its place in line; a RUN not succeeding ends it
"""
