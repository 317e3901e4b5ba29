"""What a check produces: its options, the problems it found (each with its fix), and the report that holds
them with every host's facts; also the host every other is compared with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mnft.core.errors import ExitCode, InputError
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.settings import Inventory

GIB = 1024**3


@dataclass(frozen=True)
class Need:
    """A module the job needs on every host, where the job imports it, and the distribution that provides it."""

    module: str  # a top-level module name: "peft"
    where: str  # "train.py:12", or the job file's `requires:`
    dist: str | None = None  # the distribution that provides it, where this machine knows ("PyYAML" for yaml)
    optional: bool = False  # the job changes sys.path itself: a miss may be a false alarm (a warning)

    def problem(self, host: str, python: str) -> "Problem":
        package = self.dist or self.module
        return Problem(host, "module", f"{self.module} is not importable by {python} (imported at {self.where})",
                       f"add {package} to the lock and run `mnft provision` (or install {package} into that Python)",
                       "warning" if self.optional else "error")


@dataclass(frozen=True)
class CheckOptions:
    min_free_gb: float = 2.0
    max_clock_skew_s: float = 2.0
    port: int | None = None  # rendezvous port; default: the inventory's
    network: bool = True
    network_timeout: float = 3.0
    find_free_port: bool = False  # train: take the next free port on the master when the rendezvous port is taken
    port_search: int = 20
    code: bool = True  # hash each host's workdir (when it exists) and compare it with the local tree
    code_src: str | None = None  # the local tree; default: source.default_source() (the git top level)
    required_files: tuple[str, ...] = ()  # files every host must hold (a job's script outside the synced tree)
    modules: tuple[Need, ...] = ()  # modules the job imports that every host's Python must resolve (mnft.run.needs)
    own_devices: dict[str, tuple[int, ...]] | None = None  # train --gpus: host -> the GPUs the run took (others are others')
    image: str | None = None  # the job's container image (reference or .sif path): Python, torch and the job's modules looked up inside it
    image_id: str | None = None  # the image's id the run's first check verified: every later check of the run (a re-check before a
    #                              restart, a spare, --resume, a requeued Slurm attempt) requires this id on every host

    def __post_init__(self) -> None:
        """Bad arguments are bad input (exit 2), refused before any host is touched."""
        if self.port is not None and (isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535):
            raise InputError(f"--port: {self.port!r} is not a port number (1-65535)")
        for name, flag, low, strict in (
            ("min_free_gb", "--min-free-gb", 0, False),
            ("max_clock_skew_s", "--max-clock-skew", 0, True),
            ("network_timeout", "network_timeout", 0, True),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or (value <= low if strict else value < low):
                raise InputError(f"{flag}: {value!r} must be a number {'>' if strict else '≥'} {low}")
        if isinstance(self.port_search, bool) or not isinstance(self.port_search, int) or self.port_search < 1:
            raise InputError(f"port_search: {self.port_search!r} must be a whole number ≥ 1")


@dataclass(frozen=True)
class Problem:
    host: str  # host name, or "*" for the whole cluster
    field: str
    message: str
    fix: str  # "" where nothing needs doing (a note): no fix line is printed
    severity: str = "error"  # "error" fails the check; "warning" and "note" are shown only


@dataclass
class Reach:
    """A host's attempt to open a TCP connection to the master's rendezvous port."""

    ok: bool
    source: str | None = None  # the address the connection left from
    iface: str | None = None  # the interface that address belongs to
    error: str | None = None
    seconds: float | None = None


@dataclass
class CheckReport:
    inventory: Inventory
    outcomes: dict[str, HostResult]  # connect/probe outcome per host
    facts: dict[str, dict]
    master_addr: str | None = None
    port: int | None = None
    port_free: bool | None = None
    port_error: str | None = None
    reach: dict[str, Reach] = field(default_factory=dict)
    skew: dict[str, float] = field(default_factory=dict)  # host clock minus controller clock, seconds
    code: dict[str, dict] = field(default_factory=dict)  # host -> {hash, exists, matches, differing} (mnft.sync.mirror)
    shared: dict[str, tuple[str, ...]] | None = None  # host -> the hosts that see its workdir too (None: not looked)
    problems: list[Problem] = field(default_factory=list)
    supervision: dict | None = None  # `mnft check`: where this user's detached runs are supervised, or why none can be (mnft.run.supervisor)

    def status(self, name: str) -> str:
        outcome = self.outcomes[name]
        if outcome.status is not Status.OK:
            return outcome.status.value
        if any(p.host == name and p.severity == "error" for p in self.problems):
            return Status.FAILED.value
        return Status.OK.value

    def exit_code(self) -> ExitCode:
        statuses = [self.status(h.name) for h in self.inventory.hosts]
        if any(s in (Status.UNREACHABLE.value, Status.HOST_KEY_REJECTED.value) for s in statuses):
            return ExitCode.UNREACHABLE
        if any(s == Status.FAILED.value for s in statuses) or any(p.severity == "error" for p in self.problems):
            return ExitCode.FAILED  # a host that did not pass never exits 0, whatever made it fail
        return ExitCode.OK

    def to_json(self) -> dict[str, Any]:
        hosts = {}
        for host in self.inventory.hosts:
            outcome = self.outcomes[host.name]
            hosts[host.name] = {
                "rank": host.rank,
                "outcome": self.status(host.name),
                "error": outcome.error or None,
                "facts": self.facts.get(host.name),
                "reach": asdict(self.reach[host.name]) if host.name in self.reach else None,
                "clock_skew_s": self.skew.get(host.name),
                "code_hash": self.code.get(host.name),
                "problems": [asdict(p) for p in self.problems if p.host == host.name],
            }
        return {
            "inventory": str(self.inventory.path) if self.inventory.path else None,
            "master": self.inventory.master_name,
            "master_addr": self.master_addr,
            "reference": reference_host(self.inventory, self.facts),  # the host versions are compared with
            "rendezvous_port": self.port,
            "port_free": self.port_free,
            "exit_code": int(self.exit_code()),
            "hosts": hosts,
            "problems": [asdict(p) for p in self.problems if p.host == "*"],
            **({"supervision": self.supervision} if self.supervision is not None else {}),
        }


def reference_host(inventory: Inventory, facts: dict[str, dict]) -> str | None:
    """The host every other is compared with: the master, or when its facts are missing (unreachable) the first
    host that answered, so that version drift is still found."""
    if inventory.master_name in facts:
        return inventory.master_name
    return next((h.name for h in inventory.hosts if h.name in facts), None)


def reference_label(inventory: Inventory, name: str | None) -> str:
    if name == inventory.master_name:
        return "the master's"
    return f"{name}'s (the first host that answered; the master {inventory.master_name} did not)"
