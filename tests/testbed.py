"""A simulated bare-metal cluster on one Linux machine, for the multi-host test suite and the benchmarks.

Each host is a network namespace with its own `eth0` (a veth whose other end sits on a bridge in the root
namespace), its own `sshd` with its own host key, and a private mount namespace in which `/root` (HOME),
`/tmp`, `/etc/hosts`, `/etc/ssh` and `/run` are per-host directories under the cluster's workdir. The Python
installation that runs this code is bound read-only into every private home, so `Cluster.python` works inside
every host. The controller is the calling process: it reaches every host through the bridge address. With
`gpus=N` every host also has N GPUs that are not there: tests/fakegpu.py answers as its `nvidia-smi`. With
`containers=True` every host has a podman of its own (its /etc/containers, its storage on /var/lib/containers):
`load_image`/`share_image` put images from tests/images.py into chosen hosts, `podman(host, …)` runs it there.

    cluster = Cluster.create(4, Path("/tmp/tb"))
    try:
        subprocess.run(cluster.ssh_argv(cluster.hosts[0], ["hostname"]), check=True)
        inventory = cluster.write_inventory(Path("/tmp/tb/inventory.yaml"))
    finally:
        cluster.teardown()

Needs root, iproute2 with `ip netns`, util-linux (`unshare`, `nsenter`, `mount`) and OpenSSH (`sshd`, `ssh`).
`check_prerequisites()` raises `ClusterUnavailable` with a one-line reason otherwise. Nothing is changed outside
the workdir except the namespaces, veths and the bridge, all named `<prefix>-…`, which `teardown()` removes
and `Cluster.cleanup_stale()` removes after a crashed run, and an empty /etc/mnft made once where this machine
lacks one (the mount point of every host's own). See docs/testbed.md.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "SimHost",
    "Cluster",
    "ClusterUnavailable",
    "ClusterError",
    "ClusterCommandError",
    "check_prerequisites",
    "check_container_prerequisites",
    "DEFAULT_FAMILY",
    "cpu_shares",
]

DEFAULT_FAMILY = "mnft"
SUBNET_FIRST_OCTETS = "10.213"
# The whole test bed range routes nowhere unless a bridge claims a /24 of it: an address whose cluster is already
# gone fails at once ("No route to host") instead of following the default route off this machine.
RANGE_BLACKHOLE = f"{SUBNET_FIRST_OCTETS}.0.0/16"
BLACKHOLE_METRIC = 4242
BRIDGE_OCTET = 1
FIRST_HOST_OCTET = 11
OUTSIDER_OCTET = 250
MAX_HOSTS = OUTSIDER_OCTET - FIRST_HOST_OCTET - 1
SSHD = "/usr/sbin/sshd"
IFACE = "eth0"
# What OpenSSH (Debian build) puts on PATH for a non-interactive session; `run` uses the same.
SESSION_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSHD_START_TIMEOUT = 20.0
FAKE_GPU = Path(__file__).resolve().with_name("fakegpu.py")  # the hosts' nvidia-smi when a cluster has gpus
FAKE_GPU_STATE = "/run/mnft-fake-gpu"  # inside a host (its private /run): config.json and used/<index>/<pid>
GPU_BIN = "/usr/local/bin"  # where a host's nvidia-smi appears: on the PATH of root's and every user's ssh session
ETC_MNFT = "/etc/mnft"  # every host has its own (made here, empty, when this machine lacks it: a mount point)
SUDOERS_D = "/etc/sudoers.d"  # a host with GPUs has its own (mnft setup's kernel_log step writes a rule there)
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,9}$")  # veth "<prefix>-v123" must fit in 15 characters
_ALIAS_RE = re.compile(r"^mnft-testbed:pid=(\d+):start=(\d+)$")


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the testbed (not root, no `ip netns`, no sshd…); the message says why."""


class ClusterError(RuntimeError):
    """Building or driving the testbed failed."""


class ClusterCommandError(subprocess.CalledProcessError):
    """`Cluster.run` with check=True saw a non-zero exit; str() includes the ends of stdout and stderr."""

    def __init__(self, host: str, proc: subprocess.CompletedProcess):
        super().__init__(proc.returncode, proc.args, proc.stdout, proc.stderr)
        self.host = host

    def __str__(self) -> str:
        def tail(text: Any) -> str:
            text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
            return "\n".join(text.rstrip().splitlines()[-15:])

        return (
            f"on {self.host}: {shlex.join(map(str, self.cmd))} exited {self.returncode}\n"
            f"--- stdout ---\n{tail(self.stdout)}\n--- stderr ---\n{tail(self.stderr)}"
        )


@dataclass
class SimHost:
    name: str
    ns: str
    address: str
    iface: str
    home: Path  # host-side path of the private home (mounted on /root inside the host)
    root: Path  # per-host directory: home/, tmp/, etc/hosts, etc/ssh/, run/
    host_key_pub: str  # "ssh-ed25519 AAAA…" (no comment)
    port: int
    veth: str  # root-side end of the host's veth pair
    cpus: tuple[int, ...] = ()  # the CPUs this host's processes run on (its "cores"); () = every CPU


# --------------------------------------------------------------------------------------------------- helpers


def _sh(argv: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def cpu_shares(n_hosts: int, cpus: Sequence[int]) -> list[tuple[int, ...]]:
    """The CPUs each simulated host owns, as a machine owns its cores: an equal, disjoint share when there are
    enough CPUs (2 hosts on 2 CPUs: one each; 1 host: both), otherwise one CPU each, dealt round-robin.

    Without this every host sees (and torch sizes its intra-op pool to) all of the machine's CPUs, and N hosts'
    workers oversubscribe them N-fold: spinning OpenMP threads then wait for descheduled ones, which made a
    2-host × 1-process run 5-17× slower than 1 host × 2 processes (issue 13, docs/perf.md)."""
    cpus = sorted(cpus)
    if not cpus or n_hosts < 1:
        return [()] * max(0, n_hosts)
    if n_hosts <= len(cpus):
        each = len(cpus) // n_hosts
        return [tuple(cpus[i * each:(i + 1) * each]) for i in range(n_hosts)]
    return [(cpus[i % len(cpus)],) for i in range(n_hosts)]


def _pinned(cpus: tuple[int, ...], argv: list[str]) -> list[str]:
    """argv run on `cpus` (taskset execs, so a Popen's pid stays the command's; children inherit the mask)."""
    return ["taskset", "-c", ",".join(map(str, cpus)), *argv] if cpus else argv


def _ip_batch(lines: Iterable[str], *, ns: str | None = None, force: bool = False) -> subprocess.CompletedProcess:
    argv = ["ip"] + (["-n", ns] if ns else []) + (["-force"] if force else []) + ["-batch", "-"]
    return _sh(argv, input="\n".join(lines) + "\n", check=not force)


def check_prerequisites() -> None:
    """Raise `ClusterUnavailable` naming the first missing piece; return None when the testbed can run."""
    if not sys.platform.startswith("linux"):
        raise ClusterUnavailable("the testbed needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterUnavailable("the testbed needs root (network namespaces, bind mounts)")
    for tool in ("ip", "unshare", "nsenter", "mount", "ssh", "taskset"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"the testbed needs `{tool}` on PATH")
    if not os.access(SSHD, os.X_OK):
        raise ClusterUnavailable(f"the testbed needs OpenSSH server at {SSHD} (apt-get install openssh-server)")
    try:
        proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterUnavailable(f"`ip netns list` failed: {exc}") from None
    if proc.returncode != 0:
        raise ClusterUnavailable(f"`ip netns` is unavailable: {proc.stderr.strip()}")


def _ed25519_keypair(comment: str) -> tuple[bytes, str]:
    """(OpenSSH private key PEM, "ssh-ed25519 AAAA…") made in-process: 33 ssh-keygen runs would cost more."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public.decode()


_FAKE_GPU_CODE: dict[tuple, bytes] = {}


def _fake_gpu_code() -> bytes:
    """tests/fakegpu.py compiled by the hosts' /usr/bin/python3, once per version of the file (every host of every
    cluster runs the same): each question then costs a host's nvidia-smi no compiling of its own."""
    st = FAKE_GPU.stat()
    key = (st.st_mtime_ns, st.st_size)
    if key not in _FAKE_GPU_CODE:
        import fakegpu

        _FAKE_GPU_CODE[key] = fakegpu.compiled()
    return _FAKE_GPU_CODE[key]


def _write(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _netns_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _reap(pids: Iterable[int], deadline: float) -> None:
    """Wait until each of `pids` is gone or a zombie. Nothing is waitpid()ed here: a Popen's owner (the testbed
    for sshd and anchors, the caller for `popen`) collects its own child; orphans of ssh sessions belong to
    pid 1, which reaps them in its own time."""
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        pending = {pid for pid in pending if _proc_state(pid) not in (None, "Z", "X")}
        if pending:
            time.sleep(0.02)


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill_netns(ns: str, keep: Iterable[int] = ()) -> None:
    """SIGKILL every process in `ns` (except `keep`) until none is left running."""
    keep = set(keep)
    seen: set[int] = set()
    for _ in range(20):
        pids = [p for p in _netns_pids(ns) if p not in keep]
        if not pids:
            break
        seen.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(pids, time.monotonic() + 2)
    _reap(seen, time.monotonic() + 0.5)


def _ensure_range_blackhole() -> None:
    """A high-metric blackhole route for the test bed's range (left in place: it only ever drops traffic)."""
    shown = _sh(["ip", "-4", "route", "show", "type", "blackhole", RANGE_BLACKHOLE], check=False).stdout
    if not shown.strip():
        _sh(["ip", "-4", "route", "add", "blackhole", RANGE_BLACKHOLE, "metric", str(BLACKHOLE_METRIC)])


def _used_ipv4_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    out = _sh(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for match in re.finditer(r"\binet (\S+)", out):
        nets.append(ipaddress.IPv4Interface(match.group(1)).network)
    out = _sh(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    for line in out.splitlines():
        words = line.split()
        if words[:2] == ["blackhole", RANGE_BLACKHOLE]:
            continue  # the range's own safety net, not a network in use
        if words and words[0] in ("unicast", "local", "broadcast", "blackhole", "unreachable", "prohibit"):
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            nets.append(ipaddress.IPv4Network(words[0], strict=False))
        except ValueError:
            pass
    return nets


def _project_paths() -> list[str]:
    """The directory this checkout's mnft is imported from, when it lies under /tmp: every host has a private /tmp,
    so a checkout there (a fresh clone, CI) would not be seen by the hosts' Python, which imports mnft from it
    (the editable install points there; a Slurm batch runs `python -m mnft.slurm.allocation` on a node)."""
    import importlib.util

    spec = importlib.util.find_spec("mnft")  # finds the package, imports nothing of it
    if spec is None or not spec.submodule_search_locations:
        return []
    top = os.path.dirname(os.path.realpath(list(spec.submodule_search_locations)[0]))
    return [top] if top.startswith("/tmp/") else []


def _python_paths() -> tuple[str, list[str]]:
    """(python for the hosts, top-level directories under root's home to bind into every private home)."""
    home = pwd.getpwuid(0).pw_dir.rstrip("/") or "/"
    if sys.prefix != sys.base_prefix:  # a venv: keep its symlinked interpreter so its site-packages apply
        python = os.path.join(os.path.abspath(sys.prefix), "bin", "python")
    else:
        python = os.path.realpath(sys.executable)
    binds: list[str] = []
    for path in (python, os.path.realpath(python), sys.prefix, sys.base_prefix, os.path.realpath(sys.base_prefix)):
        path = os.path.abspath(path)
        if path.startswith(home + "/"):
            top = os.path.join(home, path[len(home) + 1 :].split("/", 1)[0])
            if top not in binds:
                binds.append(top)
    return python, binds


# --------------------------------------------------------------------------------------------------- containers

CONTAINERS_ETC = "/etc/containers"  # a host's own copy is bound here (Cluster.create(containers=True))
CONTAINERS_STORAGE = "/var/lib/containers"  # and its own storage here
# Rlimits runc may set here. podman's defaults (nofile 1048576) are above this machine's hard limits, which runc,
# without CAP_SYS_RESOURCE, cannot raise: "error setting rlimit type 7: operation not permitted".
CONTAINER_ULIMITS = ("nproc=5000:5000", "nofile=16384:16384")
SUBID_FIRST, SUBID_COUNT = 1_000_000, 65536  # add_user's users' subordinate ids (rootless podman)
CONTAINER_CGROUPS = ("/sys/fs/cgroup/*/libpod_parent/libpod-{id}", "/sys/fs/cgroup/libpod_parent/libpod-{id}")  # cgroupfs


def check_container_prerequisites() -> None:
    """Raise `ClusterUnavailable` unless hosts can each have a podman: the test bed's prerequisites, then podman,
    runc and conmon (Debian: apt-get install podman runc) and podman's policy.json in /etc/containers."""
    check_prerequisites()
    for tool in ("podman", "runc", "conmon"):
        if shutil.which(tool, path=SESSION_PATH) is None:
            raise ClusterUnavailable(f"containers=True needs `{tool}` (apt-get install podman runc)")
    if not os.path.isfile(os.path.join(CONTAINERS_ETC, "policy.json")):
        raise ClusterUnavailable(f"containers=True needs podman's {CONTAINERS_ETC}/policy.json (apt-get install podman)")


def containers_conf() -> str:
    """Every host's /etc/containers/containers.conf: what podman needs on this machine, so that a plain
    `podman run IMAGE …` (mnft's own command line) works in a host with no flag added.

    * runc: crun fails here; cgroupfs: no systemd to ask for cgroups (cgroup v1 here).
    * default_ulimits within this machine's hard limits (CONTAINER_ULIMITS).
    * events and container logs to files (no journald); file locks in podman's tmp_dir (root's: /run/libpod, the
      host's own /run; a user's: /run/user/UID/libpod/tmp): podman's default shm locks (/dev/shm/libpod_lock) would
      be one table for every host of every cluster and this machine's own podman, which a host's first podman (a
      "reboot" to it) would wipe.

    The same file serves root and rootless users (`add_user`), so it names no path of root's."""
    ulimits = ", ".join(f'"{u}"' for u in CONTAINER_ULIMITS)
    return "\n".join([
        "# mnft test bed: this host's own podman (tests/testbed.py containers_conf)",
        "[containers]",
        f"default_ulimits = [{ulimits}]",
        'log_driver = "k8s-file"',
        "",
        "[engine]",
        'runtime = "runc"',
        'cgroup_manager = "cgroupfs"',
        'events_logger = "file"',
        'lock_type = "file"',
        "",
    ])


def storage_conf(stores: Sequence[str] = ()) -> str:
    """Every host's /etc/containers/storage.conf: overlay, under the host's own /var/lib/containers and /run; and
    the read-only image stores it shares with other hosts (`Cluster.share_image`)."""
    shared = ", ".join(f'"{store}"' for store in stores)
    return "\n".join([
        "# mnft test bed: this host's own image and container storage (tests/testbed.py storage_conf)",
        "[storage]",
        'driver = "overlay"',
        f'graphroot = "{CONTAINERS_STORAGE}/storage"',
        'runroot = "/run/containers/storage"',
        *(["", "[storage.options]", f"additionalimagestores = [{shared}]"] if stores else []),
        "",
    ])


def image_store(image: Any, stores: Path) -> Path:
    """A read-only image store (a podman graphroot) holding `image` (an `images.Image`) under its ref, made once on
    this machine in `stores`/<image id> and kept for later sessions; an image of the same id under another ref (a
    new cache key, same content) is tagged into it. Stores unused for a week are removed."""
    store = stores / image.id
    stores.mkdir(parents=True, exist_ok=True)
    with open(stores / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not store.is_dir():
            work = Path(tempfile.mkdtemp(prefix=f"{image.id}.", dir=stores))
            try:
                _store_podman(work / "root", "pull", "--quiet", f"docker-archive:{image.archive}")
                os.rename(work / "root", store)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        names = json.loads((store / "overlay-images" / "images.json").read_text())
        if not any(image.ref in entry.get("names", ()) for entry in names):
            _store_podman(store, "tag", image.id, image.ref)
        for old in stores.iterdir():
            if old.is_dir() and old != store and time.time() - old.stat().st_mtime > 7 * 86400:
                shutil.rmtree(old, ignore_errors=True)
    os.utime(store)
    return store


def _store_podman(graphroot: Path, *args: str) -> None:
    """`podman ARGS…` on `graphroot` by a podman of its own here (its own runroot, tmpdir, configuration and no
    database left behind): the machine's default storage is never touched."""
    work = Path(tempfile.mkdtemp(prefix="podman.", dir=graphroot.parent))
    try:
        _write(work / "containers.conf", containers_conf().replace('events_logger = "file"', 'events_logger = "none"'))
        _write(work / "storage.conf", storage_conf().replace(f"{CONTAINERS_STORAGE}/storage", str(graphroot))
               .replace("/run/containers/storage", str(work / "run")))
        env = {**os.environ, "CONTAINERS_CONF": str(work / "containers.conf"), "CONTAINERS_STORAGE_CONF": str(work / "storage.conf")}
        proc = subprocess.run(["podman", "--tmpdir", str(work / "tmp"), *args], env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        if proc.returncode != 0:
            raise ClusterError(f"podman {shlex.join(args)} on the image store {graphroot} failed: {proc.stderr.strip()[-2000:]}")
    finally:
        shutil.rmtree(graphroot / "libpod", ignore_errors=True)  # that podman's own database: no image in it
        shutil.rmtree(work, ignore_errors=True)


def _cgroup_mounts() -> list[str]:
    """Commands that mount this machine's cgroup hierarchies again on /sys/fs/cgroup, for runc: `ip netns exec` gives
    a host a fresh /sys (its network's view) in which /sys/fs/cgroup is empty. The same hierarchies, not new ones: a
    container's cgroup made in a host is seen here too. All but cpuset (v1): runc would put every container into a
    cpuset of every CPU of the machine, out of the host's own (`cpu_shares`); without it a container keeps them."""
    steps = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point, (fstype, _source, options) = fields[4], fields[fields.index("-") + 1:][:3]
        if fstype == "cgroup" and "cpuset" in options.split(","):
            continue
        if point == "/sys/fs/cgroup" and fstype == "tmpfs":
            steps.append("mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup")
        elif point.startswith("/sys/fs/cgroup/") and fstype in ("cgroup", "cgroup2"):
            steps += [f"mkdir -p {shlex.quote(point)}", f"mount -t {fstype} -o {shlex.quote(options)} {fstype} {shlex.quote(point)}"]
        elif point == "/sys/fs/cgroup" and fstype == "cgroup2":
            steps.append(f"mount -t cgroup2 -o {shlex.quote(options)} cgroup2 /sys/fs/cgroup")
    return steps


def _each(items: Sequence[Any], work: Any) -> None:
    """work(item) for every item at once, each in a thread; then the first exception, if any, is raised."""
    errors: list[BaseException] = []

    def one(item: Any) -> None:
        try:
            work(item)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _kill_cgroups(container_ids: Iterable[str]) -> None:
    """SIGKILL every process in these containers' cgroups (podman's cgroupfs layout), then remove the cgroups."""
    import glob

    groups = [g for cid in container_ids for pattern in CONTAINER_CGROUPS for g in glob.glob(pattern.format(id=cid))]
    for _ in range(10):
        pids = set()
        for group in groups:
            try:
                pids.update(int(p) for p in Path(group, "cgroup.procs").read_text().split())
            except OSError:
                pass
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for group in sorted(groups, key=len, reverse=True):
        try:
            os.rmdir(group)
        except OSError:
            pass


def _mounts_under(path: Path) -> list[str]:
    """Mount points of this mount namespace at or under `path`, in the order they were mounted."""
    top = os.path.realpath(path)
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == top or point.startswith(top + "/"):
            found.append(point)
    return found


# --------------------------------------------------------------------------------------------------- Cluster


class Cluster:
    """A running simulated cluster. Build with `Cluster.create`; always `teardown()` (it is idempotent).

    `gpus` is how many (fake) GPUs each host has: with gpus > 0 `nvidia-smi` in a host is tests/fakegpu.py, and
    `gpu_users(host)` says which processes use which of them. `add_user(name, torch=True)` makes a login user who can
    run `python` (the interpreter with torch, under root's home). `containers=True`: a podman per host (`podman`,
    `load_image`, `share_image`, `remove_containers`; docs/testbed.md "Containers")."""

    hosts: list[SimHost]
    outsider: SimHost | None
    bridge_address: str
    controller_key: Path
    known_hosts: Path
    python: str
    gpus: int

    def __init__(self, *, prefix: str, workdir: Path, subnet: ipaddress.IPv4Network | None = None, share_cpus: bool = False,
                 stock_sshd: bool = False, shared_home: Sequence[str] = (), shared_dirs: Mapping[str, Sequence[str]] | None = None,
                 gpus: int = 0, containers: bool = False, dmesg_restrict: bool = True):
        self.prefix = prefix
        self.workdir = workdir
        self.subnet = subnet
        self.bridge = f"{prefix}-br"
        self.hosts = []
        self.outsider = None
        self.bridge_address = ""
        self.controller_key = workdir / "controller" / "id_ed25519"
        self.known_hosts = workdir / "controller" / "known_hosts"
        self.python, self._python_binds = _python_paths()
        self.home_mountpoint = pwd.getpwuid(0).pw_dir
        self._sshd: dict[str, subprocess.Popen] = {}
        self._anchors: dict[str, subprocess.Popen] = {}
        self._log_offsets: dict[str, int] = {}
        self._original_keys: dict[str, tuple[bytes, str]] = {}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._torn_down = False
        self.share_cpus = share_cpus
        self.stock_sshd = stock_sshd
        self.shared_home = tuple(shared_home)
        self.shared_dirs = self._shared_dirs(shared_dirs or {})  # host-side path -> (the hosts that see it, the source)
        self.gpus = gpus
        self.dmesg_restrict = dmesg_restrict  # with gpus: /dev/kmsg root's only, as under Debian's kernel.dmesg_restrict=1
        self.containers = containers
        self._users: dict[str, tuple[int, str]] = {}  # add_user's users: name -> (uid, home inside the hosts)
        self._stores: dict[str, list[str]] = {}  # share_image: host name -> the image stores in its storage.conf
        self._carried = _project_paths()  # bound into every host at the same path (a checkout under /tmp)

    # ------------------------------------------------------------------ building

    @classmethod
    def create(
        cls, n_hosts: int, workdir: Path, *, outsider: bool = True, prefix: str | None = None, share_cpus: bool = False,
        stock_sshd: bool = False, shared_home: Sequence[str] = (), shared_dirs: Mapping[str, Sequence[str]] | None = None,
        gpus: int = 0, containers: bool = False, dmesg_restrict: bool = True,
    ) -> "Cluster":
        """Build `n_hosts` hosts named h1…hN (plus an outsider "out" not meant for any inventory) under `workdir`.

        Each host runs on its own share of the machine's CPUs (`cpu_shares`), as a real machine has its own cores;
        `share_cpus=True` lets every host use every CPU (the old behaviour, which oversubscribes them).

        `stock_sshd=True` gives every sshd the limits Debian and Ubuntu ship (`MaxStartups 10:30:100`,
        `MaxSessions 10`: beyond 10 unauthenticated connections at once, sshd drops new ones at random) instead of
        the test bed's raised ones: a typical lab's sshd, for tests and benches of fan-in.

        `shared_home=("h1", "h2", …)` gives those hosts one home directory (mounted on /root in each), as an NFS
        home does in a lab: a file one of them writes there, the others see at once.

        `shared_dirs={"~/mnft-data": ("h1", "h2")}` mounts one directory at that path in those hosts only, the rest
        of their homes staying private (a lab's NFS data or scratch mount): the directory
        `<workdir>/shared-dirs/<path>` here (`Cluster.shared_dir(path)`). A path is under the home (`~/…` or
        `/root/…`) or under `/tmp`, where the test bed owns every host's directory (a mount point elsewhere would
        have to be made on this machine); `ValueError` otherwise.

        `gpus=N` (N > 0) gives every host (not the outsider) N GPUs that are not there: `nvidia-smi` on the PATH of
        its ssh sessions (root's and every user's) and of `run` is tests/fakegpu.py, which answers the queries mnft
        asks (`--query-gpu`, `--query-compute-apps`, `topo -m`, `-L`, the banner) as the real one formats them, from
        the host's `/run/mnft-fake-gpu/config.json` (N H100s, NVLinked in consecutive pairs: `fakegpu.default_config`).
        A process uses a device while it is registered in `/run/mnft-fake-gpu/used/<index>/` (`nvidia-smi --fake-use
        INDEX -- COMMAND…`, or `fakegpu.RANK_SNIPPET` in a training script); `gpu_users(host)` reads that from here.
        The stand-in is stacked onto the host's /usr/local/bin (a read-only overlay: what this machine has there
        stays visible), so it needs overlayfs and Debian's /usr/bin/python3. Each such host's /dev/kmsg is a file of
        its own that only root reads, as Debian's kernel.dmesg_restrict=1 makes the real one (`dmesg_restrict=False`:
        every user reads it), and root's writes to /usr/local and /etc/sudoers.d stay the host's own (a writable
        overlay, a directory of its own), where `mnft setup`'s kernel_log step installs its reader.

        `containers=True` gives every host (not the outsider) its own podman: its own /etc/containers (runc,
        cgroupfs, ulimits this machine allows: `containers_conf`) and its own image and container storage, bound on
        /var/lib/containers, so an image loaded into h1 (`load_image`) is not in h2, as on a lab's separate disks.
        `podman(host, ...)` runs podman as the host sees it; so does a plain `podman` over ssh. `share_image` gives
        hosts an image from a read-only store instead, at once. A user of `add_user` runs podman rootless. Teardown
        removes every container, then the storage.

        Raises `ClusterUnavailable` when the machine cannot host it, `ClusterError` when building failed (after
        tearing down whatever was built).
        """
        check_prerequisites()
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be within 1..{MAX_HOSTS}, not {n_hosts}")
        prefix = prefix or _default_prefix()
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern} (interface names are ≤ 15 chars)")
        workdir = Path(workdir).absolute()
        if re.match(r"^/(run|etc|proc|sys|dev)(/|$)", os.path.realpath(workdir)):
            raise ValueError(f"workdir {workdir} must not be under /run, /etc, /proc, /sys or /dev")
        if not isinstance(gpus, int) or gpus < 0:
            raise ValueError(f"gpus must be a count of GPUs per host (0 for none), not {gpus!r}")
        if gpus and re.search(r"[:,\\\s]", f"{workdir}{os.path.realpath(workdir)}"):
            raise ValueError(f"gpus: workdir {workdir} must not hold ':', ',', '\\' or spaces (it names an overlay's lower directory)")
        if gpus and not os.access("/usr/bin/python3", os.X_OK):
            raise ClusterUnavailable("Cluster.create(gpus=N) needs /usr/bin/python3 (the fake nvidia-smi runs on it)")
        if containers:
            check_container_prerequisites()
        workdir.mkdir(parents=True, exist_ok=True)
        cluster = cls(prefix=prefix, workdir=workdir, share_cpus=share_cpus, stock_sshd=stock_sshd, shared_home=shared_home,
                      shared_dirs=shared_dirs, gpus=gpus, containers=containers, dmesg_restrict=dmesg_restrict)
        unknown = sorted({n for names, _ in cluster.shared_dirs.values() for n in names} - {f"h{i}" for i in range(1, n_hosts + 1)})
        if unknown:
            raise ValueError(f"shared_dirs names hosts this cluster does not have: {', '.join(unknown)}")
        # refused before anything is built: a failed build tears down every namespace of its prefix, and these are
        # another cluster's (the session cluster's, when a fresh one drew its prefix)
        if any(ns.startswith(prefix + "-") for ns in _list_netns()):
            raise ClusterError(f"namespaces named {prefix}-* already exist: pick another prefix")
        atexit.register(cluster.teardown)
        try:
            cluster._build(n_hosts, outsider)
        except BaseException:
            cluster.teardown()
            raise
        return cluster

    def _build(self, n_hosts: int, outsider: bool) -> None:
        with _allocation_lock():
            _ensure_range_blackhole()
            self.subnet = _free_subnet(self.prefix)
            net = self.subnet
            self.bridge_address = str(net.network_address + BRIDGE_OCTET)
            self.hosts = [self._host(f"h{i}", f"{self.prefix}-h{i}", net.network_address + FIRST_HOST_OCTET + i - 1,
                                     f"{self.prefix}-v{i}") for i in range(1, n_hosts + 1)]
            if not self.share_cpus:  # each host owns its cores (cpu_shares); the outsider keeps every CPU
                for host, cpus in zip(self.hosts, cpu_shares(len(self.hosts), os.sched_getaffinity(0))):
                    host.cpus = cpus
            if outsider:
                self.outsider = self._host("out", f"{self.prefix}-out", net.network_address + OUTSIDER_OCTET,
                                           f"{self.prefix}-vo")
            # The bridge comes first and carries the owner, so cleanup_stale never mistakes us for a leftover.
            lines = [
                f"link add {self.bridge} type bridge",
                f"link set {self.bridge} alias mnft-testbed:pid={os.getpid()}:start={_start_time(os.getpid())}",
                f"addr add {self.bridge_address}/{net.prefixlen} dev {self.bridge}",
                f"link set {self.bridge} up",
            ]
            for host in self._all():
                lines += [
                    f"netns add {host.ns}",
                    f"link add {host.veth} type veth peer name {IFACE} netns {host.ns}",
                    f"link set {host.veth} master {self.bridge} up",
                ]
            _ip_batch(lines)
        procs = [
            (host, subprocess.Popen(["ip", "-n", host.ns, "-batch", "-"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for host in self._all()
        ]
        for host, proc in procs:
            out, _ = proc.communicate(
                f"addr add {host.address}/{net.prefixlen} dev {IFACE}\nlink set {IFACE} up\nlink set lo up\n",
                timeout=30,
            )
            if proc.returncode != 0:
                raise ClusterError(f"configuring {host.ns} failed: {out.strip()}")
        self._write_files()
        os.makedirs(ETC_MNFT, mode=0o755, exist_ok=True)  # the mount point of every host's own /etc/mnft
        for host in self.hosts:
            self._spawn_anchor(host)
        for host in self.hosts:
            self._wait_anchor(host)
        for host in self.hosts:
            self._spawn_sshd(host)
        for host in self.hosts:
            self._wait_listening(host)

    def _host(self, name: str, ns: str, address: Any, veth: str) -> SimHost:
        root = self.workdir / name
        home = self.workdir / "shared-home" if name in self.shared_home else root / "home"
        return SimHost(name=name, ns=ns, address=str(address), iface=IFACE, home=home, root=root,
                       host_key_pub="", port=22, veth=veth)

    def _all(self) -> list[SimHost]:
        return self.hosts + ([self.outsider] if self.outsider else [])

    def _shared_dirs(self, wanted: Mapping[str, Sequence[str]]) -> dict[str, tuple[tuple[str, ...], Path]]:
        """shared_dirs checked: each path absolute (`~` is the home), under the home or /tmp, none inside another."""
        out: dict[str, tuple[tuple[str, ...], Path]] = {}
        for given, names in wanted.items():
            path = os.path.normpath(self.home_mountpoint + given[1:] if given == "~" or given.startswith("~/") else given)
            inside = [top for top in (self.home_mountpoint, "/tmp") if path.startswith(top.rstrip("/") + "/")]
            if not os.path.isabs(path) or not inside or ".." in path.split("/"):
                raise ValueError(f"shared_dirs: {given!r} must be a directory under the home ({self.home_mountpoint}, ~) or /tmp")
            if isinstance(names, str):
                raise ValueError(f"shared_dirs: {given!r} needs a sequence of host names, not the string {names!r}")
            out[path] = (tuple(names), self.workdir / "shared-dirs" / path.strip("/"))
        for path in out:
            if any(other != path and path.startswith(other + "/") for other in out):
                raise ValueError(f"shared_dirs: {path} lies inside another shared directory")
        return out

    def shared_dir(self, path: str) -> Path:
        """The directory on this machine that the hosts of `shared_dirs` see at `path` (as given to create)."""
        full = os.path.normpath(self.home_mountpoint + path[1:] if path == "~" or path.startswith("~/") else path)
        return self.shared_dirs[full][1]

    def _host_side(self, host: SimHost, path: str) -> Path:
        """Where a path inside the host (under its home or /tmp) is on this machine, before its mounts cover it."""
        if path.startswith(self.home_mountpoint.rstrip("/") + "/"):
            return host.home / os.path.relpath(path, self.home_mountpoint)
        return host.root / "tmp" / os.path.relpath(path, "/tmp")

    def _write_files(self) -> None:
        private, public = _ed25519_keypair(f"mnft-testbed-controller@{self.prefix}")
        _write(self.controller_key, private, 0o600)
        _write(self.controller_key.with_suffix(".pub"), public + "\n", 0o644)
        os.chmod(self.controller_key.parent, 0o700)
        etc_hosts = Path("/etc/hosts").read_text()
        names = "".join(f"{h.address}\t{h.name}\n" for h in self.hosts)
        for host in self._all():
            for sub in ("home", "tmp", "etc/ssh", "run/sshd"):
                (host.root / sub).mkdir(parents=True, exist_ok=True)
            host.home.mkdir(parents=True, exist_ok=True)
            os.chmod(host.root / "tmp", 0o1777)
            os.chmod(host.root / "run" / "sshd", 0o755)
            os.chmod(host.home, 0o700)
            own = "" if host is self.outsider else f"# mnft testbed: cluster hosts\n{names}"
            _write(host.root / "etc" / "hosts", etc_hosts.rstrip("\n") + "\n" + own)
            if host is self.outsider:
                continue
            for top in self._python_binds:
                (host.home / os.path.basename(top)).mkdir(exist_ok=True)
            for path in self._carried:
                self._host_side(host, path).mkdir(parents=True, exist_ok=True)
            for path, (names, source) in self.shared_dirs.items():  # the mount point in the host, the shared source here
                if host.name in names:
                    source.mkdir(parents=True, exist_ok=True)
                    self._host_side(host, path).mkdir(parents=True, exist_ok=True)
            ssh_dir = host.home / ".ssh"
            ssh_dir.mkdir(mode=0o700, exist_ok=True)
            os.chmod(ssh_dir, 0o700)
            _write(ssh_dir / "authorized_keys", public + "\n", 0o600)
            _write(host.root / "etc" / "ssh" / "sshd_config", _sshd_config(stock=self.stock_sshd))
            (host.root / "etc" / "mnft").mkdir(exist_ok=True)
            if self.gpus:
                self._write_fake_gpus(host)
            if self.containers:
                self._write_containers(host)
            self._install_host_key(host, *_ed25519_keypair(f"root@{host.name}"))
            self._original_keys[host.name] = (self._host_key_path(host).read_bytes(), host.host_key_pub)
        self._write_known_hosts()

    def _write_fake_gpus(self, host: SimHost) -> None:
        """The host's GPUs that are not there: the stand-in as <host>/gpu-bin/nvidia-smi (stacked onto /usr/local/bin
        by the mount script: fakegpu.STUB, which runs tests/fakegpu.py's bytecode, compiled once, from the host's
        state directory), its config and a registry directory per device that every user may write to."""
        import fakegpu

        _write(host.root / "gpu-bin" / "nvidia-smi", fakegpu.STUB.encode(), 0o755)
        os.chmod(host.root / "gpu-bin", 0o755)
        state = self._fake_gpu_state(host)
        _write(state / fakegpu.CODE_NAME, _fake_gpu_code(), 0o644)
        _write(state / "config.json", json.dumps(fakegpu.default_config(self.gpus)) + "\n", 0o644)
        for index in range(self.gpus):
            (state / "used" / str(index)).mkdir(parents=True, exist_ok=True)
            os.chmod(state / "used" / str(index), 0o1777)
        os.chmod(state / "used", 0o755)
        os.chmod(state, 0o755)
        # the host's kernel log (bound on /dev/kmsg), which `nvidia-smi --fake-xid` writes: root's only, as a real one
        # is under kernel.dmesg_restrict=1 (Debian's and Ubuntu's default), unless the cluster says dmesg_restrict=False
        _write(host.root / "kmsg", "", 0o600 if self.dmesg_restrict else 0o644)
        _write(host.root / "dmesg_restrict", "1\n" if self.dmesg_restrict else "0\n", 0o444)
        for private in (host.root / "usr-local", host.root / "usr-local.work"):
            private.mkdir(parents=True, exist_ok=True)
        (host.root / "etc" / "sudoers.d").mkdir(parents=True, exist_ok=True)
        os.chmod(host.root / "etc" / "sudoers.d", 0o750)

    def gpu_faults(self, host: SimHost, **faults) -> None:
        """What the host's GPUs get wrong from now on (tests/fakegpu.py's config keys: lost=[0], ecc={"1": [2, 5]},
        remap=…, throttle=…, persistence=False, stall=15, mig=[3]); given again with None, a fault is mended."""
        import fakegpu

        path = self._fake_gpu_state(host) / "config.json"
        config = json.loads(path.read_text())
        for key, value in faults.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        _write(path, json.dumps(config) + "\n", 0o644)
        assert fakegpu.load_config(str(path.parent)) is not None

    def xid(self, host: SimHost, index: int, code: int) -> None:
        """The kernel of the host logs Xid `code` for its GPU `index` (its /dev/kmsg, a file of the host's own)."""
        import fakegpu

        fakegpu.write_xid(index, code, str(host.root / "kmsg"))

    def _fake_gpu_state(self, host: SimHost) -> Path:
        return host.root / os.path.relpath(FAKE_GPU_STATE, "/")

    def gpu_users(self, host: SimHost) -> dict[int, list[int]]:
        """{index: [pid, …]} of every fake GPU of the host (a cluster with gpus): the processes that use it now, as
        its nvidia-smi shows them (registered, alive, not a zombie, not a reused pid). Read from this machine."""
        import fakegpu

        if not self.gpus:
            raise ClusterError("this cluster has no GPUs: Cluster.create(..., gpus=N)")
        found = fakegpu.uses(str(self._fake_gpu_state(host)), self.gpus)
        return {index: [pid for pid, _ in users] for index, users in found.items()}

    def _host_key_path(self, host: SimHost) -> Path:
        return host.root / "etc" / "ssh" / "ssh_host_ed25519_key"

    def _install_host_key(self, host: SimHost, private: bytes, public: str) -> None:
        _write(self._host_key_path(host), private, 0o600)
        _write(self._host_key_path(host).with_suffix(".pub"), f"{public} root@{host.name}\n", 0o644)
        host.host_key_pub = public

    def _write_known_hosts(self) -> None:
        lines = "".join(f"{h.address} {self._original_keys[h.name][1]}\n" for h in self.hosts)
        _write(self.known_hosts, lines, 0o644)

    # ------------------------------------------------------------------ sshd

    def _mount_script(self, host: SimHost) -> str:
        q = shlex.quote
        r = host.root
        steps = []
        for top in self._python_binds:  # before /root is covered: afterwards the real one is out of reach
            target = host.home / os.path.basename(top)
            steps += [f"mount --bind {q(top)} {q(str(target))}", f"mount -o remount,bind,ro {q(str(target))}"]
        if self.gpus:
            # root's writes under /usr/local (mnft setup's reader of Xid lines in /usr/local/libexec) and in
            # /etc/sudoers.d stay the host's own: a writable layer over this machine's /usr/local, a sudoers.d of its own
            layer = f"lowerdir=/usr/local,upperdir={r / 'usr-local'},workdir={r / 'usr-local.work'}"
            steps.append(f"mount -t overlay mnft-usr-local -o {q(layer)} /usr/local")
            if os.path.isdir(SUDOERS_D):
                steps.append(f"mount --bind {q(str(r / 'etc' / 'sudoers.d'))} {SUDOERS_D}")
            # the fake nvidia-smi on top of this machine's /usr/local/bin, hiding nothing there
            lower = f"{r / 'gpu-bin'}:{GPU_BIN}"
            steps.append(f"mount -t overlay mnft-fake-gpu -o {q('ro,lowerdir=' + lower)} {GPU_BIN}")
            steps.append(f"mount --bind {q(str(r / 'kmsg'))} /dev/kmsg")  # its own kernel log, never the machine's
            steps.append(f"mount --bind {q(str(r / 'dmesg_restrict'))} /proc/sys/kernel/dmesg_restrict")  # and what it says of it
        if self.containers:  # the host's own podman: its configuration and its storage (sources under the workdir)
            steps += [f"mount --bind {q(str(r / 'containers' / 'etc'))} {CONTAINERS_ETC}",
                      f"mount --bind {q(str(self._storage(host)))} {CONTAINERS_STORAGE}", *_cgroup_mounts()]
        # shared_dirs: onto the mount point inside the host's home or tmp while both are still in reach here; the
        # recursive binds below carry them to /root and /tmp
        shared = [(path, source) for path, (names, source) in self.shared_dirs.items() if host.name in names]
        steps += [f"mount --bind {q(str(source))} {q(str(self._host_side(host, path)))}" for path, source in shared]
        for path in self._carried:  # the project's checkout at its own path, read-only (its editable install points there)
            target = q(str(self._host_side(host, path)))
            steps += [f"mount --bind {q(path)} {target}", f"mount -o remount,bind,ro {target}"]
            shared.append((path, Path(path)))
        if os.path.isdir(ETC_MNFT):  # root's writes to /etc/mnft (the admins' group) stay the host's own
            steps.append(f"mount --bind {q(str(r / 'etc' / 'mnft'))} {ETC_MNFT}")
        steps += [
            f"mount --bind {q(str(r / 'etc' / 'hosts'))} /etc/hosts",
            f"mount --bind {q(str(r / 'etc' / 'ssh'))} /etc/ssh",
            f"mount --bind {q(str(r / 'run'))} /run",
        ]
        home = f"mount --rbind {q(str(host.home))} {q(self.home_mountpoint)}"
        tmp = f"mount --{'rbind' if any(p.startswith('/tmp/') for p, _ in shared) else 'bind'} {q(str(r / 'tmp'))} /tmp"
        # Cover last whichever of HOME and /tmp holds the workdir, so every source is still visible when bound.
        under_tmp = os.path.realpath(self.workdir).startswith("/tmp/")
        steps += [home, tmp] if under_tmp else [tmp, home]
        steps += [f"hostname {q(host.name)}", "echo ready", "exec sleep infinity"]
        return "set -e\n" + "\n".join(steps)

    def _spawn_anchor(self, host: SimHost) -> None:
        """The host's "machine": a process holding its private mount and UTS namespaces for the cluster's life,
        so sshd can stop and start and `run` keeps working while sshd is down."""
        argv = _pinned(host.cpus, ["ip", "netns", "exec", host.ns, "unshare", "--mount", "--uts", "--propagation", "private",
                                   "sh", "-c", self._mount_script(host)])
        # ip netns exec and unshare exec without forking, and sh execs sleep: the Popen pid is the anchor's.
        self._anchors[host.name] = subprocess.Popen(
            argv, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def _wait_anchor(self, host: SimHost) -> None:
        proc = self._anchors[host.name]
        line = proc.stdout.readline()  # "ready" once every mount is in place; EOF if the script failed
        proc.stdout.close()
        if line.strip() != b"ready":
            proc.kill()
            proc.wait()
            err = proc.stderr.read().decode(errors="replace").strip()
            raise ClusterError(f"setting up the private mounts of {host.name} ({host.ns}) failed: {err}")
        proc.stderr.close()

    def _spawn_sshd(self, host: SimHost) -> None:
        log = host.root / "run" / "sshd.log"
        self._log_offsets[host.name] = log.stat().st_size if log.exists() else 0
        argv = _pinned(host.cpus, ["nsenter", "-t", str(self._anchors[host.name].pid), "-n", "-m", "-u", "--",
                                   SSHD, "-D", "-f", "/etc/ssh/sshd_config", "-E", "/run/sshd.log"])
        # nsenter execs without forking (no pid namespace), so the Popen pid is the sshd listener's pid.
        with open(host.root / "sshd.stderr", "ab") as stderr:
            self._sshd[host.name] = subprocess.Popen(
                argv, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                start_new_session=True,
            )

    def _wait_listening(self, host: SimHost, timeout: float = SSHD_START_TIMEOUT) -> None:
        log = host.root / "run" / "sshd.log"
        proc = self._sshd[host.name]
        deadline = time.monotonic() + timeout
        while True:
            if log.exists():
                with open(log, "rb") as f:
                    f.seek(self._log_offsets.get(host.name, 0))
                    if b"Server listening on 0.0.0.0 port" in f.read():
                        return
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (host.root / "sshd.stderr").read_text(errors="replace")[-2000:]
                tail += log.read_text(errors="replace")[-2000:] if log.exists() else ""
                why = f"exited {proc.returncode}" if proc.returncode is not None else f"not listening after {timeout}s"
                raise ClusterError(f"sshd on {host.name} ({host.ns}) {why}:\n{tail.strip()}")
            time.sleep(0.02)

    def sshd_pid(self, host: SimHost) -> int | None:
        """pid of the host's sshd listener, or None when it is stopped."""
        proc = self._sshd.get(host.name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def start_sshd(self, host: SimHost) -> None:
        """Start the host's sshd (no-op when running) and wait until it listens."""
        with self._lock:
            if self.sshd_pid(host) is None:
                self._spawn_sshd(host)
                self._wait_listening(host)

    def stop_sshd(self, host: SimHost) -> None:
        """Stop the listener: new connections are refused. Sessions already open live on, as on a real host."""
        with self._lock:
            proc = self._sshd.get(host.name)
            if proc is None or proc.poll() is not None:
                return
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def regenerate_host_key(self, host: SimHost) -> str:
        """Give the host a new host key and restart its sshd; known_hosts keeps the old key. Returns the new key."""
        self.stop_sshd(host)
        self._install_host_key(host, *_ed25519_keypair(f"root@{host.name}"))
        self.start_sshd(host)
        return host.host_key_pub

    # ------------------------------------------------------------------ network

    def link_down(self, host: SimHost) -> None:
        """Cut the host's cable (root-side veth down): its address stops answering, nothing is refused."""
        _sh(["ip", "link", "set", host.veth, "down"])
        self._down.add(host.name)

    def link_up(self, host: SimHost) -> None:
        _sh(["ip", "link", "set", host.veth, "up"])
        self._down.discard(host.name)
        # Addresses that failed to resolve while the cable was out stay FAILED in the neighbour tables for a
        # while ("no route to host"): forget them everywhere, as a real host would after its link came back.
        for other in [*self.hosts, *([self.outsider] if self.outsider is not None else [])]:
            _sh(["ip", "-n", other.ns, "neigh", "flush", "all"], check=False)
        _sh(["ip", "neigh", "flush", "dev", self.bridge], check=False)
        self._wait_reaches_peers(host)

    def pin_neighbours(self) -> None:
        """Give every host a permanent ARP entry for every other host (as a lab's static ARP would). Opt-in, for
        large clusters: with 64 namespaces on 2 cores, a gloo full mesh (64 x 63 connections at once) while 128
        Python processes start leaves ARP replies unanswered past the kernel's 3 s of retries, and connections fail
        with "No route to host" though every host is up: a limit of the test bed, not of a lab."""
        macs = {}
        for host in self.hosts:
            out = _sh(["ip", "-n", host.ns, "-o", "link", "show", IFACE]).stdout
            macs[host.name] = re.search(r"link/ether (\S+)", out).group(1)
        for host in self.hosts:
            _ip_batch([f"neigh replace {o.address} lladdr {macs[o.name]} dev {IFACE} nud permanent"
                       for o in self.hosts if o is not host], ns=host.ns)

    def _wait_reaches_peers(self, host: SimHost, timeout: float = 15) -> None:
        """Until every peer answers the host on TCP (a connection, or a refusal when its sshd is stopped): the next
        test then starts on a healed link."""
        probe = ("import socket, sys\nbad = []\nfor a in sys.argv[1:]:\n    try:\n"
                 "        socket.create_connection((a, 22), timeout=2).close()\n    except ConnectionRefusedError:\n"
                 "        pass\n    except OSError:\n        bad.append(a)\nprint(' '.join(bad))\n")
        peers = [h.address for h in self.hosts if h is not host and h.name not in self._down]
        deadline = time.monotonic() + timeout
        while peers:
            peers = self.run(host, [sys.executable, "-c", probe, *map(str, peers)], check=False, timeout=timeout).stdout.split()
            if not peers or time.monotonic() > deadline:
                return
            time.sleep(0.3)

    # ------------------------------------------------------------------ commands

    def _enter_argv(self, host: SimHost, argv: Sequence[str], env: dict[str, str] | None) -> list[str]:
        base = {"HOME": self.home_mountpoint, "PATH": SESSION_PATH, "USER": "root", "LOGNAME": "root",
                "SHELL": "/bin/sh", "LANG": os.environ.get("LANG", "C.UTF-8")}
        base.update(env or {})
        envs = ["/usr/bin/env", "-i"] + [f"{k}={v}" for k, v in base.items()]
        anchor = self._anchors.get(host.name)
        if anchor is None:  # the outsider: its network namespace only
            return ["ip", "netns", "exec", host.ns] + envs + list(argv)
        pid = anchor.pid
        # cd after entering: nsenter --wd would resolve the path in the caller's mount namespace (the real /root).
        return _pinned(host.cpus, ["nsenter", "-t", str(pid), "-n", "-m", "-u", "--"] + envs
                       + ["/bin/sh", "-c", 'cd "$HOME" && exec "$@"', "sh"] + list(argv))

    def run(
        self, host: SimHost, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
        input: str | None = None, env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run argv inside the host (net, mount and UTS namespace of its sshd: private ~, /tmp, /etc/hosts),
        in $HOME, with the environment an ssh session gets (plus `env`). For the outsider: its net ns only."""
        full = self._enter_argv(host, argv, env)
        proc = subprocess.run(full, input=input, capture_output=True, text=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL)
        proc.args = list(argv)
        if check and proc.returncode != 0:
            raise ClusterCommandError(host.name, proc)
        return proc

    def popen(self, host: SimHost, argv: Sequence[str], *, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        """Like `run`, without waiting: e.g. a background process the test kills or checks for orphans."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self._enter_argv(host, argv, env), **kwargs)

    def ssh_argv(self, host: SimHost, remote_argv: Sequence[str], *, options: Sequence[str] = (),
                 user: str = "root") -> list[str]:
        """An OpenSSH command line running remote_argv (each word quoted for the remote shell) on the host, with
        the controller key and this cluster's known_hosts only (no ~/.ssh/config, no agent), strict, batch."""
        opts = [
            "BatchMode=yes", "StrictHostKeyChecking=yes", f"UserKnownHostsFile={self.known_hosts}",
            "GlobalKnownHostsFile=/dev/null", "IdentitiesOnly=yes", "IdentityAgent=none",
            "ConnectTimeout=5", "LogLevel=ERROR", "ControlMaster=no", "ControlPath=none", *options,
        ]
        argv = ["ssh", "-F", "/dev/null", "-i", str(self.controller_key), "-p", str(host.port)]
        for opt in opts:
            argv += ["-o", opt]
        return argv + ["-l", user, host.address, "--", shlex.join(list(remote_argv))]

    def processes(self, host: SimHost) -> list[tuple[int, str]]:
        """(pid, cmdline) of every process in the host's net namespace except its sshd listener."""
        keep = self._own_pids(host)
        out = []
        for pid in _netns_pids(host.ns):
            if pid in keep:
                continue
            cmd = _cmdline(pid)
            if cmd is not None and _proc_state(pid) not in ("Z", "X"):
                out.append((pid, cmd))
        return out

    def kill_strays(self, host: SimHost) -> None:
        """SIGKILL every process of the host except the testbed's own (anchor, sshd listener); with containers,
        every container of the host is removed first."""
        if self.containers:
            self.remove_containers(host)
        _kill_netns(host.ns, keep=self._own_pids(host))

    def _own_pids(self, host: SimHost) -> set[int]:
        """The testbed's own processes in a host: its sshd listener and the namespace anchor."""
        return {proc.pid for proc in (self._sshd.get(host.name), self._anchors.get(host.name))
                if proc is not None and proc.poll() is None}

    def restore(self, hosts: Sequence[SimHost] | None = None, *, kill_strays: bool = True) -> None:
        """Undo what tests do to hosts: link up, original host key, sshd running, (stray processes killed)."""
        for host in hosts if hosts is not None else self.hosts:
            if host.name in self._down:
                self.link_up(host)
            original_private, original_public = self._original_keys[host.name]
            if host.host_key_pub != original_public:
                self.stop_sshd(host)
                self._install_host_key(host, original_private, original_public)
            self.start_sshd(host)
            if kill_strays:
                self.kill_strays(host)
        if self.outsider is not None and kill_strays:
            _kill_netns(self.outsider.ns)

    # ------------------------------------------------------------------ users

    def add_user(self, name: str, *, password: str | None = None, sudo: bool = False, torch: bool = False,
                 groups: Sequence[str] = ()) -> str:
        """Add a non-root login user to every host; returns its home directory as the hosts see it.

        The user logs in with the controller key. Each host gets private copies of /etc/passwd, /etc/group and
        /etc/shadow (plus /etc/sudoers granting `name ALL=(ALL:ALL) ALL` when `sudo`, which needs sudo installed),
        bind-mounted in its mount namespace: the real machine's files are never touched. `password` (for sudo)
        goes to `openssl passwd` on stdin, never on a command line. The home is /tmp/home-<name> inside the host
        (its private /tmp). Users add up: each call keeps the users added before. Raises ClusterError when the name
        is taken or sudo is asked for but not installed. `groups`: supplementary groups the user is a member of on every
        host (made there, in the private /etc/group, when no host has them yet), as an admin's `usermod -aG` makes it.

        `torch=True`: the user can run `self.python` (torch's interpreter, bound under root's home /root, which is
        0700). Every host's home becomes 0711: anyone may pass through /root to a path whose name they know, nobody
        may list or write it (sshd's StrictModes still accepts root's key). Only the binds under it (e.g. /root/.pyenv,
        read-only) are meant to be reached: what root writes in its home is as open as its own mode makes it.
        ClusterUnavailable when the interpreter's own directories do not let other users through.

        With containers, the user can run podman rootless: a range of 65536 subordinate ids of its own in private
        copies of /etc/subuid and /etc/subgid, and /run/user/<uid> (its podman's runtime directory, as a login
        would make it); its images and containers are in ~/.local/share/containers.
        """
        if not re.match(r"^[a-z_][a-z0-9_-]{0,30}$", name) or name == "root":
            raise ValueError(f"bad user name {name!r}")
        private = self.hosts[0].root / "tmp" / ".mnft-users"  # the users added before: the hosts' copies hold them all

        def current(target: str) -> str:
            copy = private / os.path.basename(target)
            return (copy if copy.is_file() else Path(target)).read_text()

        users = {line.split(":", 1)[0]: line for line in current("/etc/passwd").splitlines() if line}
        if name in users:
            raise ClusterError(f"user {name} exists on this machine or was added already: pick another name")
        if sudo and not (shutil.which("sudo") and os.path.exists("/etc/sudoers")):
            raise ClusterUnavailable("add_user(sudo=True) needs sudo installed (apt-get install sudo)")
        if torch:
            self._python_for_everyone()
        taken = {int(line.split(":")[2]) for line in users.values() if line.count(":") >= 6}
        uid = next(u for u in range(4200, 60000) if u not in taken)
        home = f"/tmp/home-{name}"
        hashed = "*"  # no password login; "!" would lock the account, and sshd then refuses its key too
        if password is not None:
            hashed = _sh(["openssl", "passwd", "-6", "-stdin"], input=password + "\n").stdout.strip()
        group_lines = current("/etc/group").rstrip("\n").split("\n") + [f"{name}:x:{uid}:"]
        for extra in groups:
            at = next((i for i, line in enumerate(group_lines) if line.split(":", 1)[0] == extra), None)
            if at is None:
                gids = {int(line.split(":")[2]) for line in group_lines if line.count(":") >= 3 and line.split(":")[2].isdigit()}
                group_lines.append(f"{extra}:x:{next(g for g in range(4100, 4200) if g not in gids)}:{name}")
            else:
                group_lines[at] += ("," if not group_lines[at].endswith(":") else "") + name
        files = {
            "/etc/passwd": current("/etc/passwd").rstrip("\n") + f"\n{name}:x:{uid}:{uid}::{home}:/bin/sh\n",
            "/etc/group": "\n".join(group_lines) + "\n",
            "/etc/shadow": current("/etc/shadow").rstrip("\n") + f"\n{name}:{hashed}:19000:0:99999:7:::\n",
        }
        modes = {"/etc/passwd": 0o644, "/etc/group": 0o644, "/etc/shadow": 0o640, "/etc/sudoers": 0o440}
        if sudo:
            before = (private / "sudoers").read_text() if (private / "sudoers").is_file() else "Defaults env_reset\nroot ALL=(ALL:ALL) ALL\n"
            files["/etc/sudoers"] = before + f"{name} ALL=(ALL:ALL) ALL\n"
        if self.containers:  # rootless podman: subordinate ids of its own (none overlaps a uid the test bed hands out)
            for target in ("/etc/subuid", "/etc/subgid"):
                if os.path.isfile(target):  # the mount point (shadow's own, often empty); without it: no rootless podman
                    lines = [line for line in current(target).splitlines() if line]
                    lines.append(f"{name}:{SUBID_FIRST + (uid - 4200) * SUBID_COUNT}:{SUBID_COUNT}")
                    files[target], modes[target] = "\n".join(lines) + "\n", 0o644
        public = self.controller_key.with_suffix(".pub").read_text()
        for host in self.hosts:
            # under the host's private /tmp: the one place both sides see (inside, as /tmp/.mnft-users)
            etc = host.root / "tmp" / ".mnft-users"
            for target, text in files.items():
                _write(etc / os.path.basename(target), text, modes[target])
            os.chmod(etc, 0o755)
            host_home = host.root / "tmp" / f"home-{name}"
            _write(host_home / ".ssh" / "authorized_keys", public, 0o600)
            for path, mode in ((host_home, 0o700), (host_home / ".ssh", 0o700), (host_home / ".ssh" / "authorized_keys", 0o600)):
                os.chown(path, uid, uid)
                os.chmod(path, mode)
            mounts = [["mount", "--bind", f"/tmp/.mnft-users/{os.path.basename(target)}", target] for target in files]
            pid = str(self._anchors[host.name].pid)
            for argv in mounts:
                _sh(["nsenter", "-t", pid, "-m", "--", *argv])
            if torch:
                os.chmod(host.home, 0o711)
            if self.containers:
                runtime = host.root / "run" / "user" / str(uid)
                runtime.mkdir(parents=True, exist_ok=True)
                os.chown(runtime, uid, uid)
                os.chmod(runtime, 0o700)
        self._users[name] = (uid, home)
        return home

    def _python_for_everyone(self) -> None:
        """Check that other users may run the hosts' python once through the home: every directory from the
        interpreter's top under the home (as bound into the hosts) down to it is o+x, the interpreter o+rx."""
        home = self.home_mountpoint.rstrip("/")
        for python in (self.python, os.path.realpath(self.python)):
            if not python.startswith(home + "/"):
                continue
            parts = python[len(home) + 1:].split("/")
            for depth in range(1, len(parts) + 1):
                path = os.path.join(home, *parts[:depth])
                need = 0o005 if depth == len(parts) else 0o001
                if os.stat(path).st_mode & need != need:
                    raise ClusterUnavailable(f"add_user(torch=True): {path} does not let other users through "
                                             f"(mode {os.stat(path).st_mode & 0o7777:o}), so they cannot run {self.python}")

    # ------------------------------------------------------------------ containers (podman, one per host)

    def _storage(self, host: SimHost) -> Path:
        """The host's podman storage here: bound on /var/lib/containers inside the host."""
        return host.root / "containers" / "lib"

    def _write_containers(self, host: SimHost) -> None:
        """The host's /etc/containers (this machine's, with the test bed's containers.conf and storage.conf) and its
        empty storage."""
        etc = host.root / "containers" / "etc"
        shutil.copytree(CONTAINERS_ETC, etc, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns("containers.conf", "containers.conf.d", "storage.conf", "libpod.conf"))
        _write(etc / "containers.conf", containers_conf())
        _write(etc / "storage.conf", storage_conf())
        self._storage(host).mkdir(parents=True, exist_ok=True)
        os.makedirs(CONTAINERS_STORAGE, exist_ok=True)  # the mount point: podman's own default place, as podman makes it

    def _need_containers(self) -> None:
        if not self.containers:
            raise ClusterError("this cluster's hosts have no podman of their own: Cluster.create(..., containers=True)")

    def podman(self, host: SimHost, *args: str, check: bool = True, timeout: float = 120,
               input: str | None = None) -> subprocess.CompletedProcess:
        """`podman ARGS…` run in the host (as `run` runs it): its /etc/containers, its storage, its network."""
        self._need_containers()
        return self.run(host, ["podman", *args], check=check, timeout=timeout, input=input)

    def load_image(self, hosts: Sequence[SimHost], image: Any, *, timeout: float = 300) -> None:
        """Put an image into the storage of each of `hosts` (in parallel; the others stay without it): `image` is an
        `images.Image` or the path here of a docker-archive (what `podman save` writes by default).

        The archive goes in on the command's stdin (`podman pull docker-archive:/dev/stdin`), so it need not be
        visible inside the hosts. Not `podman load -i`: that first tries the archive as an OCI archive, unpacking
        all of it into a temporary directory (≈ 3 s per GB) before it gives up. ClusterCommandError when it fails."""
        self._need_containers()
        archive = Path(getattr(image, "archive", image))
        argv = ["podman", "pull", "--quiet", "docker-archive:/dev/stdin"]

        def one(host: SimHost) -> None:
            with open(archive, "rb") as stdin:
                proc = self.popen(host, argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    out, err = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
            if proc.returncode != 0:
                raise ClusterCommandError(host.name, subprocess.CompletedProcess(argv, proc.returncode, out, err))

        _each(hosts, one)

    def share_image(self, hosts: Sequence[SimHost], image: Any) -> None:
        """Give `hosts` (the others stay without it) an image from a read-only image store this machine keeps, as a
        lab's image store on a shared disk: podman's `additionalimagestores` in their storage.conf. Instant, nothing
        copied, nothing to delete at teardown; the store is made the first time (as long as a `load_image`) and kept
        for later sessions (`image_store`). The hosts run it, `image exists`, `inspect`, `save` and `tag` it (a name
        in the host's own storage) as any image; `rmi` fails there ("read-only image"): `load_image` for an image a
        test removes.
        `image` is an `images.Image`; its store is under images.CACHE/stores, which every host sees."""
        import images

        self._need_containers()
        stores = images.CACHE / "stores"
        if re.match(r"^/(tmp|root)(/|$)", os.path.realpath(stores)):
            raise ClusterError(f"share_image: {stores} is under /tmp or /root, which every host has a private one of")
        store = str(image_store(image, stores))
        for host in hosts:
            self._stores.setdefault(host.name, [])
            if store not in self._stores[host.name]:
                self._stores[host.name].append(store)
                _write(host.root / "containers" / "etc" / "storage.conf", storage_conf(self._stores[host.name]))

    def remove_containers(self, host: SimHost) -> None:
        """Remove every container of the host, root's and each user's (`podman rm --all --force --time 0`), then
        SIGKILL whatever still runs in the cgroup of one of root's (its conmon killed, say) and remove those cgroups
        (podman leaves a killed conmon's). Never raises."""
        ids = self.container_ids(host)
        rm = ["podman", "rm", "--all", "--force", "--time", "0"]
        for uid, home in [(0, self.home_mountpoint), *self._users.values()]:
            if uid and not self._user_storage(host, home).is_dir():
                continue
            as_user = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--init-groups", "env", f"HOME={home}"] if uid else []
            try:
                self.run(host, [*as_user, *rm], check=False, timeout=60)
            except Exception:
                pass
        _kill_cgroups(ids)

    def _user_storage(self, host: SimHost, home: str) -> Path:
        """Here, a user's rootless podman storage in the host (~/.local/share/containers)."""
        return self._host_side(host, home) / ".local" / "share" / "containers"

    def container_ids(self, host: SimHost) -> list[str]:
        """The full ids of the containers in the host's storage (running or not), read from here."""
        found = self._storage(host) / "storage" / "overlay-containers"
        return sorted(p.name for p in found.iterdir() if re.fullmatch(r"[0-9a-f]{64}", p.name)) if found.is_dir() else []

    def _remove_storage(self, host: SimHost) -> None:
        """Once the host's namespaces are gone (its mounts with them): unmount what is still mounted under its
        storage in this namespace (nothing, unless a podman ran here with the host's configuration), delete it."""
        for storage in [self._storage(host), *(self._user_storage(host, home) for _, home in self._users.values())]:
            for mount in reversed(_mounts_under(storage)):
                _sh(["umount", "--lazy", mount], check=False)
            shutil.rmtree(storage, ignore_errors=True)

    # ------------------------------------------------------------------ inventory

    def write_inventory(self, path: Path, hosts: list[SimHost] | None = None, **host_overrides: Any) -> Path:
        """Write an mnft inventory for `hosts` (default: all, in order h1…hN; never the outsider).

        Each keyword is an inventory key. A dict value maps host names to per-host values (hosts not named keep
        the default); any other value replaces the default in `vars` (None removes the key). `known_hosts`,
        `master`, `rendezvous_port` and `supervisor` are top-level keys instead (None removes known_hosts). With stand-in GPUs the
        hosts say `device: cpu`: the stand-ins are leased as a real host's GPUs are, and the jobs train on the CPUs
        with this machine's CPU-only torch, as a real host meant to train on its CPUs says in its inventory.
        """
        import yaml

        top: dict[str, Any] = {"known_hosts": str(self.known_hosts)}
        defaults: dict[str, Any] = {
            "user": "root", "port": 22, "identity": str(self.controller_key), "python": self.python,
            "iface": IFACE, "workdir": f"{self.home_mountpoint.rstrip('/')}/mnft", "slots": 1, "connection": "ssh",
        }
        if self.gpus:
            defaults["device"] = "cpu"
        chosen = list(hosts) if hosts is not None else list(self.hosts)
        entries: dict[str, dict[str, Any]] = {h.name: {"address": h.address} for h in chosen}
        for key, value in host_overrides.items():
            if key in ("known_hosts", "master", "rendezvous_port", "supervisor"):
                top[key] = value
            elif isinstance(value, dict):
                unknown = set(value) - set(entries)
                if unknown:
                    raise ValueError(f"{key}: no such host(s) in this inventory: {sorted(unknown)}")
                for name, one in value.items():
                    entries[name][key] = one
            else:
                defaults[key] = value
        doc = {k: v for k, v in top.items() if v is not None}
        doc["vars"] = {k: v for k, v in defaults.items() if v is not None}
        doc["hosts"] = entries
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
        return path

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """Kill every process in every namespace (with containers: remove every container first), delete namespaces,
        veths and bridge, and the hosts' container storage. Idempotent, never raises; other files in the workdir are
        left for post-mortems."""
        if self._torn_down:
            return
        self._torn_down = True
        try:
            atexit.unregister(self.teardown)
        except Exception:
            pass
        try:
            if self.containers:  # while the hosts' namespaces are there to run podman in
                _each(self.hosts, self.remove_containers)
            for proc in [*self._sshd.values(), *self._anchors.values()]:
                if proc.poll() is None:
                    proc.kill()
            for host in self._all():
                try:
                    _kill_netns(host.ns)
                except Exception:
                    pass
            for proc in [*self._sshd.values(), *self._anchors.values()]:
                try:
                    proc.wait(timeout=5)
                except Exception:
                    pass
            _remove_objects([h.ns for h in self._all()], [h.veth for h in self._all()] + [self.bridge])
            if self.containers:
                for host in self.hosts:
                    self._remove_storage(host)
        except Exception as exc:  # never raise: teardown runs in finally blocks and at exit
            print(f"testbed: teardown of {self.prefix} incomplete: {exc}", file=sys.stderr)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    # ------------------------------------------------------------------ stale leftovers

    @classmethod
    def cleanup_stale(cls, prefix_family: str = DEFAULT_FAMILY) -> list[str]:
        """Remove namespaces, veths and bridges named `<prefix_family>…-…` whose owning process is gone
        (a crashed run). Clusters whose owner still runs are left alone. Returns the prefixes removed."""
        if not re.match(r"^[a-z][a-z0-9]*$", prefix_family):
            raise ValueError(f"bad prefix family {prefix_family!r}")
        pattern = re.compile(rf"^({re.escape(prefix_family)}[a-z0-9]*)-(br|h\d+|out|v\d+|vo)$")
        groups: dict[str, dict[str, list[str]]] = {}
        for ns in _list_netns():
            m = pattern.match(ns)
            if m and (m.group(2) == "out" or m.group(2).startswith("h")):
                groups.setdefault(m.group(1), {"ns": [], "links": []})["ns"].append(ns)
        aliases: dict[str, str] = {}
        for name, alias in _list_links():
            m = pattern.match(name)
            if m and (m.group(2) == "br" or m.group(2).startswith("v")):
                groups.setdefault(m.group(1), {"ns": [], "links": []})["links"].append(name)
                if m.group(2) == "br":
                    aliases[m.group(1)] = alias
        removed = []
        for prefix, objects in sorted(groups.items()):
            owner = _ALIAS_RE.match(aliases.get(prefix, ""))
            if owner and _start_time(int(owner.group(1))) == int(owner.group(2)):
                continue  # its creator is alive: not stale
            for ns in objects["ns"]:
                _kill_netns(ns)
            _remove_objects(objects["ns"], objects["links"])
            removed.append(prefix)
        return removed


STOCK_SSHD_LIMITS = ("MaxStartups 10:30:100", "MaxSessions 10")  # OpenSSH's defaults, as Debian/Ubuntu ship them
TUNED_SSHD_LIMITS = ("MaxStartups 100:30:200", "MaxSessions 64")


def _sshd_config(*, stock: bool = False) -> str:
    """The sshd_config of every host; `stock`: OpenSSH's connection limits (a lab's sshd), else raised ones."""
    return "\n".join([
        "# mnft testbed: one sshd per simulated host, inside its private mount namespace",
        "Port 22",
        "ListenAddress 0.0.0.0",
        "HostKey /etc/ssh/ssh_host_ed25519_key",
        "PidFile /run/sshd.pid",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "AuthorizedKeysFile .ssh/authorized_keys",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "UseDNS no",
        "PrintMotd no",
        "StrictModes yes",
        "AcceptEnv LANG LC_*",
        # Tuned: mnft's tests fan out many sessions at once, and the default 10:30:100 drops unauthenticated
        # connections at random beyond 10. Stock: exactly that default, to test and measure mnft's own pacing.
        *(STOCK_SSHD_LIMITS if stock else TUNED_SSHD_LIMITS),
        "Subsystem sftp /usr/lib/openssh/sftp-server",
        "",
    ])


def _default_prefix() -> str:
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    pid, tag = os.getpid(), ""
    for _ in range(3):
        pid, digit = divmod(pid, 36)
        tag = alphabet[digit] + tag
    # secrets, not random: a test that seeds random (transformers' set_seed does) made a fresh cluster draw the
    # session cluster's prefix
    return DEFAULT_FAMILY + tag + "".join(secrets.choice(alphabet) for _ in range(2))


def _list_netns() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links() -> list[tuple[str, str]]:
    """(name, alias) of every link in the root namespace."""
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    links = []
    for line in out.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m:
            alias = re.search(r"\balias (\S+)", line)
            links.append((m.group(1), alias.group(1) if alias else ""))
    return links


def _remove_objects(namespaces: Sequence[str], links: Sequence[str]) -> None:
    existing_ns = set(_list_netns())
    existing_links = {name for name, _ in _list_links()}
    lines = [f"netns del {ns}" for ns in namespaces if ns in existing_ns]
    lines += [f"link del {name}" for name in links if name in existing_links]
    if lines:
        _ip_batch(lines, force=True)


class _allocation_lock:
    """Serialise subnet choice + bridge creation between concurrent testbeds on one machine."""

    def __enter__(self) -> None:
        directory = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
        self._fd = os.open(os.path.join(directory, "mnft-testbed.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _free_subnet(prefix: str) -> ipaddress.IPv4Network:
    used = _used_ipv4_networks()
    start = sum(prefix.encode()) * 7 % 250
    for i in range(254):
        k = (start + i) % 254 + 1
        net = ipaddress.IPv4Network(f"{SUBNET_FIRST_OCTETS}.{k}.0/24")
        if not any(net.overlaps(other) for other in used):
            return net
    raise ClusterError(f"no free /24 left in {SUBNET_FIRST_OCTETS}.0.0/16")
