"""A run's container on this host (mnft.onhost.agent): its mounts made before the runtime starts, its state for
`status`, its removal by the name mnft gave it once the run (or session) ended. Standard library only.
"""

import os


CONTAINER_TIMEOUT = 60.0  # seconds a runtime's `rm --force` may take (it waits for the container's processes)


def remove_container(spec, grace=None):
    """Remove the run's container on this host by the name mnft gave it (spec "container": its runtime's teardown
    command, mnft.image.runtime.teardown_argv), if it still exists: nothing of a run outlives its end. Returns
    None when the run has no container (or the runtime needs no removal), else whether the runtime succeeded
    or said the container was already gone."""
    import subprocess

    container = spec.get("container") or {}
    argv = list(container.get("teardown") or ())
    if not argv:
        return None
    if grace is not None and "--time" in argv:
        argv[argv.index("--time") + 1] = str(int(grace))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=CONTAINER_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    said = done.stderr[-4096:].decode("utf-8", "replace").lower()
    return done.returncode == 0 or "no such container" in said or "no container with name" in said


def container_state(spec):
    """The run's container on this host, for `status`: its name, image and whether the runtime still has it."""
    import subprocess

    container = spec.get("container") or {}
    if not container:
        return None
    out = {"name": container.get("name"), "image": container.get("image"), "runtime": container.get("runtime")}
    path, kind, name = container.get("path"), container.get("runtime"), container.get("name")
    if kind in ("podman", "docker") and path and name:
        argv = [path, "container", "exists", name] if kind == "podman" else [path, "container", "inspect", "--format", "{{.Id}}", name]
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20)
            out["present"] = done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            out["present"] = None
    return out


def _make_mounts(spec):
    """The run's container mounts its directories at the same paths: each must exist before the runtime starts
    (a data_dir or checkpoints directory the job has not made yet)."""
    for path in (spec.get("container") or {}).get("mounts") or ():
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as exc:
            print("mnft: cannot make %s for the container: %s" % (path, exc), flush=True)
