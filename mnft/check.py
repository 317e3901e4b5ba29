"""`invoke check`: prove every host can join one training job.

gather() reads facts (one probe per host, in parallel) and tests the network (a short-lived listener on the
master's rendezvous port, a connection to it from every host); evaluate() is pure: facts in, problems out.
"""

from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mnft import probe, pyrun
from mnft.command import Command
from mnft.connection import HostKeyRejected, Unreachable
from mnft.errors import ExitCode, InputError
from mnft.fleet import Fleet, HostResult, Results, Status
from mnft.inventory import Host, Inventory

GIB = 1024**3


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
    fix: str
    severity: str = "error"  # "error" fails the check; "warning" is shown only


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
    code: dict[str, dict] = field(default_factory=dict)  # host -> {hash, exists, matches, differing} (mnft.sync)
    problems: list[Problem] = field(default_factory=list)

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
        if any(p.severity == "error" for p in self.problems):
            return ExitCode.FAILED
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
        }


# ------------------------------------------------------------------------------------------------ reading


def probe_command(host: Host, mode: str, *args: str) -> Command:
    return pyrun.command(host, mode, *args)


def probe_payload() -> bytes:
    return pyrun.payload(probe.source())


def parse_probe(result: HostResult) -> dict | None:
    if not result.ok:
        return None
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result.status = Status.FAILED
        result.error = "the probe printed no JSON: " + (result.tail(1) or "no output")
        return None
    return data if isinstance(data, dict) else None


def gather_facts(fleet: Fleet, hosts: list[Host] | None = None) -> tuple[Results, dict[str, dict], dict[str, float]]:
    """Run the facts probe everywhere. Returns outcomes, facts and each host's clock skew vs this machine."""
    source = probe_payload()
    sent: dict[str, tuple[float, float]] = {}

    def one(host: Host) -> HostResult:
        try:  # connect first: the SSH handshake must not sit inside the window the clock skew is measured in
            fleet.connection(host)
        except (Unreachable, HostKeyRejected):
            pass  # run_one reports it
        before = time.time()
        result = fleet.run_one(host, probe_command(host, "facts", "--workdir", host.workdir), stdin=source)
        sent[host.name] = (before, time.time())
        return result

    results = fleet.map(one, hosts)
    facts, skew = {}, {}
    for result in results:
        data = parse_probe(result)
        if data is not None:
            facts[result.host] = data
            before, after = sent[result.host]
            if isinstance(data.get("clock"), (int, float)):
                total = (data.get("timings") or {}).get("total_s")
                skew[result.host] = clock_skew(data["clock"], before, after, total if isinstance(total, (int, float)) else None)
    return results, facts, skew


def clock_skew(clock: float, before: float, after: float, probe_total: float | None) -> float:
    """The host's clock minus this machine's, from a probe that read its clock as its last step.

    Of the round-trip [before, after], the probe itself ran `probe_total` seconds and read the clock at its end;
    the rest (sending, starting Python, returning the output) is split evenly around it. So the clock was read
    at after - (rtt - probe_total) / 2, not at the midpoint, which would be off by about half the probe's run
    time (a 4.5 s nvidia-smi read as 2.3 s of skew). The error is at most half the non-probe time."""
    rtt = after - before
    if probe_total is None or not 0 <= probe_total <= rtt:
        return round(clock - (before + after) / 2, 3)
    return round(clock - (after - (rtt - probe_total) / 2), 3)


def ipv4_of(facts: dict, iface: str) -> list[str]:
    for entry in facts.get("interfaces") or []:
        if entry.get("name") == iface:
            return [a.split("/")[0] for a in entry.get("ipv4") or []]
    return []


def iface_of_address(facts: dict, address: str) -> str | None:
    for entry in facts.get("interfaces") or []:
        if any(a.split("/")[0] == address for a in entry.get("ipv4") or []):
            return entry.get("name")
    return None


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def master_address(inventory: Inventory, facts: dict | None) -> tuple[str | None, str | None]:
    """The address peers use to reach the master: (address, None) or (None, why not). Never 127.x for peers."""
    master = inventory.master
    multi = len(inventory.hosts) > 1
    if not multi and master.is_local:
        return "127.0.0.1", None
    if facts is None:
        return None, "the master's facts are missing"
    if master.iface:
        addrs = ipv4_of(facts, master.iface)
        if not addrs:
            names = ", ".join(i["name"] for i in facts.get("interfaces") or [])
            return None, f"interface {master.iface!r} has no IPv4 address on the master (it has: {names})"
        return addrs[0], None
    if _is_ipv4(master.address) and not ipaddress.IPv4Address(master.address).is_loopback:
        return master.address, None
    candidates = [
        a.split("/")[0]
        for entry in facts.get("interfaces") or []
        if entry.get("up") and entry.get("name") != "lo"
        for a in entry.get("ipv4") or []
        if not ipaddress.IPv4Address(a.split("/")[0]).is_loopback
    ]
    if len(candidates) == 1:
        return candidates[0], None
    if not candidates:
        return None, "the master has no non-loopback IPv4 address"
    return None, f"the master has several addresses ({', '.join(candidates)}): set 'iface' in the inventory"


def source_address(host: Host, facts: dict | None) -> str | None:
    if host.iface and facts:
        addrs = ipv4_of(facts, host.iface)
        return addrs[0] if addrs else None
    return None


def gather_network(fleet: Fleet, report: CheckReport, options: CheckOptions) -> None:
    """Listen on the master's rendezvous port for a few seconds; connect to it from every reachable host."""
    inventory = report.inventory
    master = inventory.master
    port = options.port or inventory.rendezvous_port
    report.port = port
    if master.name not in report.facts or report.master_addr is None:
        return
    seconds = options.network_timeout * 2 + 10
    for candidate in range(port, port + (options.port_search if options.find_free_port else 1)):
        listener = fleet.start(master, probe_command(master, "listen", str(candidate), str(int(seconds))))
        listener.write(probe_payload())
        line = _first_json_line(listener, timeout=fleet.timeouts.command)
        if line is not None and line.get("ok"):
            report.port, report.port_free, report.port_error = candidate, True, None
            break
        listener.close_stdin()
        report.port_free = False
        report.port_error = (line or {}).get("error") or "the listener did not start"
    else:
        return
    try:
        reachable = [h for h in inventory.hosts if h.name in report.facts]

        def connect(host: Host) -> HostResult:
            args = [report.master_addr, str(report.port), str(options.network_timeout)]
            source = source_address(host, report.facts[host.name])
            if source:
                args += ["--bind", source]
            return fleet.run_one(host, probe_command(host, "connect", *args), stdin=probe_payload())

        for result in fleet.map(connect, reachable):
            data = parse_probe(result) or {}
            local = data.get("local")
            report.reach[result.host] = Reach(
                ok=bool(data.get("ok") and data.get("reply_ok", True)),
                source=local,
                iface=iface_of_address(report.facts[result.host], local) if local else None,
                error=data.get("error") or (None if result.ok else result.error),
                seconds=data.get("seconds"),
            )
    finally:
        listener.close_stdin()
        try:
            listener.wait(timeout=5)
        except Exception:  # noqa: BLE001 - the listener also stops by itself after `seconds`
            listener.terminate()


def _first_json_line(process, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        item = process.readline(timeout=max(0.0, deadline - time.monotonic()))
        if item is None:
            return None
        stream, line = item
        if line is None:
            if stream == "stdout":
                return None
            continue
        if stream == "stdout":
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def gather(fleet: Fleet, options: CheckOptions = CheckOptions()) -> CheckReport:
    inventory = fleet.inventory
    outcomes, facts, skew = gather_facts(fleet)
    report = CheckReport(inventory, dict(outcomes.by_host), facts, skew=skew)
    if options.code:
        from pathlib import Path

        from mnft.sync import code_hashes

        report.code = code_hashes(fleet, [h for h in inventory.hosts if h.name in facts], Path(options.code_src) if options.code_src else None)
        for name, code in report.code.items():
            if code.get("matches") is False:
                shown = ", ".join(code.get("differing") or [])
                report.problems.append(Problem(name, "code", f"the code in the workdir differs from the local tree ({shown})", "invoke sync", "warning"))
    report.master_addr, why = master_address(inventory, facts.get(inventory.master_name))
    if why and inventory.master_name in facts:
        report.problems.append(Problem(inventory.master_name, "master_addr", why, "set 'iface' (or an IPv4 'address') for the master in the inventory"))
    if options.network:
        gather_network(fleet, report, options)
    if options.required_files:
        report.problems.extend(missing_files(fleet, [h for h in inventory.hosts if h.name in facts], options.required_files))
    report.problems.extend(evaluate(inventory, facts, report, options))
    return report


def missing_files(fleet: Fleet, hosts: list[Host], paths: tuple[str, ...]) -> list[Problem]:
    """A problem for each host that lacks one of the files (`test -f`, relative paths in the workdir)."""
    problems = []
    for path in paths:
        def command(host: Host, path: str = path) -> Command:
            return Command.of("test", "-f", path, cwd=None if path.startswith(("/", "~")) else host.workdir)

        for result in fleet.run(command, hosts=hosts):
            if result.status is Status.OK:
                continue
            if result.status is Status.FAILED and result.exit_code == 1:
                problems.append(Problem(result.host, "script", f"{path} does not exist on this host",
                                        "copy it there (or use a path inside the synced tree, relative to it)"))
            else:
                problems.append(Problem(result.host, "script", f"cannot tell whether {path} exists: {result.error}", "check the host"))
    return problems


# ------------------------------------------------------------------------------------------------ rules (pure)

SAME_EVERYWHERE = (
    ("python", "Python", lambda f: _minor((f.get("python") or {}).get("version"))),
    ("torch", "torch", lambda f: (f.get("torch") or {}).get("version")),
    ("cuda", "CUDA (torch build)", lambda f: (f.get("torch") or {}).get("cuda")),
    ("nccl", "NCCL", lambda f: f.get("nccl")),
    ("driver", "NVIDIA driver", lambda f: (f.get("nvidia") or {}).get("driver")),
)

FIXES = {
    "python": "use the same Python minor version on every host (set 'python' per host in the inventory)",
    "torch": "install the same torch build everywhere, e.g. pip install torch=={value}",
    "cuda": "install the torch build for the same CUDA everywhere (the +cuXXX wheel the master has)",
    "nccl": "install the same nvidia-nccl package as the master (it comes with the torch wheel)",
    "driver": "upgrade or downgrade the NVIDIA driver to the master's version",
}


def _minor(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def comparable(facts: dict) -> dict[str, Any]:
    """The values that must be identical on every host."""
    return {key: get(facts) for key, _, get in SAME_EVERYWHERE}


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


# packages with a rule of their own above (its message and fix say more than a version pair): reported once
ENV_RULE_IGNORES = ("torch", "nvidia-nccl-cu11", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def environment_drift(name: str, facts: dict, reference: dict, label: str) -> Problem | None:
    """Rule "environment identical across hosts": the installed distributions (read from metadata by the probe)
    against the reference host's, naming each differing package: `numpy 2.1.0 (master: 1.26.4); extra: foo 0.3`."""
    from mnft.environment import compare

    mine, theirs = facts.get("dists"), reference.get("dists")
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return None
    diff = compare(mine, theirs, ignore=ENV_RULE_IGNORES)
    if diff.empty:
        return None
    return Problem(name, "env", diff.describe(label), "make the hosts' environments identical from one lock: invoke provision --hosts FILE")


def evaluate(inventory: Inventory, facts: dict[str, dict], report: CheckReport, options: CheckOptions) -> list[Problem]:
    problems: list[Problem] = []
    master = inventory.master_name
    ref_name = reference_host(inventory, facts)
    reference = comparable(facts[ref_name]) if ref_name is not None else None
    ref_label = reference_label(inventory, ref_name)
    uses_gpu = any((f.get("torch") or {}).get("cuda") or (f.get("nvidia") or {}).get("gpus") for f in facts.values())
    for host in inventory.hosts:
        f = facts.get(host.name)
        if f is None:
            continue
        mine = comparable(f)
        if (f.get("torch") or {}).get("version") is None:
            problems.append(Problem(host.name, "torch", f"torch is not installed for {(f.get('python') or {}).get('executable') or host.python}", "pip install torch in the Python the inventory names ('python')"))
        if reference is not None and host.name != ref_name:
            for key, label, _ in SAME_EVERYWHERE:
                if mine[key] != reference[key] and not (key == "torch" and mine[key] is None):
                    problems.append(Problem(host.name, key, f"{label} {mine[key] or 'none'} differs from {ref_label} {reference[key] or 'none'}", FIXES[key].format(value=reference[key])))
            drift = environment_drift(host.name, f, facts[ref_name], "master" if ref_name == master else ref_name)
            if drift is not None:
                problems.append(drift)
        gpus = (f.get("nvidia") or {}).get("gpus") or []
        if uses_gpu:
            if len(gpus) < host.slots:
                problems.append(Problem(host.name, "gpus", f"{len(gpus)} GPU(s) for {host.slots} slot(s)", "lower 'slots' for this host or fix the GPUs (nvidia-smi)"))
            busy = [g for g in gpus if g.get("processes")]
            for gpu in busy:
                pids = ", ".join(str(p.get("pid")) for p in gpu["processes"])
                problems.append(Problem(host.name, "gpus", f"GPU {gpu.get('index')} is held by process(es) {pids}", "stop the old run (invoke stop) or those processes before training", "warning"))
        disk = f.get("disk") or {}
        free = disk.get("free_bytes")
        if isinstance(free, int) and free < options.min_free_gb * GIB:
            problems.append(Problem(host.name, "disk", f"{free / GIB:.1f} GiB free at {disk.get('path')} (floor {options.min_free_gb:g} GiB)", "free disk space or point 'workdir' at a larger disk"))
        if not f.get("rsync"):
            problems.append(Problem(host.name, "rsync", "rsync is not installed", "install rsync (apt-get install rsync / dnf install rsync)"))
        if host.iface and not ipv4_of(f, host.iface):
            names = ", ".join(i.get("name", "?") for i in f.get("interfaces") or [])
            problems.append(Problem(host.name, "iface", f"interface {host.iface!r} does not exist or has no IPv4 address (has: {names})", "set 'iface' to the cluster network's interface (ip -br addr)"))
        skew = report.skew.get(host.name)
        ref_skew = report.skew.get(ref_name) if ref_name is not None else None
        if skew is not None and ref_skew is not None and abs(skew - ref_skew) > options.max_clock_skew_s:
            problems.append(Problem(host.name, "clock", f"clock differs from {ref_label} by {skew - ref_skew:+.1f}s", "enable time sync (chrony / systemd-timesyncd) on every host"))
    if options.network and report.master_addr and master in facts:
        if report.port_free is False:
            problems.append(Problem(master, "port", f"rendezvous port {report.port} is not free on the master: {report.port_error}", "stop what holds it (ss -ltnp) or choose another port (rendezvous_port / --port)"))
        for host in inventory.hosts:
            reach = report.reach.get(host.name)
            if reach is not None and not reach.ok:
                via = f" from {reach.source}" if reach.source else (f" from {host.iface}" if host.iface else "")
                problems.append(Problem(host.name, "network", f"cannot reach the master {report.master_addr}:{report.port}{via}: {reach.error}", "open the port on the master's firewall for the peers (invoke setup), or set 'iface' to the cluster interface"))
        if len(inventory.hosts) > 1 and ipaddress.IPv4Address(report.master_addr).is_loopback:
            problems.append(Problem(master, "master_addr", f"the master's address {report.master_addr} is a loopback address peers cannot reach", "set the master's 'address' or 'iface' to the cluster network"))
    return problems
