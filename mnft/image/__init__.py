"""The lab's container image as a run's environment: the same image, by id, on every host, run as one gang.

    runtime     each runtime's command line (podman, docker, apptainer/singularity), pure: facts in, argv out
    (the host side, the runtime found there and the image's id, save, load, place and clean for `sync --image`:
    the host package's imagehost)
    facts       every host's imagehost facts, one round-trip each, in parallel; this machine's own
    distribute  `sync --image`: read every host's facts, plan (pure: the reference, who receives, who refuses),
                save once, relay over the mesh (sync.relay), load and verify by id; staging removed everywhere
    report      sync --image's table, or JSON
"""
