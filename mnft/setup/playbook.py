"""`invoke setup`: a playbook of named steps, validated up front, run on every host: read → plan → apply → report.

A playbook is an Ansible-style YAML list; each entry names one step (the key) with its parameters (the value):

    - name: Controller key on every host
      authorized_keys: {}
    - name: Peers-only firewall
      firewall:
        revert_after: 30
      tags: [net]

Every entry and parameter is validated before any host is contacted (unknown step or parameter with a "did you
mean", wrong types, a controller key that cannot be read): an `InputError` naming the file, the step (index and
name) and the key, exit 2, nothing applied anywhere.

Steps run one after another, each on all hosts in parallel; each host ends each step ok (nothing to do) /
changed / failed / unreachable. `check` plans and changes nothing; `undo` runs the steps' undo in reverse order;
`only` picks steps by step name, entry name or tag. Steps that need root use `become` from the inventory
(`sudo -n` when that works; otherwise the sudo password is asked once and written to sudo's stdin, never put on
a command line, stored or printed).
"""

from __future__ import annotations

import getpass
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from mnft.core import yamlfile
from mnft.core.errors import ExitCode, InputError
from mnft.core.yamlfile import suggest
from mnft.hosts import leases
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host, Inventory
from mnft.setup.steps import admin_group, authorized_keys, firewall, hosts_file, kernel_log, mesh, reserved_ports
from mnft.setup.steps.base import (
    CHANGED,
    FAILED,
    HOST_KEY_REJECTED,
    UNREACHABLE,
    Become,
    Context,
    Outcome,
    check_value,
)

ENTRY_KEYS = ("name", "tags")
STEPS = {  # a playbook's step name -> its module
    "authorized_keys": authorized_keys,
    "mesh": mesh,
    "hosts_file": hosts_file,
    "firewall": firewall,
    "reserved_ports": reserved_ports,
    "kernel_log": kernel_log,
    "admin_group": admin_group,
}
USES_ADDRESSES = ("mesh", "hosts_file", "firewall")  # steps that need every host's cluster address
DEFAULT_PLAYBOOK = Path(__file__).resolve().parent / "setup.yaml"  # installed with the package


@dataclass(frozen=True)
class StepSpec:
    index: int  # 1-based, as written in the playbook
    step: str  # the step's module name
    name: str  # the entry's name (default: the step)
    params: dict
    tags: tuple[str, ...]

    @property
    def module(self):
        return STEPS[self.step]

    @property
    def label(self) -> str:
        return f"{self.index}. {self.step}"


@dataclass(frozen=True)
class Playbook:
    path: Path | None
    steps: tuple[StepSpec, ...]

    def select(self, only: Iterable[str] | None) -> tuple[StepSpec, ...]:
        """The steps matching any of `only` (step, entry name or tag); all when None."""
        wanted = [w.strip() for w in (only or ()) if w.strip()]
        if not wanted:
            return self.steps
        known = {s.step for s in self.steps} | {s.name for s in self.steps} | {t for s in self.steps for t in s.tags}
        for w in wanted:
            if w not in known:
                raise InputError(f"--only {w!r}: no step, step name or tag of {self.path or 'the playbook'} is called that{suggest(w, known)} (choose from: {', '.join(sorted(known))})")
        return tuple(s for s in self.steps if s.step in wanted or s.name in wanted or set(s.tags) & set(wanted))


# ---------------------------------------------------------------------------------------------- loading


def load(path: str | Path) -> Playbook:
    path = Path(path)
    return parse(yamlfile.read_text(path, "playbook", "--playbook"), path)


def parse(text: str, path: Path | None = None) -> Playbook:
    where = str(path) if path else "<playbook>"
    doc = yamlfile.load(text, where)
    if not doc:
        raise InputError(f"{where}: the playbook lists no step")
    if not isinstance(doc, list):
        raise InputError(f"{where}: a playbook is a list of steps ('- name: …' then one step key), got a {type(doc).__name__}")
    steps = [_entry(i, entry, where) for i, entry in enumerate(doc, 1)]
    return Playbook(path, tuple(steps))


def single(step: str, params: dict, name: str, where: str) -> Playbook:
    """A playbook of one step (a command-line shorthand: `mnft setup --admin-group NAME`), validated as a file's."""
    return Playbook(None, (_entry(1, {"name": name, step: params}, where),))


def _entry(index: int, entry: Any, where: str) -> StepSpec:
    if not isinstance(entry, dict):
        raise InputError(f"{where}: step {index}: expected a mapping (name, one step key with its parameters), got {entry!r}")
    name = entry.get("name")
    label = f"step {index}" + (f" ({name})" if name else "")
    step_keys = [k for k in entry if k not in ENTRY_KEYS]
    if not step_keys:
        raise InputError(f"{where}: {label}: names no step (one of: {', '.join(STEPS)})")
    for key in step_keys:
        if key not in STEPS:
            raise InputError(f"{where}: {label}: unknown step {key!r}{suggest(str(key), [*STEPS, *ENTRY_KEYS])}")
    if len(step_keys) > 1:
        raise InputError(f"{where}: {label}: one step per entry, found {', '.join(map(repr, step_keys))}")
    step = step_keys[0]
    label = f"step {index} ({name or step})"
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InputError(f"{where}: {label}: key 'name': expected text, got {name!r}")
    raw = entry[step]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InputError(f"{where}: {label}: the parameters of {step!r} must be a mapping, got {raw!r}")
    module = STEPS[step]
    params = {}
    for key, value in raw.items():
        if key not in module.PARAMS:
            hint = suggest(str(key), module.PARAMS) or f" (parameters of {step}: {', '.join(module.PARAMS) or 'none'})"
            raise InputError(f"{where}: {label}: key {key!r}: unknown parameter{hint}")
        try:
            params[key] = check_value(module.PARAMS[key], value)
        except ValueError as exc:
            raise InputError(f"{where}: {label}: key {key!r}: {exc}") from None
    for key, param in module.PARAMS.items():
        params.setdefault(key, param.default)
    validate = getattr(module, "validate", None)
    problem = validate(params) if validate else None
    if problem:
        raise InputError(f"{where}: {label}: {problem}")
    tags = entry.get("tags", ())
    if isinstance(tags, str):
        tags = (tags,)
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) and t for t in tags):
        raise InputError(f"{where}: {label}: key 'tags': expected a list of words, got {tags!r}")
    return StepSpec(index, step, str(name or step), params, tuple(dict.fromkeys((*module.TAGS, *tags))))


def prepare(playbook: Playbook, steps: Iterable[StepSpec], inventory: Inventory) -> list[StepSpec]:
    """Controller-side checks of each step (e.g. reading the controller's key): InputError before any host."""
    out = []
    for spec in steps:
        fn = getattr(spec.module, "prepare", None)
        if fn is None:
            out.append(spec)
            continue
        try:
            params = fn(inventory, spec.params)
        except InputError as exc:
            raise InputError(f"{playbook.path or '<playbook>'}: step {spec.index} ({spec.name}): {exc}") from None
        out.append(StepSpec(spec.index, spec.step, spec.name, params, spec.tags))
    return out


# ---------------------------------------------------------------------------------------------- report


@dataclass
class SetupReport:
    inventory: Inventory
    steps: list[StepSpec]
    check: bool = False
    undo: bool = False
    outcomes: dict[int, dict[str, Outcome]] = field(default_factory=dict)  # step index -> host -> outcome
    notes: list[str] = field(default_factory=list)

    def all(self) -> list[Outcome]:
        return [o for per_host in self.outcomes.values() for o in per_host.values()]

    def changed(self) -> int:
        return sum(o.status == CHANGED for o in self.all())

    def exit_code(self) -> ExitCode:
        states = {o.status for o in self.all()}
        if states & {UNREACHABLE, HOST_KEY_REJECTED}:
            return ExitCode.UNREACHABLE
        if FAILED in states:
            return ExitCode.FAILED
        return ExitCode.OK

    def to_json(self) -> dict:
        return {
            "inventory": str(self.inventory.path) if self.inventory.path else None,
            "mode": "check" if self.check else "undo" if self.undo else "apply",
            "steps": [{"index": s.index, "step": s.step, "name": s.name} for s in self.steps],
            "hosts": {
                h.name: {s.label: self.outcomes[s.index][h.name].to_json() for s in self.steps if h.name in self.outcomes.get(s.index, {})}
                for h in self.inventory.hosts
            },
            "changed": self.changed(),
            "exit_code": int(self.exit_code()),
            "notes": self.notes,
        }


def print_report(report: SetupReport, as_json: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from mnft.core.output import STATUS_STYLE, console, print_json

    if as_json:
        print_json(report.to_json())
        return
    mode = " (check: nothing applied)" if report.check else " (undo)" if report.undo else ""
    table = Table(title=f"setup{mode}: {len(report.inventory.hosts)} hosts, {len(report.steps)} steps")
    table.add_column("host")
    for spec in report.steps:
        table.add_column(spec.label)
    for host in report.inventory.hosts:
        cells = []
        for spec in report.steps:
            outcome = report.outcomes.get(spec.index, {}).get(host.name)
            status = outcome.status if outcome else "-"
            shown = "would change" if report.check and status == CHANGED else status
            cells.append(Text(shown, style=STATUS_STYLE.get(status, "")))
        table.add_row(host.name, *cells)
    out = console()
    out.print(table)
    for spec in report.steps:
        for host in report.inventory.hosts:
            outcome = report.outcomes.get(spec.index, {}).get(host.name)
            if outcome is None:
                continue
            verb = "would " if report.check else ""
            for change in outcome.changes if outcome.status in (CHANGED, FAILED) else ():
                out.print(f"{host.name} {spec.label}: {verb}{change}", markup=False)
            if outcome.error:
                out.print(Text(f"{host.name} {spec.label}: {outcome.status}: {outcome.error}", style=STATUS_STYLE.get(outcome.status, "red")))
            for note in outcome.notes:
                out.print(Text(f"{host.name} {spec.label}: note: {note}", style="dim"))
    for note in report.notes:
        out.print(Text(note, style="yellow"))
    summary = f"{report.changed()} {'to change' if report.check else 'changed'}"
    out.print(summary, markup=False)


# ---------------------------------------------------------------------------------------------- running


def _ipv4(text: str | None) -> str | None:
    try:
        return str(ipaddress.IPv4Address(text)) if text else None
    except ValueError:
        return None


def cluster_address(host: Host, interfaces: dict[str, list[str]] | None, resolve: Callable[[str], str | None]) -> tuple[str | None, str | None]:
    """(cluster address, cluster interface) of a host: the address on `iface`, else the inventory address when it
    is an IPv4 literal (or resolves to one), with the interface holding it when the host's facts are known.
    A host with `iface` whose facts are unknown (not reached) has no known address: (None, iface)."""
    if host.iface:
        addresses = (interfaces or {}).get(host.iface) or []
        return (addresses[0] if addresses else None), host.iface
    address = _ipv4(host.address) or resolve(host.address)
    iface = host.iface
    if interfaces and address and iface is None:
        iface = next((name for name, addrs in interfaces.items() if address in addrs), None)
    return address, iface


def previous_addresses(hosts_texts: Iterable[str]) -> dict[str, str]:
    """name -> address from mnft's /etc/hosts blocks read on the reached hosts (first one wins)."""
    from mnft.setup.steps import hosts_file

    out: dict[str, str] = {}
    for text in hosts_texts:
        try:
            body = hosts_file.BLOCK.body(text) or []
        except ValueError:
            continue
        for line in body:
            words = line.split()
            if len(words) >= 2 and _ipv4(words[0]):
                out.setdefault(words[1], words[0])
    return out


def addresses_of(inventory: Inventory, facts: dict[str, dict], previous: dict[str, str], resolve: Callable[[str], str | None]):
    """(addresses, ifaces, missing, notes): each host's cluster address and interface. A host not reached whose
    address lives on `iface` keeps its previous address (mnft's /etc/hosts block on the other nodes) or, with no
    previous entry, is left out this run (`notes` say which) — never replaced by its management address.
    `missing`: reached hosts without an address (the steps using addresses fail for them: bad inventory)."""
    addresses, ifaces, missing, notes = {}, {}, [], []
    for host in inventory.hosts:
        reached = host.name in facts
        address, iface = cluster_address(host, (facts.get(host.name) or {}).get("interfaces"), resolve)
        if iface:
            ifaces[host.name] = iface
        if address is None and not reached and host.iface:
            address = previous.get(host.name)
            if address:
                notes.append(f"{host.name} was not reached: its address on {host.iface} is taken from the previous setup ({address})")
            else:
                notes.append(f"{host.name} was not reached and its address on {host.iface} is unknown: left out of /etc/hosts, "
                             "the firewall's peers and the mesh until a run reaches it")
                continue
        if address:
            addresses[host.name] = address
        else:
            missing.append(host.name)
    return addresses, ifaces, missing, notes


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _preflight(ctx: Context, needs_root: bool) -> tuple[dict[str, dict], dict[str, Outcome]]:
    """Per reachable host: env (uid), addresses, and whether `sudo -n` works (become hosts)."""

    def one(host: Host):
        ops = [{"op": "env"}, {"op": "addresses"}, {"op": "read", "path": "/etc/hosts"}]
        if needs_root and host.become:
            ops.append({"op": "run", "argv": ["sudo", "-n", "true"], "timeout": 15})
        results, failure = ctx.remote(host, ops)
        if failure:
            return None, failure
        hosts = results[2].get("text", "") if results[2].get("exists") else ""
        return {"env": results[0], "interfaces": results[1], "etc_hosts": hosts, "sudo_n": len(results) > 3 and results[3].get("rc") == 0}, None

    got = ctx.map(one)
    return {n: f for n, (f, o) in got.items() if o is None}, {n: o for n, (f, o) in got.items() if o is not None}


def _become(inventory: Inventory, facts: dict[str, dict], ask_password: Callable[[], str]) -> tuple[dict[str, Become], dict[str, str]]:
    """host -> Become for hosts that can get root; host -> why not for the others."""
    become: dict[str, Become] = {}
    no_root: dict[str, str] = {}
    need_password = []
    for host in inventory.hosts:
        f = facts.get(host.name)
        if f is None:
            continue
        if f["env"]["uid"] == 0:
            become[host.name] = Become()
        elif not host.become:
            no_root[host.name] = f"needs root: {f['env']['user']} is not root; set become: true for {host.name} in the inventory"
        elif f["sudo_n"]:
            become[host.name] = Become("nopasswd")
        else:
            need_password.append(host.name)
    if need_password:
        password = ask_password()
        for name in need_password:
            become[name] = Become("password", password)
    return become, no_root


def _ask_password() -> str:
    return getpass.getpass("sudo password (hosts with become: true): ")


def run(
    inventory: Inventory,
    playbook: Playbook,
    *,
    check: bool = False,
    undo: bool = False,
    only: Iterable[str] | None = None,
    timeouts: Timeouts = Timeouts(),
    ask_password: Callable[[], str] = _ask_password,
) -> SetupReport:
    """Validate, connect, then run the selected steps (their undo, in reverse, with `undo`) on every host."""
    steps = prepare(playbook, playbook.select(only), inventory)
    report = SetupReport(inventory, list(steps), check=check, undo=undo)
    with Fleet(inventory, timeouts) as fleet:
        fleet.connect_all()
        with leases.hold(fleet, inventory.hosts, "setup --undo" if undo else "setup", skip=check):  # one operation per host
            return _run_steps(fleet, inventory, steps, report, check=check, undo=undo, ask_password=ask_password)


def _run_steps(fleet: Fleet, inventory: Inventory, steps: list[StepSpec], report: "SetupReport", *, check: bool, undo: bool,
               ask_password: Callable[[], str]) -> "SetupReport":
    """The steps, on every host the fleet reached, under the hosts' leases."""
    needs_root = any(s.module.NEEDS_ROOT for s in steps)
    base = Context(fleet, inventory, check=check)
    facts, down = _preflight(base, needs_root)
    become, no_root = _become(inventory, facts, ask_password) if needs_root else ({}, {})
    previous = previous_addresses(facts[h.name]["etc_hosts"] for h in inventory.hosts if h.name in facts)
    addresses, ifaces, missing, notes = addresses_of(inventory, facts, previous, _resolve)
    if any(s.step in USES_ADDRESSES for s in steps) and not undo:
        report.notes += notes
    for spec in (reversed(steps) if undo else steps):
        per_host: dict[str, Outcome] = {name: Outcome(o.status, error=o.error) for name, o in down.items()}
        targets = [h for h in inventory.hosts if h.name not in down]
        if spec.module.NEEDS_ROOT:
            for name in [h.name for h in targets if h.name in no_root]:
                per_host[name] = Outcome(FAILED, error=no_root[name])
            targets = [h for h in targets if h.name not in no_root]
        if spec.step in USES_ADDRESSES and missing and not undo:
            for h in targets:
                per_host[h.name] = Outcome(FAILED, error=f"no cluster address for {', '.join(missing)}: set iface or an IPv4 address in the inventory")
            targets = []
        if targets:
            ctx = Context(fleet, inventory, check=check, become=become, addresses=addresses, ifaces=ifaces, targets=tuple(targets))
            per_host.update((spec.module.undo if undo else spec.module.run)(ctx, spec.params))
        report.outcomes[spec.index] = {h.name: per_host[h.name] for h in inventory.hosts if h.name in per_host}
    return report
