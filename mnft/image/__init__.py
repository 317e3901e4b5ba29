"""The lab's container image as a run's environment: the same image, by id, on every host, run as one gang.

    runtime     each runtime's command line (podman, docker, apptainer/singularity), pure: facts in, argv out
"""
