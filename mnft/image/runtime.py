"""Each container runtime's command line, pure: a host's runtime facts and what the run needs in, argv out.

One job, the same in every runtime: the container shares the host's network and IPC (torchrun's rendezvous,
NCCL's sockets and shared memory work as on the host), sees exactly the GPUs the run holds, mounts the run's
directories at the same paths (a path in a job's arguments means the same file inside and out), runs as the
user (nothing root-owned left in anyone's home), never pulls (the image is the one `check` verified, by id), and
gets environment variables by name only: their values come from the runtime client's own environment, never
from its command line. Secrets do not even go by name: they would show in `podman inspect`'s Config.Env; they
reach the job through a 0600 file the launch wrapper (mnft.onhost.entry) reads and deletes inside the container.

    podman       run --rm --name N --network host --ipc host --pull never --log-driver none
                 --user UID:GID (rootful) | --userns keep-id (rootless) --security-opt label=disable
                 --device nvidia.com/gpu=I … (CDI) -v P:P … -e NAME … --workdir W IMAGE CMD…
    docker       the same flags, GPUs by CDI where described, else --gpus "device=I,…" (NVIDIA Container Toolkit)
    apptainer    exec --bind P:P … --pwd W [--nv] SIF CMD…   (singularity: the same)

Apptainer needs none of the network/IPC/user flags (a process of the user's, in the host's namespaces, by
default) and has no daemon: its processes are the keeper's children and end with its process group. podman's and
docker's containers are run by conmon / the daemon, outside that group: `teardown_argv` removes the container by
the name mnft gave it, which every teardown path runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from mnft.core.errors import InputError

RUNTIMES = ("podman", "docker", "apptainer", "singularity")
DAEMON_RUNTIMES = ("podman", "docker")  # the container outlives its client's process group: removed by name
SIF_RUNTIMES = ("apptainer", "singularity")  # the image is a file (.sif), its identity the file's sha256
CDI_FIX = "describe the GPUs for containers: sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml (NVIDIA Container Toolkit)"
_UNSAFE_MOUNT = re.compile(r"[:,\s]")  # podman/docker -v and apptainer --bind split on ':' and ','
# an image reference ([registry[:port]/]name[:tag][@sha256:hex]) or a .sif path (absolute, ~/…, or relative)
_REF = re.compile(r"[A-Za-z0-9~/.][A-Za-z0-9._/:@+~-]*")
REF_CHARS = 512


def check_ref(ref: object, where: str) -> str:
    """An image reference or .sif path as given (`image:`, --image): one word that no runtime could take for an
    option; else a one-line error naming where it came from."""
    if not isinstance(ref, str) or not ref:
        raise InputError(f"{where}: an image is a reference like nvcr.io/nvidia/pytorch:24.10-py3 or a .sif path, got {ref!r}")
    if len(ref) > REF_CHARS or not _REF.fullmatch(ref):
        raise InputError(f"{where}: {ref[:80]!r} is not an image reference (letters, digits and ._/:@+-~, not starting "
                         "with '-', at most 512 characters) nor a .sif path")
    return ref


def is_sif(ref: str) -> bool:
    """A file image (apptainer/singularity) rather than a registry-style reference."""
    return ref.endswith(".sif") or ref.startswith(("/", "~/", "./"))


@dataclass(frozen=True)
class Runtime:
    """A host's container runtime, as its probe found it (mnft.onhost.imagehost's facts)."""

    kind: str  # podman | docker | apptainer | singularity
    path: str  # its executable on the host
    uid: int
    gid: int
    home: str  # the user's home directory on the host (~ in the inventory's paths)
    rootless: bool = False  # podman run by a user other than root: --userns keep-id maps the user in
    cdi: bool = False  # nvidia.com/gpu devices are described by CDI (/etc/cdi, /var/run/cdi)
    gpus: bool = False  # the host has NVIDIA GPUs (nvidia-smi answered)
    image_id: str | None = None  # the job's image as the check verified it there ("sha256:…"): what podman/docker run

    @classmethod
    def from_facts(cls, facts: dict) -> "Runtime":
        image = facts.get("image") if isinstance(facts.get("image"), dict) else {}
        return cls(kind=facts["runtime"], path=facts["path"], uid=int(facts["uid"]), gid=int(facts["gid"]), home=facts["home"],
                   rootless=bool(facts.get("rootless")), cdi=bool(facts.get("cdi")), gpus=bool(facts.get("gpus")),
                   image_id=image.get("id") if image.get("present") and isinstance(image.get("id"), str) else None)

    def runs(self, image: str) -> str:
        """What the runtime is given to run: podman/docker the id the check verified (a re-tag of the name between
        the check and the start cannot swap the image under the run), apptainer the .sif path."""
        if self.kind in DAEMON_RUNTIMES and self.image_id and re.fullmatch(r"sha256:[0-9a-f]{64}", self.image_id):
            return self.image_id.split(":", 1)[1]
        return expand(image, self.home)


@dataclass(frozen=True)
class Container:
    """What one host's container of a run is."""

    image: str  # the reference (podman/docker) or the .sif path (apptainer)
    name: str  # mnft-<run id>-<host>: what its teardown removes
    mounts: tuple[str, ...] = ()  # absolute host paths, each mounted at the same path
    devices: tuple[int, ...] | None = None  # the GPUs the run holds there (nvidia-smi's numbers); None: all the host's
    env_names: tuple[str, ...] = ()  # passed by name; the value is the runtime client's own
    workdir: str = "/"
    labels: tuple[tuple[str, str], ...] = ()  # podman/docker labels: the run id and host, for `status` and `lab`


def container_name(run_id: str, host: str) -> str:
    """mnft-<run id>-<host>, in the characters podman and docker accept ([a-zA-Z0-9][a-zA-Z0-9_.-]*)."""
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", f"mnft-{run_id}-{host}")[:200]


def expand(path: str, home: str) -> str:
    """~ and ~/… on a host, as its own user's home."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


def mounts(paths: Sequence[str], home: str) -> tuple[str, ...]:
    """The directories to mount, absolute, without one already inside another (the outer one brings it)."""
    out: list[str] = []
    for path in sorted({expand(p, home).rstrip("/") or "/" for p in paths if p}, key=len):
        if not path.startswith("/"):
            raise InputError(f"container mount {path!r}: a path relative to what? give an absolute path or ~/…")
        if _UNSAFE_MOUNT.search(path):
            raise InputError(f"container mount {path!r}: a path holding ':', ',' or a space cannot be mounted "
                             "by podman, docker or apptainer: move it")
        if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in out):
            out.append(path)
    return tuple(out)


def visible_devices(rt: Runtime, devices: tuple[int, ...] | None) -> str | None:
    """CUDA_VISIBLE_DEVICES inside the container. podman/docker give it only the run's GPUs, numbered from 0 there;
    apptainer's --nv gives it every GPU of the host under the host's numbers, so the variable chooses."""
    if not devices:
        return None
    if rt.kind in SIF_RUNTIMES:
        return ",".join(str(d) for d in devices)
    return ",".join(str(i) for i in range(len(devices)))


def container_env(rt: Runtime, env: dict[str, str], devices: tuple[int, ...] | None) -> dict[str, str]:
    """The environment the runtime client passes into the container by name: `env` with CUDA_VISIBLE_DEVICES as
    the container numbers the GPUs (visible_devices; dropped without GPUs) and CUDA_DEVICE_ORDER only where the
    host's numbering holds inside (apptainer). Pure: a new dict; what train's and shell's containers both get."""
    out = dict(env)
    out.pop("CUDA_DEVICE_ORDER", None)
    visible = visible_devices(rt, devices or None)
    if visible is None:
        out.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        out["CUDA_VISIBLE_DEVICES"] = visible
        if rt.kind in SIF_RUNTIMES:
            out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the host's numbering, as nvidia-smi shows it
    return out


def _gpu_flags(rt: Runtime, devices: tuple[int, ...] | None) -> list[str]:
    if not rt.gpus:
        return []
    if rt.kind in SIF_RUNTIMES:
        return ["--nv"]
    chosen = [str(d) for d in devices] if devices else ["all"]
    if rt.cdi:
        return [flag for d in chosen for flag in ("--device", f"nvidia.com/gpu={d}")]
    if rt.kind == "docker":  # the NVIDIA Container Toolkit's runtime hook
        return ["--gpus", "all" if chosen == ["all"] else '"device=' + ",".join(chosen) + '"']
    raise InputError(f"podman at {rt.path}: the host has NVIDIA GPUs but no CDI description of them; {CDI_FIX}")


def _user_flags(rt: Runtime) -> list[str]:
    if rt.kind == "podman" and rt.rootless:
        return ["--userns", "keep-id"]  # the user's own uid inside, mapped to theirs outside
    return ["--user", f"{rt.uid}:{rt.gid}"]


def run_argv(rt: Runtime, c: Container, command: Sequence[str], *, tty: bool = False) -> list[str]:
    """The runtime's command line that runs `command` in the container, in the foreground (its exit status is the
    command's; a SIGTERM to the client reaches the command: podman's and docker's --sig-proxy, apptainer's own).
    tty: an interactive session's (`mnft shell --image`): podman/docker get `-i -t` (the terminal's keys, its size
    and colours reach the program through the container's own pty); apptainer's exec uses the terminal it is in."""
    binds = mounts(c.mounts, rt.home)
    if rt.kind in SIF_RUNTIMES:
        argv = [rt.path, "exec"]
        for path in binds:
            argv += ["--bind", f"{path}:{path}"]
        return argv + ["--pwd", expand(c.workdir, rt.home), *_gpu_flags(rt, c.devices), c.image, *command]
    if rt.kind not in DAEMON_RUNTIMES:
        raise InputError(f"container runtime {rt.kind!r}: use one of {', '.join(RUNTIMES)}")
    argv = [rt.path, "run", *(("-i", "-t") if tty else ()), "--rm", "--name", c.name, "--network", "host", "--ipc", "host", "--pull", "never",
            "--log-driver", "none", *_user_flags(rt), "--security-opt", "label=disable"]
    for key, value in c.labels:
        argv += ["--label", f"{key}={value}"]
    argv += _gpu_flags(rt, c.devices)
    for path in binds:
        argv += ["-v", f"{path}:{path}"]
    for name in c.env_names:
        argv += ["-e", name]
    return argv + ["--workdir", expand(c.workdir, rt.home), c.image, *command]


def probe_argv(rt: Runtime, image: str, command: Sequence[str]) -> list[str]:
    """A short look inside the image (check's probe): stdin kept open for the script, the host's network (the
    probe's port tests are the job's), the GPUs the host has, as the user, nothing mounted, nothing pulled."""
    if rt.kind in SIF_RUNTIMES:
        return [rt.path, "exec", *_gpu_flags(rt, None), image, *command]
    if rt.kind not in DAEMON_RUNTIMES:
        raise InputError(f"container runtime {rt.kind!r}: use one of {', '.join(RUNTIMES)}")
    return [rt.path, "run", "--rm", "-i", "--network", "host", "--ipc", "host", "--pull", "never", "--log-driver", "none",
            *_user_flags(rt), "--security-opt", "label=disable", *_gpu_flags(rt, None), image, *command]


def teardown_argv(rt_kind: str, path: str, name: str, grace: float = 5.0) -> list[str] | None:
    """Remove a run's container by the name mnft gave it (SIGTERM, SIGKILL after `grace` seconds); None where the
    runtime has no container outliving the keeper's process group (apptainer)."""
    if rt_kind == "podman":
        return [path, "rm", "--force", "--time", str(max(0, int(grace))), name]
    if rt_kind == "docker":
        return [path, "rm", "--force", name]
    return None
