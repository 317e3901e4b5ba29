"""`invoke provision`: the same Python environment on every host, from a lock file, offline, verified.

Read state → plan → apply, as everywhere in mnft:

* facts (one round-trip per host, `mnft.onhost.envhost` shipped to the host's base Python): the Pythons it has, CPU
  arch, libc, free disk, the environment now at its `venv` (installed distributions read from metadata), the
  wheels it already holds, whether `invoke setup`'s SSH mesh is there;
* shared environments: when a host has something to do, which hosts see one environment directory (an NFS home:
  marks left beside it and read back, `mnft.sync.mirror.detect_shared`);
* plan (pure, `mnft.env.plan`): per host nothing / build a new environment (what is installed, upgraded, removed) /
  verify (a host sharing its environment directory builds it once) / refused (no such Python, not mnft's
  directory, hosts sharing one environment that differ in OS, libc, architecture or base Python) / skipped
  (unreachable). Every refusal is bad input: exit 2 before anything changes on any host, as are a package without
  a wheel for a host's platform and a disk too small for what would be copied and unpacked;
* apply: the controller resolves the lock once into wheel files per host platform (`mnft.env.wheelhouse`); the
  wheels and uv reach the hosts through the mesh (`mnft.sync.relay`: the controller uploads them about once), and
  every host builds the new environment beside the current one with `uv venv` + `uv pip sync --offline`,
  verifies it and switches a link (`mnft.onhost.envhost`). A failure leaves the host on its previous environment.
  Every host then reads its environment again: a host that shares one sees the id its group's builder made.

The controller records, per host, the environment it provisioned (`$MNFT_HOME/provision/hosts.json`);
`effective()` makes that environment's Python the one check/train/sync use on that host.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform as local_platform
import re
import secrets
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from mnft.core.errors import InputError
from mnft.core.output import fmt_size
from mnft.env import lockfile
from mnft.env.diff import against_lock, fingerprint
from mnft.env.lockfile import Lock, Pin
from mnft.env.plan import HostPlan, choose_python, disk_needed, env_state, plan_host, plan_rollback, plan_shared
from mnft.env.record import base_python, effective, env_python, host_key, host_root, save_state
from mnft.env.report import HostOutcome, ProvisionReport
from mnft.env.wheelhouse import Platform, Wheel, Wheelhouse
from mnft.hosts import leases, pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import CommandTimeout, HostKeyRejected, OutputTooLarge, Timeouts, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory
from mnft.sync.mirror import detect_shared
from mnft.onhost.filehash import sha256_file

FACTS_TIMEOUT = 60.0
INSTALL_TIMEOUT = 3600.0
INSTALL_HEARTBEAT_EVERY = 5.0  # seconds between the heartbeats the controller writes to each host's install script
INSTALL_DEADMAN = 30.0  # seconds without one before the host ends its installer (a network gone without a FIN, a hung controller)
SHARED_WAIT = 10.0  # seconds a host sharing an environment may still see the old link (an NFS client's attribute cache)


@dataclass(frozen=True)
class ProvisionOptions:
    lock: Path | None = None  # default: lockfile.default_lock(src)
    src: Path | None = None  # the project tree holding the default lock
    dry_run: bool = False
    rollback: bool = False
    online: bool = False  # hosts install straight from the lock's index (still exactly pinned)
    offline: bool = False  # the controller must not use an http(s) index either: wheelhouse / find-links only
    find_links: tuple[str, ...] = ()  # extra local wheel directories for the controller's fetch
    wheelhouse: Path | None = None  # default: $MNFT_HOME/wheelhouse
    python: str | None = None  # the Python X.Y when the lock does not say it
    relay: bool = True  # relay over the mesh when it is there

    def __post_init__(self) -> None:
        if self.online and self.offline:
            raise InputError("--online and --offline contradict each other: choose one")
        if self.python is not None and not _is_minor(self.python):
            raise InputError(f"--python {self.python!r}: give a version as X.Y (e.g. 3.11)")
        if self.rollback and (self.online or self.offline or self.find_links):
            raise InputError("--rollback switches back to the previous environment: it takes no lock or fetch options")


def _is_minor(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 2 and all(p.isdigit() for p in parts)


# ------------------------------------------------------------------------------------------------ plan (pure)


# ------------------------------------------------------------------------------------------------ the controller's record


# ------------------------------------------------------------------------------------------------ reading


def script_command(host: Host, *args: str) -> Command:
    """envhost on the host's base Python (never the environment's: it may be the broken one being replaced)."""
    return pyrun.command(host, *args, python=base_python(host))


def facts_command(host: Host, want: str | None) -> Command:
    return script_command(host, "facts", host.venv or "~/mnft-env", "--python", base_python(host), *(["--want", want] if want else []))


def _script_payload() -> bytes:
    return pyrun.payload("envhost")


def parse_reply(result: HostResult) -> dict | None:
    """The host script's JSON object, or None (the result is then failed with the reason): as for the probe."""
    return pyrun.reply(result, "the provision script")


def gather(fleet: Fleet, hosts: list[Host], want: str | None) -> tuple[dict[str, HostResult], dict[str, dict]]:
    payload = _script_payload()
    results = fleet.run(lambda h: facts_command(h, want), stdin=payload, hosts=hosts, timeout=FACTS_TIMEOUT)
    facts = {}
    for result in results:
        data = parse_reply(result)
        if data is not None:
            facts[result.host] = data
    return dict(results.by_host), facts


def wanted_python(lock: Lock, options: ProvisionOptions, inventory: Inventory, facts: Mapping[str, dict]) -> str | None:
    """The lock's Python X.Y; else --python; else the master's base Python (or the first host that answered)."""
    if lock.python:
        return lock.python
    if options.python:
        return options.python
    for name in [inventory.master_name, *(h.name for h in inventory.hosts)]:
        pythons = (facts.get(name) or {}).get("pythons") or []
        if pythons and pythons[0].get("found"):
            return ".".join(pythons[0]["version"].split(".")[:2])
    return None


# ------------------------------------------------------------------------------------------------ report


# ------------------------------------------------------------------------------------------------ the whole run


Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def provision(inventory: Inventory, options: ProvisionOptions = ProvisionOptions(), *, say: Say = _quiet,
              show: Callable[[str, dict[str, HostOutcome], ProvisionReport], None] | None = None,
              timeouts: Timeouts = Timeouts(connect=10, command=FACTS_TIMEOUT)) -> ProvisionReport:
    """read -> plan -> (dry run: stop) -> fetch -> relay -> install -> verify -> record."""
    started = time.monotonic()
    if options.rollback:
        return _rollback(inventory, say, timeouts, started)
    lock = lockfile.load(options.lock or lockfile.default_lock(_src(options)))
    for name in options.find_links:
        if not re.match(r"^https?://", name) and not Path(name).is_dir():
            raise InputError(f"--find-links {name}: not a directory")
    inventory = effective(inventory)  # base_python known for hosts provisioned before
    with Fleet(inventory, timeouts) as fleet, leases.hold(fleet, inventory.hosts, "provision", skip=options.dry_run, python=base_python,
                                                            per_host=leases.provision_scope):
        say(f"reading {len(inventory.hosts)} host(s)")
        want = lock.python or options.python
        outcomes, facts = gather(fleet, list(inventory.hosts), want)
        minor = wanted_python(lock, options, inventory, facts)
        if minor is None:
            raise InputError(f"{lock.path}: no host answered with its Python version and the lock does not name one: pass --python X.Y")
        if want is None:  # hosts whose first Python is another version: look for pythonX.Y there
            again = [h for h in inventory.hosts if h.name in facts and choose_python(facts[h.name], minor) is None]
            if again:
                more_outcomes, more = gather(fleet, again, minor)
                outcomes.update(more_outcomes)
                facts.update(more)
        plans = {h.name: plan_host(h, outcomes.get(h.name), facts.get(h.name), lock, minor) for h in inventory.hosts}
        if not options.dry_run:  # (a dry run leaves no mark: it changes nothing)
            plans = _shared(fleet, inventory, plans, facts)
        _refuse(plans)
        report = ProvisionReport(inventory, lock, minor, {}, dry_run=options.dry_run)
        before = {name: _outcome_of(plans[name], outcomes.get(name), facts.get(name)) for name in plans}
        if show is not None:
            show("before", before, report)
        todo = [h for h in inventory.hosts if plans[h.name].action == "install"]
        if options.dry_run or not todo:
            report.hosts = {n: _dry(o, plans[n]) for n, o in before.items()} if options.dry_run else before
            _record(inventory, facts, plans, report, lock)
            report.seconds = round(time.monotonic() - started, 3)
            return report
        report.hosts = before
        _apply(fleet, inventory, lock, options, plans, facts, todo, report, say)
        verifiers = [h for h in inventory.hosts if plans[h.name].action == "verify"]
        after_outcomes, after_facts = gather(fleet, todo, minor)
        more_outcomes, more_facts = _read_shared(fleet, verifiers, plans, report, minor)
        after_outcomes.update(more_outcomes)
        after_facts.update(more_facts)
        for host in todo:
            _verify(report.hosts[host.name], plans[host.name], after_outcomes.get(host.name), after_facts.get(host.name))
        for host in verifiers:
            _verify_shared(report.hosts[host.name], plans[host.name], report.hosts[plans[host.name].builder],
                           after_outcomes.get(host.name), after_facts.get(host.name))
        _record(inventory, {**facts, **after_facts}, plans, report, lock)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _src(options: ProvisionOptions) -> Path:
    if options.src is not None:
        return options.src
    from mnft.sync.source import default_source

    return default_source()


def _shared(fleet: Fleet, inventory: Inventory, plans: Mapping[str, HostPlan], facts: Mapping[str, dict]) -> dict[str, HostPlan]:
    """When a host has a build or rollback to do: which hosts see one environment directory (each leaves a mark
    beside its `venv`, then says whose marks it sees), and the plans that build or roll back once per group."""
    if not any(p.action in ("install", "rollback") for p in plans.values()):
        return dict(plans)
    # the marks are left by the host's base Python, as envhost runs: the environment's own may be the broken one
    hosts = [replace(h, python=base_python(h)) for h in inventory.hosts if h.name in facts and h.venv is not None]
    if len(hosts) < 2:
        return dict(plans)
    where = {h.name: host_root(h.venv) for h in hosts}
    return plan_shared(plans, facts, detect_shared(fleet, hosts, where), where)


def _read_shared(fleet: Fleet, hosts: list[Host], plans: Mapping[str, HostPlan], report: ProvisionReport,
                 minor: str | None) -> tuple[dict[str, HostResult], dict[str, dict]]:
    """The facts of the hosts that verify their group's build or rollback, read again (for SHARED_WAIT seconds at
    most) while one still sees another environment than its builder's: an NFS client may serve a replaced link from
    its attribute cache for a while."""
    if not hosts:
        return {}, {}

    def stale(name: str) -> bool:
        wanted = _env_id_of(report.hosts[plans[name].builder].env)
        return wanted is not None and name in facts and _env_id_of((facts[name].get("env") or {}).get("target")) != wanted

    outcomes, facts = gather(fleet, hosts, minor)
    deadline = time.monotonic() + SHARED_WAIT
    while time.monotonic() < deadline and any(stale(h.name) for h in hosts):
        time.sleep(1.0)
        more_outcomes, more = gather(fleet, [h for h in hosts if stale(h.name)], minor)
        outcomes.update(more_outcomes)
        facts.update(more)
    return outcomes, facts


def _env_id_of(path: str | None) -> str | None:
    """An environment's id: its directory's name (the hosts of a group may reach the shared directory by other paths)."""
    return os.path.basename(path.rstrip("/")) if path else None


def _verify_shared(outcome: HostOutcome, plan: HostPlan, builder: HostOutcome, result: HostResult | None, facts: dict | None) -> None:
    """A host whose group's builder installed (or rolled back) the environment they share: it must see the
    environment its builder made, and (after a build) that environment must match the lock."""
    if builder.status not in ("changed", "rolled-back"):
        outcome.status = "failed"
        outcome.error = (f"{plan.builder} builds the environment {outcome.host} shares and did not succeed ({builder.status}): "
                         f"{outcome.host} keeps its previous environment")
        return
    outcome.status = builder.status
    if builder.status == "changed":
        _verify(outcome, plan, result, facts)
    elif facts is None:
        outcome.status = result.status.value if result is not None and result.status is not Status.OK else "failed"
        outcome.error = "verification failed: " + ((result.error if result else "") or "no facts")
    else:
        outcome.python, outcome.env = env_state(facts)[0], (facts.get("env") or {}).get("target")
        outcome.fingerprint = fingerprint(*env_state(facts))
    if facts is None or outcome.status == "failed":
        return
    seen = _env_id_of((facts.get("env") or {}).get("target"))
    if seen != _env_id_of(builder.env):
        outcome.status = "failed"
        outcome.error = (f"{outcome.host} shares its environment directory with {plan.builder} but sees environment {seen or 'none'}, "
                         f"not {_env_id_of(builder.env)} that {plan.builder} made: is the shared filesystem mounted alike on both?")


def _refuse(plans: Mapping[str, HostPlan]) -> None:
    refused = [p for p in plans.values() if p.action == "refuse"]
    if refused:
        more = f" (and {len(refused) - 1} more host(s) refused)" if len(refused) > 1 else ""
        raise InputError(refused[0].reason + more + "; nothing was changed on any host")


def _outcome_of(plan: HostPlan, result: HostResult | None, facts: dict | None) -> HostOutcome:
    if plan.action == "skip":
        status = result.status.value if result is not None and result.status is not Status.OK else "failed"
        return HostOutcome(plan.host, status, "skip", error=plan.reason)
    env = (facts or {}).get("env") or {}
    py, dists = env_state(facts or {})
    return HostOutcome(plan.host, "ok", plan.action, before=plan.diff, changes=plan.changes, python=py, env=env.get("target"),
                       fingerprint=fingerprint(py, dists) if env.get("exists") else None, notes=[plan.reason] if plan.action == "verify" else [])


def _dry(outcome: HostOutcome, plan: HostPlan) -> HostOutcome:
    if plan.action == "install":
        outcome.status = "would-change"
    return outcome


def _env_id(lock: Lock) -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{lock.digest[:10]}-{secrets.token_hex(2)}"


def _uv_binary(plans: Mapping[str, HostPlan], todo: list[Host]) -> Path:
    try:
        import uv
    except ImportError:
        raise InputError("the uv package is not installed on this machine: pip install uv") from None
    here = local_platform.machine()
    other = [h.name for h in todo if plans[h.name].platform and plans[h.name].platform.arch != here]
    if other:
        raise InputError(f"host {other[0]} is {plans[other[0]].platform.arch}, this controller {here}: mnft ships the controller's own uv binary, "
                         "so provision hosts of another CPU architecture from a controller of theirs")
    return Path(uv.find_uv_bin())


def _apply(fleet: Fleet, inventory: Inventory, lock: Lock, options: ProvisionOptions, plans: dict[str, HostPlan], facts: dict[str, dict],
           todo: list[Host], report: ProvisionReport, say: Say) -> None:
    uv_bin = _uv_binary(plans, todo)
    uv_size = uv_bin.stat().st_size
    groups: dict[Platform, list[Host]] = {}
    wanted: dict[Platform, list[Pin]] = {}  # per platform the pins its hosts' plans chose (their own marker values)
    for host in todo:
        groups.setdefault(plans[host.name].platform, []).append(host)
        wanted.setdefault(plans[host.name].platform, []).extend(plans[host.name].pins)
    house = Wheelhouse(options.wheelhouse)
    wheels: dict[Platform, dict[str, Wheel]] = {p: {} for p in groups}
    if not options.online:
        say("resolving the lock into wheels on this machine")
        wheels = house.resolve(lock, wanted, offline=options.offline, find_links=options.find_links, progress=say)
    # disk, checked before anything is copied: bad input, nothing changed anywhere
    for host in todo:
        f = facts[host.name]
        held = (f.get("dist") or {}).get("wheels") or {}
        uv_held = (f.get("dist") or {}).get("uv") == uv_size
        need = disk_needed(wheels[plans[host.name].platform], held, uv_size, uv_held)
        free = (f.get("disk") or {}).get("free_bytes")
        if isinstance(free, int) and free < need:
            raise InputError(f"host {host.name}: {fmt_size(free)} free at {(f.get('disk') or {}).get('path')}, provisioning needs {fmt_size(need)} "
                             "(wheels to copy + the unpacked environment): free disk or set 'venv' to a larger disk; nothing was changed on any host")
    targets = {h.name: host_root(h.venv) + "/dist" for h in todo}
    uv_sha256 = sha256_file(uv_bin)
    prepared = fleet.run(lambda h: script_command(h, "prepare", h.venv, uv_sha256), stdin=_script_payload(), hosts=todo, timeout=FACTS_TIMEOUT)
    ready = []
    for host in todo:
        result = prepared[host.name]
        data = parse_reply(result)
        if data is None or not data.get("ok"):
            _fail(report.hosts[host.name], result, data)
        else:
            ready.append(host)
    from mnft.sync import relay

    delivered: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mnft-stage-", dir=_stage_parent(house)) as tmp:
        for plat, hosts in groups.items():
            hosts = [h for h in hosts if h in ready]
            if not hosts:
                continue
            stage = Path(tmp) / hashlib.sha256(repr(plat).encode()).hexdigest()[:12]
            (stage / "wheels").mkdir(parents=True)
            os.symlink(uv_bin, stage / "uv")
            for wheel in wheels[plat].values():
                os.symlink(house.root / wheel.file, stage / "wheels" / wheel.file)
            report.wheelhouse_bytes += uv_size + sum(w.size for w in wheels[plat].values())
            use_relay = options.relay and relay.mesh_ready(hosts, {h.name: facts[h.name].get("mesh") or [] for h in hosts})
            report.relay = report.relay or use_relay
            say(f"sending uv and {len(wheels[plat])} wheel(s) ({fmt_size(report.wheelhouse_bytes)}) to {len(hosts)} host(s)"
                + (" through the mesh (relay)" if use_relay else " from this machine"))
            delivered.update(relay.distribute(fleet, inventory, stage, targets, hosts, relay=use_relay,
                                              on_done=lambda d: say(f"  {d.host}: {d.status} (from {d.via or '-'})" + (f": {d.error}" if d.error else ""))))
    installable = []
    for host in ready:
        d = delivered.get(host.name)
        outcome = report.hosts[host.name]
        if d is None:
            continue
        outcome.via, outcome.controller_bytes, outcome.notes = d.via, d.controller_bytes, list(d.notes)
        report.controller_bytes += d.controller_bytes
        if d.ok:
            installable.append(host)
        else:
            outcome.status = d.status if d.status in ("unreachable", "host-key-rejected") else "failed"
            outcome.error = "sending the wheels failed: " + d.error
    say(f"building the environment on {len(installable)} host(s)")
    env_id = _env_id(lock)

    def spec(host: Host) -> bytes:
        """The install's spec, sent on stdin after the script: never on a command line (an index URL may hold a
        token, and ps shows command lines to every user of the host)."""
        plan = plans[host.name]
        chosen = wheels[plan.platform]
        body = {"venv": host.venv, "id": env_id, "python": plan.python, "lock": lock.digest, "online": options.online,
                "indexes": lock.indexes(), "find_links": list(lock.find_links), "no_index": lock.no_index, "timeout": INSTALL_TIMEOUT,
                "watch_stdin": True,  # a lost connection before the switch leaves the previous environment
                "deadman": INSTALL_DEADMAN,  # and so does a silent one (no heartbeat)
                "uv_sha256": uv_sha256,  # the relayed uv is run only if it is the controller's
                "wheels": [_wheel_spec(pin, chosen.get(pin.name)) for pin in plan.pins]}
        return json.dumps(body, separators=(",", ":")).encode() + b"\n"

    payload = _script_payload()
    results = fleet.map(lambda h: _install_on(fleet, h, script_command(h, "install", "-"), payload + spec(h), INSTALL_TIMEOUT + 60), installable)
    for host in installable:
        result = results[host.name]
        data = parse_reply(result)
        outcome = report.hosts[host.name]
        outcome.seconds = result.seconds
        if data is None or not data.get("ok"):
            _fail(outcome, result, data)
            outcome.error += f"; {host.name} keeps its previous environment"
        else:
            outcome.status, outcome.env = "changed", data.get("env")


def _install_on(fleet: Fleet, host: Host, command: Command, payload: bytes, timeout: float) -> HostResult:
    """Run the install script with its stdin kept open (unlike Fleet.run_one), a heartbeat written to it every
    INSTALL_HEARTBEAT_EVERY seconds: the script switches the link only while the controller is still connected and
    heard, so a connection lost or silent mid-build leaves the previous environment."""
    import threading

    started = time.monotonic()
    try:
        process = fleet.start(host, command)
    except HostKeyRejected as exc:
        return HostResult(host.name, Status.HOST_KEY_REJECTED, error=str(exc))
    except Unreachable as exc:
        return HostResult(host.name, Status.UNREACHABLE, error=str(exc))
    stop = threading.Event()
    writing = threading.Lock()  # a heartbeat never cuts into the payload, nor follows the close of stdin

    def heartbeat() -> None:
        while not stop.wait(INSTALL_HEARTBEAT_EVERY):
            with writing:
                if stop.is_set():
                    return
                try:
                    process.write(b"\n")
                except Exception:  # noqa: BLE001 - the connection is gone: the wait below says so
                    return

    beat = threading.Thread(target=heartbeat, daemon=True, name=f"mnft-install-heartbeat-{host.name}")
    try:
        with writing:
            process.write(payload)
        beat.start()
        done = process.wait(timeout)
    except CommandTimeout as exc:
        return HostResult(host.name, Status.FAILED, error=f"command {exc}", seconds=round(time.monotonic() - started, 3))
    except OutputTooLarge as exc:
        return HostResult(host.name, Status.FAILED, error=str(exc), seconds=round(time.monotonic() - started, 3))
    except Unreachable as exc:
        fleet.mark_unreachable(host.name, str(exc))
        return HostResult(host.name, Status.UNREACHABLE, error=str(exc), seconds=round(time.monotonic() - started, 3))
    finally:
        stop.set()
        with writing:
            try:
                process.close_stdin()
            except Exception:  # noqa: BLE001 - the channel may be gone already
                pass
    status = Status.OK if done.exit_code == 0 else Status.FAILED
    result = HostResult(host.name, status, done.exit_code, done.stdout, done.stderr, seconds=round(time.monotonic() - started, 3))
    if status is Status.FAILED:
        result.error = f"exit code {done.exit_code}" + (f": {result.tail(1)}" if result.tail(1) else "")
    return result


def _wheel_spec(pin: Pin, wheel: Wheel | None) -> dict:
    if wheel is None:  # --online: the index serves it; the lock's hashes (if any) are checked by uv
        return {"name": pin.name, "version": pin.version, "sha256": None, "hashes": sorted(pin.hashes), "file": None, "installed_version": None}
    return {"name": pin.name, "version": wheel.installed_version or wheel.version, "sha256": wheel.sha256, "file": wheel.file,
            "installed_version": wheel.installed_version}


def _fail(outcome: HostOutcome, result: HostResult, data: dict | None) -> None:
    if data is None:
        outcome.status = result.status.value if result.status is not Status.OK else "failed"
        outcome.error = result.error or "failed"
    else:
        outcome.status, outcome.error = "failed", data.get("error") or "failed"


def _stage_parent(house: Wheelhouse) -> str:
    """The staging directory's parent: beside the wheelhouse (same filesystem), created when missing."""
    parent = house.root.parent
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _verify(outcome: HostOutcome, plan: HostPlan, result: HostResult | None, facts: dict | None) -> None:
    """After the run: the host's environment, read again, against the lock."""
    if facts is None:
        if outcome.status == "changed":
            outcome.status = result.status.value if result is not None and result.status is not Status.OK else "failed"
            outcome.error = "verification failed: " + ((result.error if result else "") or "no facts")
        return
    py, dists = env_state(facts)
    outcome.after = against_lock(dists, plan.pins)
    if py and ".".join(py.split(".")[:2]) != plan.platform.python:
        outcome.after = replace(outcome.after, python=(".".join(py.split(".")[:2]), plan.platform.python))
    outcome.python, outcome.env = py, (facts.get("env") or {}).get("target")
    outcome.fingerprint = fingerprint(py, dists)
    if outcome.status == "changed" and not outcome.after.empty:
        outcome.status = "failed"
        outcome.error = "the environment differs from the lock after provisioning: " + outcome.after.describe("lock")


def _record(inventory: Inventory, facts: Mapping[str, dict], plans: Mapping[str, HostPlan], report: ProvisionReport, lock: Lock) -> None:
    """Remember, per host whose environment matches the lock now, that its environment is the one to use."""
    if report.dry_run:
        return
    updates = {}
    for host in inventory.hosts:
        outcome = report.hosts.get(host.name)
        if outcome is None or outcome.status not in ("ok", "changed") or host.name not in facts:
            continue
        if outcome.status == "ok" and plans[host.name].action != "none":
            continue
        py, dists = env_state(facts[host.name])
        updates[host_key(host)] = {"host": host.name, "venv": host.venv, "python": env_python(host.venv), "lock": lock.digest,
                                   "fingerprint": fingerprint(py, dists), "at": time.time()}
    if updates:
        save_state(updates)


def _rollback(inventory: Inventory, say: Say, timeouts: Timeouts, started: float) -> ProvisionReport:
    inventory = effective(inventory)
    with Fleet(inventory, timeouts) as fleet, leases.hold(fleet, inventory.hosts, "provision --rollback", python=base_python,
                                                            per_host=leases.provision_scope):
        outcomes, facts = gather(fleet, list(inventory.hosts), None)
        plans = {h.name: plan_rollback(h, outcomes.get(h.name), facts.get(h.name)) for h in inventory.hosts}
        plans = _shared(fleet, inventory, plans, facts)  # a shared environment is switched back once
        _refuse(plans)
        report = ProvisionReport(inventory, None, None, {}, rollback=True)
        todo = [h for h in inventory.hosts if plans[h.name].action == "rollback"]
        say(f"switching {len(todo)} host(s) back to their previous environment")
        results = fleet.run(lambda h: script_command(h, "rollback", h.venv), stdin=_script_payload(), hosts=todo, timeout=FACTS_TIMEOUT)
        for host in inventory.hosts:
            plan = plans[host.name]
            if plan.action == "skip":
                report.hosts[host.name] = _outcome_of(plan, outcomes.get(host.name), None)
                continue
            if plan.action == "verify":
                report.hosts[host.name] = HostOutcome(host.name, "ok", "verify", notes=[plan.reason])
                continue
            result = results[host.name]
            data = parse_reply(result)
            outcome = HostOutcome(host.name, "rolled-back", "rollback")
            if data is None or not data.get("ok"):
                _fail(outcome, result, data)
            else:
                outcome.env = data.get("env")
                outcome.fingerprint = fingerprint((facts[host.name].get("previous") or {}).get("python"), data.get("dists") or {})
                outcome.notes.append(plan.reason)
            report.hosts[host.name] = outcome
        verifiers = [h for h in inventory.hosts if plans[h.name].action == "verify"]
        after_outcomes, after_facts = _read_shared(fleet, verifiers, plans, report, None)
        for host in verifiers:
            _verify_shared(report.hosts[host.name], plans[host.name], report.hosts[plans[host.name].builder],
                           after_outcomes.get(host.name), after_facts.get(host.name))
    report.seconds = round(time.monotonic() - started, 3)
    return report


# ------------------------------------------------------------------------------------------------ printing


