"""A real Slurm inside the simulated cluster (tests/testbed.py): one munged, slurmctld in its own network and UTS
namespace (the cluster's outsider namespace, hostname `ctl`), one slurmd per simulated host inside that host's
namespaces, started with its node name. Debian's slurmctld, slurmd, slurm-client and munge (22.05) are needed:

    apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge

Every file lives in one state directory outside /tmp and /root (the hosts have their own /tmp and /root, but see
the machine's /var): slurm.conf, cgroup.conf, the munge key and socket, the controller's state, every daemon's
log. Clients find the configuration by SLURM_CONF (`Slurm.env`), so a command run in a host with
`cluster.run(host, argv, env=slurm.env)` talks to this Slurm. srun and salloc listen on every address of their
namespace: run them inside a host, not in the controller's namespace.

Facts that shaped the configuration (Slurm 22.05.8): slurmd always loads a cgroup plugin and its autodetection
fails in a network namespace (`CgroupPlugin=cgroup/v1` with `ProctrackType=proctrack/linuxproc` and
`TaskPlugin=task/none` works; no cgroup is created); a requeued job waits `cred_expire` (120 s by default, 10 s
here) before it may start again, and then for the backfill scheduler's next pass (every 30 s by default, every
second here: nothing else starts a job that became eligible by waiting); a node whose slurmd is gone is marked
down once it has not answered for SlurmdTimeout (10 s here; slurmctld pings every SlurmdTimeout/3, and a ping of
a dead slurmd fails after MessageTimeout, 5 s here): ~17 s after its slurmd is killed; slurmctld checks that its
own hostname is SlurmctldHost.

    slurm = Slurm.start(cluster, partition="debug")    # ~1 s once the packages are installed
    cluster.run(cluster.hosts[0], ["sinfo"], env=slurm.env)
    slurm.kill_slurmd(cluster.hosts[1]); slurm.start_slurmd(cluster.hosts[1])
    slurm.stop()                                       # every daemon by its pid; the cluster's teardown does the rest
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed import Cluster, ClusterUnavailable, SimHost

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
PACKAGES = "apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge"
STATE_ROOT = Path("/var/tmp")  # seen by every simulated host (they cover /tmp, /root and /run only)
CONTROLLER_NAME = "ctl"
SLURMD_TIMEOUT = 10  # seconds before slurmctld marks a silent node DOWN (a live slurmd answers a ping in milliseconds)
CRED_EXPIRE = 10  # seconds a requeued job waits before it may start again (Slurm's default: 120, its minimum 5); also
#                   how long a step's credential is valid: a step launch slower than that under load would fail
BACKFILL_INTERVAL = 1  # seconds between backfill passes (Slurm's default: 30), which start a requeued job once eligible
# seconds an RPC may take (Slurm's default: 10; a 3-node Slurm answers in milliseconds). A ping of a node whose slurmd
# is gone fails only after it (connections refused are retried until then), and a node is marked down after two
# failed pings: a killed slurmd is noticed in ~17 s with 5, ~27 s with 10
MESSAGE_TIMEOUT = 5


def check_prerequisites() -> None:
    """Raise ClusterUnavailable with one line when this machine cannot run a real Slurm."""
    missing = [b for b in BINARIES if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        raise ClusterUnavailable(f"Slurm is not installed (missing {', '.join(missing)}): {PACKAGES}")


def _which(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def slurm_conf(*, name: str, state: Path, controller_address: str, nodes: list[tuple[str, str]], partition: str, cpus: int) -> str:
    node_lines = "".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN\n" for n, a in nodes)
    return f"""# mnft test bed: a real Slurm in the simulated cluster (tests/slurmbed.py)
ClusterName={name}
SlurmctldHost={CONTROLLER_NAME}({controller_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge.socket,cred_expire={CRED_EXPIRE}
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval={BACKFILL_INTERVAL}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT}
SlurmctldTimeout=30
MessageTimeout={MESSAGE_TIMEOUT}
KillWait=5
InactiveLimit=0
MinJobAge=600
JobRequeue=1
JobCompType=jobcomp/filetxt
JobCompLoc={state}/jobcomp.txt
{node_lines}PartitionName={partition} Nodes={','.join(n for n, _ in nodes)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    cluster: Cluster
    state: Path
    partition: str
    munged: subprocess.Popen | None = None
    slurmctld: subprocess.Popen | None = None
    slurmds: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a command needs in its environment to use this Slurm."""
        return {"SLURM_CONF": str(self.conf)}

    @classmethod
    def start(cls, cluster: Cluster, *, partition: str = "debug", hosts: list[SimHost] | None = None) -> Slurm:
        """munged, slurmctld in the outsider's network namespace (its own UTS: hostname ctl), one slurmd per host;
        returns once every node is idle."""
        check_prerequisites()
        if cluster.outsider is None:
            raise ValueError("the Slurm test bed runs slurmctld in the cluster's outsider namespace: create it with outsider=True")
        state = STATE_ROOT / f"{cluster.prefix}-slurm"
        shutil.rmtree(state, ignore_errors=True)
        for sub in ("ctld", "spool"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(state, 0o755)
        hosts = hosts if hosts is not None else cluster.hosts
        slurm = cls(cluster, state, partition)
        try:
            slurm._write_config(hosts)
            slurm._start_munged()
            slurm._start_slurmctld()
            for host in hosts:
                slurm.start_slurmd(host, wait=False)
            slurm.wait_idle([h.name for h in hosts])
        except BaseException:
            slurm.stop()
            raise
        return slurm

    def _write_config(self, hosts: list[SimHost]) -> None:
        assert self.cluster.outsider is not None
        self.conf.write_text(slurm_conf(name=self.cluster.prefix, state=self.state, controller_address=self.cluster.outsider.address,
                                        nodes=[(h.name, h.address) for h in hosts], partition=self.partition, cpus=2))
        (self.state / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        key = self.state / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def _start_munged(self) -> None:
        socket = self.state / "munge.socket"
        self.munged = subprocess.Popen(
            [_which("munged"), "-F", "--force", f"--socket={socket}", f"--key-file={self.state / 'munge.key'}",
             f"--pid-file={self.state / 'munged.pid'}", f"--log-file={self.state / 'munged.log'}",
             f"--seed-file={self.state / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait(lambda: socket.exists(), 10, lambda: f"munged did not start: {_tail(self.state / 'munged.log')}")

    def _start_slurmctld(self) -> None:
        assert self.cluster.outsider is not None
        argv = ["ip", "netns", "exec", self.cluster.outsider.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {CONTROLLER_NAME} && exec "$@"', "sh", _which("slurmctld"), "-D", "-i", "-f", str(self.conf)]
        # ip netns exec, unshare and sh exec without forking: the Popen pid is slurmctld's
        self.slurmctld = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True, env={**os.environ, **self.env})

    def start_slurmd(self, host: SimHost, *, wait: bool = True) -> None:
        """slurmd for this host, inside its namespaces, as node `host.name` (foreground: the Popen pid is slurmd's)."""
        self.slurmds[host.name] = self.cluster.popen(host, [_which("slurmd"), "-D", "-N", host.name, "-f", str(self.conf)], env=self.env,
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if wait:
            self.wait_idle([host.name])

    def kill_slurmd(self, host: SimHost) -> None:
        """SIGKILL the host's slurmd (its job steps live on, unreachable, as on a node that lost its daemon)."""
        proc = self.slurmds.pop(host.name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def scontrol(self, *args: str) -> str:
        return self.client(["scontrol", *args]).stdout

    def client(self, argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command run inside the first host (as a login node would)."""
        return self.cluster.run(self.cluster.hosts[0], argv, env=self.env, check=check, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if len(line.split(None, 1)) == 2)

    def wait_idle(self, names: list[str], timeout: float = 30) -> None:
        _wait(lambda: all(self.node_states().get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in names), timeout,
              lambda: f"Slurm nodes not idle: {self.node_states()}; slurmctld log: {_tail(self.state / 'slurmctld.log')}")

    def reset(self) -> None:
        """After a test: every job cancelled, a killed slurmd started again, every node idle."""
        self.client(["scancel", "--full", "--user=root"], check=False)
        for host in self.cluster.hosts:
            if host.name not in self.slurmds or self.slurmds[host.name].poll() is not None:
                self.start_slurmd(host, wait=False)
        _wait(lambda: not self.client(["squeue", "-h"], check=False).stdout.strip(), 60, lambda: "jobs left: " + self.client(["squeue"], check=False).stdout)
        self.wait_idle([h.name for h in self.cluster.hosts], timeout=90)

    def stop(self) -> None:
        """Stop every daemon by its recorded pid (never by name). Idempotent."""
        for proc in [*self.slurmds.values(), self.slurmctld, self.munged]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in [*self.slurmds.values(), self.slurmctld, self.munged]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.slurmds.clear()


def _wait(ready, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(why())


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no {path.name})"
