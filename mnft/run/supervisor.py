"""A detached run handed to its supervisor on the lab, and followed, refreshed and stopped from any terminal.

`mnft train --detach` judges its input here (as an attached train would, before any host is touched), then:

    place   where the supervisor lives: the inventory's `supervisor:` host, else the master (a local inventory: here)
    look    that host's Python and platform, mnft's bundle there or not, its mesh key (superhost look)
    bundle  mnft and its libraries unpacked there once per version (mnft.run.bundle, superhost unpack)
    prepare the run's directory there: the known host keys of the run's hosts, the provision record, a resumed run's record
    code    the run's code fixed here (sync.snapshot.fix), copied there with rsync
    start   `mnft.run.supervised` in a session of its own, its spec (inventory, options, the environment the run
            passes, secrets included) through a pipe, never written; it says it runs, then this terminal is free

From then on the supervisor is the run's `train`: checks, its place in line, the gang, restarts, the dead-man
(its leases' heartbeats), --notify, the record. This controller keeps runs/<id>/ as a mirror: `refresh` brings the
supervisor's record there (rsync) and says whether it is alive (its pid and start time); a supervisor gone while
its run had not ended is `supervisor-lost`, with the command that resumes the run. `attach` prints its console as
it grows; `stop` asks it to stop (the request file it reads, then SIGINT: Ctrl-C, as in an attached terminal).

Where detached supervision cannot work (no mesh key on the supervisor's host, a Python it cannot run mnft with, a
mixed local/SSH inventory), `why_not` says so with the fix: the run is then refused when it asked for what only a
supervisor gives (--max-restarts, spares, --wait), and otherwise started as before, unsupervised, with a warning.
"""

from __future__ import annotations

import base64
import binascii
import getpass
import hashlib
import hmac
import json
import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from mnft.core import limits
from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.hosts import pyrun
from mnft.hosts.connection import Timeouts, login_of
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.hostkeys import known_name, mnft_known_hosts
from mnft.hosts.settings import Host, Inventory
from mnft.onhost import superhost
from mnft.run import bundle as bundling
from mnft.run import launch as launching
from mnft.run import records
from mnft.run.superops import ENTRY, SupervisorError
from mnft.run.superops import one as _one

FINAL = ("succeeded", "failed", "stopped", "resumable", "idle-stopped", "refused", "sync-failed", "interrupted", "supervisor-lost",
         "dependency-failed")
KEEP_LOCAL = ("inventory", "supervisor", "started_in")  # what the controller's mirror keeps of its own on a refresh


@dataclass(frozen=True)
class Place:
    host: Host
    why: str  # said in the plan: "the inventory's supervisor", "the master (no supervisor: in the inventory)"


def place_of(inventory: Inventory) -> Place | None:
    """Where the run's supervisor lives (pure); None where no supervisor can (hosts both local and over SSH)."""
    local = [h for h in inventory.hosts if h.is_local]
    if inventory.supervisor is not None:
        return Place(inventory.supervisor, "the inventory's supervisor")
    if local and len(local) == len(inventory.hosts):
        return Place(inventory.master, "this machine (a local inventory)")
    if local:
        return None
    return Place(inventory.master, "the master (the inventory names no supervisor: host)")


def as_seen_from(inventory: Inventory, place: Place) -> Inventory:
    """The inventory as the supervisor reaches the hosts: as this user, by name (its login made explicit, as this
    controller's SSH resolves it), with the host's own keys (the mesh key through its ~/.ssh/config) instead of an
    identity file of this machine's; the known host keys go along as the run's own known_hosts file."""
    if place.host.is_local:
        return inventory
    hosts = tuple(replace(h, identity=None, user=login_of(h)) for h in inventory.hosts)
    return replace(inventory, hosts=hosts, known_hosts=None, supervisor=None)


def why_not(found: dict, the_bundle: bundling.Bundle, place: Place) -> str | None:
    """Why this host cannot supervise the run, with the fix (None: it can)."""
    if (why := bundling.compatible(the_bundle, found)) is not None:
        return f"{place.host.name} cannot run mnft: {why}"
    if not place.host.is_local and not found.get("mesh_key"):
        among = "" if place.host.rank >= 0 else f" listing {place.host.name} among its hosts"
        return (f"{place.host.name} has no mesh key (~/.ssh/mnft_mesh_ed25519) to reach the run's hosts as you: "
                f"run `mnft setup --only mesh` once (as yourself) with an inventory{among} of this lab")
    return None


def needs_supervisor(options: Any, inventory: Inventory) -> str | None:
    """What this run asked for that only a supervisor gives (None: nothing)."""
    if options.sweep is not None:
        return "a sweep"
    if options.after is not None and not options.after.get("local") and "where" in options.after:
        return "--after a detached run"
    if options.recovery.max_restarts:
        return "--max-restarts"
    if inventory.spares:
        return "spare hosts"
    if options.wait is not None:
        return "--wait"
    return None


def shipped_environ(options: Any) -> tuple[dict[str, str], Any]:
    """The values of the environment the run passes (PASSTHROUGH names set here, `--env NAME`, a job's pass_env,
    --env-file's lines), and the launch options with every --env-file turned into `--env NAME` (the files stay here)."""
    lopts = options.launch
    environ = launching.environ()
    names = [n for n in launching.PASSTHROUGH if n in environ]
    names += [spec for spec in lopts.env if "=" not in spec and spec in environ]
    names += [n for n in lopts.job.pass_env if n in environ]
    values = {n: environ[n] for n in names}
    specs = list(lopts.env)
    for path in lopts.env_files:
        for name, value in launching.read_env_file(path).items():
            values[name] = value
            if name not in specs:
                specs.append(name)
    return values, replace(lopts, env=tuple(specs), env_files=(), detach=False)


def _start(fleet: Fleet, host: Host, run_id: str, digest: str, spec: bytes, meanwhile) -> dict:
    """superhost's `start`: the supervisor spawned at once, `meanwhile()` done here (the code's copy), then its spec
    written; a failure meanwhile closes the op's stdin with no spec, and the host ends what it spawned."""
    from mnft.hosts.connection import CommandTimeout, HostKeyRejected, Unreachable

    try:
        process = fleet.start(host, pyrun.command(host, "start", run_id, digest, site=False))
    except (HostKeyRejected, Unreachable) as exc:
        raise SupervisorError(f"{host.name}: start: {exc}") from None
    sent = False
    try:
        process.write(pyrun.payload(ENTRY))
        meanwhile()
        process.write(spec)
        sent = True
    finally:
        try:
            process.close_stdin()
        except Exception:  # noqa: BLE001 - the channel may be gone already
            pass
        if not sent:
            try:
                process.wait(30)
            except Exception:  # noqa: BLE001 - the error that stopped us is the one to say
                pass
    try:
        done = process.wait(120)
    except (CommandTimeout, Unreachable) as exc:
        raise SupervisorError(f"{host.name}: start: {exc}") from None
    result = HostResult(host.name, Status.OK if done.exit_code == 0 else Status.FAILED, done.exit_code, done.stdout, done.stderr)
    data = pyrun.reply(result, "the supervisor's host (start)")
    if data is None or data.get("error"):
        raise SupervisorError(f"{host.name}: " + (data["error"] + (f"\n{data['log']}" if data.get("log") else "") if data else result.error or "start failed"))
    return data


def _known_lines(inventory: Inventory, after: dict | None = None) -> str:
    """This controller's recorded host keys for the run's hosts (public data), as the supervisor's known_hosts: the
    lines naming one of them, in plain or hashed form (`|1|salt|hmac`, as ssh-keygen -H writes them); and the host
    where the supervisor of the run it waits for (--after) lives."""
    wanted = {known_name(h.address, h.port or 22) for h in inventory.hosts}
    where = (after or {}).get("where") or {}
    if where.get("address"):
        wanted.add(known_name(str(where["address"]), int(((where.get("reach") or {}).get("port")) or 22)))
    out = []
    for path in (inventory.known_hosts, mnft_known_hosts()):
        if path is None or not Path(path).is_file():
            continue
        text = limits.read_bytes(path, limits.KNOWN_HOSTS_BYTES, "a known_hosts file", "KNOWN_HOSTS_BYTES").decode("utf-8", "replace")
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 3 and not line.startswith(("#", "@")) and any(_names(entry, wanted) for entry in parts[0].split(",")):
                out.append(line)
    return "\n".join(out) + ("\n" if out else "")


def _names(entry: str, wanted: set[str]) -> bool:
    if not entry.startswith("|1|"):
        return entry in wanted
    try:
        salt, digest = (base64.b64decode(x) for x in entry[3:].split("|", 1))
    except (ValueError, binascii.Error):
        return False
    return any(hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest) for name in wanted)


def _push(host: Host, src: Path, target: str, inventory: Inventory) -> None:
    from mnft.sync.rsync import SshSettings, rsync_argv, run_rsync

    with tempfile.NamedTemporaryFile("wb", suffix=".rules") as rules:
        rules.flush()
        argv = rsync_argv(host, src, target, rules.name, SshSettings.for_inventory(inventory), delete=False, mkpath=False)
        outcome = run_rsync(argv)
    if outcome.exit_code != 0:
        said = outcome.stderr.strip().splitlines()
        raise SupervisorError(f"{host.name}: the run's code did not reach the supervisor: {said[-1] if said else f'rsync exit {outcome.exit_code}'}")


def _pull(host: Host, run_id: str, into: Path, inventory: Inventory, inner: tuple[str, ...] | None = None) -> bool:
    """The supervisor's record of the run into `into` (rsync; its stop request and the controller's own keys stay);
    `inner`: a sweep's records instead (its own and its points', runs/<id>/ each), into the runs directory `into`."""
    from mnft.sync.rsync import SshSettings, ssh_command

    import subprocess

    tail = f"{run_id}/runs/" if inner is not None else f"{run_id}/runs/{run_id}/"
    rules = [a for name in inner or () for a in ("--include", f"/{name}/", "--include", f"/{name}/**")] + (["--exclude", "*"] if inner is not None else [])
    common = ["--exclude", records.STOP_REQUESTED, "--exclude", "run.json.tmp", "--exclude", "live.tmp", *rules]
    if host.is_local:
        argv = ["rsync", "-a", *common, os.path.expanduser(superhost.RUNS) + "/" + tail, str(into) + "/"]
    else:
        address = f"[{host.address}]" if ":" in host.address else host.address
        argv = ["rsync", "-a", "-s", "--timeout=30", *common, "-e", ssh_command(host, SshSettings.for_inventory(inventory)),
                f"{address}:{superhost.RUNS[2:]}/{tail}", str(into) + "/"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:  # the record stays as it was here; the next refresh asks again
        return False
    return done.returncode == 0


def _points_going(record: records.RunRecord) -> bool:
    """A sweep some of whose points had not ended when last seen (its supervisor lost: they run on, each under its
    own keepers): its records are still brought here."""
    if record.data.get("kind") != "sweep":
        return False
    for point in (record.data.get("sweep") or {}).get("points") or []:
        path = records.path_of(str(point.get("run_id"))) if isinstance(point, dict) else None
        try:
            state = records.read_record(path / "run.json").get("state") if path is not None else point.get("state")
        except InputError:
            continue
        if point.get("started") and state not in FINAL:
            return True
    return False


def _points_mirrored(record: records.RunRecord, host: Host, inventory: Inventory, where: dict) -> None:
    """A sweep's points' records here, beside its own (one rsync): each with this controller's inventory of its
    hosts and the sweep's supervisor, so that status, logs and stop of a point reach its hosts from here."""
    from mnft.run.rerun import snapshot

    ids = tuple(p["run_id"] for p in (record.data.get("sweep") or {}).get("points") or [] if isinstance(p, dict) and records.RUN_ID.fullmatch(str(p.get("run_id"))))
    root = record.path.parent
    _pull(host, record.run_id, root, inventory, (record.run_id, *ids))
    for point_id in ids:
        path = root / point_id / "run.json"
        if not path.is_file():
            continue
        try:
            data = records.read_record(path)
        except InputError:
            continue
        names = [h.get("name") for h in (data.get("inventory") or {}).get("hosts") or [] if isinstance(h, dict)]
        mine = inventory.only(names) if names else inventory
        data.update(inventory=snapshot(mine), supervisor=dict(where, sweep=record.run_id, point=(data.get("sweep") or {}).get("index")),
                    started_in=record.data.get("started_in"))
        point = records.RunRecord(path.parent, data)
        point.save()
        records.add_to_index(point.path)


# ------------------------------------------------------------------------------------------------ hand off


def hand_off(inventory: Inventory, options: Any, console: Console) -> int | None:
    """Start the run under a supervisor on the lab and return (None: no supervisor can run it here and it asked for
    nothing only one gives: the caller starts it unsupervised, as before, after the warning said here)."""
    from mnft.run.rerun import previous_run, snapshot
    from mnft.run.train import judged_input, not_resumable, source_for

    t0 = time.monotonic()
    lopts = options.launch
    job = lopts.job
    options = replace(options, src=source_for(job, options.src))
    judged_input(inventory, options, lopts)
    previous = previous_run(options.resume_run) if (options.resume_run is not None or lopts.resume) else None
    if previous is not None and (why := not_resumable(job)):
        raise InputError(why)
    place = place_of(inventory)
    asked = needs_supervisor(options, inventory)
    if place is None:
        return _unsupervised("the inventory has hosts both local (connection: local) and over SSH: no one host can reach them all; "
                             "give it a `supervisor:` host that reaches them over SSH", asked, console)
    from concurrent.futures import ThreadPoolExecutor

    from mnft.env.record import state_path
    from mnft.sync.snapshot import fix

    spent: dict[str, float] = {}
    code = None
    with ThreadPoolExecutor(1) as pool, Fleet(_alone(inventory, place.host), Timeouts(connect=10.0)) as fleet:
        fixing = pool.submit(fix, options.src) if options.sync else None  # the code fixed here while the host is asked
        try:
            try:
                the_bundle = bundling.build()
                found = _one(fleet, place.host, "look", the_bundle.digest)
                spent["look_s"] = round(time.monotonic() - t0, 3)
                if (why := why_not(found, the_bundle, place)) is not None:
                    return _unsupervised(why, asked, console)
                if not found.get("bundle"):
                    console.print(Text(f"placing mnft on {place.host.name} for detached runs ({bundling.size(the_bundle) // 1024} KiB, "
                                       "once per version)"), soft_wrap=True)
                    _one(fleet, place.host, "unpack", the_bundle.digest, stdin=bundling.contents(the_bundle), timeout=600)
                run_id = launching.new_run_id()
                files = {"home/known_hosts": _known_lines(inventory, options.after)}
                if state_path().is_file():
                    files["home/provision/hosts.json"] = limits.read_file(state_path(), limits.STATE_BYTES, "the provision record", "STATE_BYTES").decode()
                if previous is not None:
                    files[f"runs/{previous.run_id}/run.json"] = json.dumps(previous.data)
                for point in (options.sweep.resumed if options.sweep is not None else ()):  # a sweep's points run again from their records
                    files[f"runs/{point.run_id}/run.json"] = json.dumps(point.data)
                folder = _one(fleet, place.host, "prepare", run_id, stdin=json.dumps(files).encode())["dir"]
            finally:
                code = fixing.result() if fixing is not None else None
            spent["prepare_s"] = round(time.monotonic() - t0, 3)
            environ, sup_lopts = shipped_environ(options)
            where = {"host": place.host.name, "address": place.host.address, "why": place.why, "dir": folder,
                     "reach": {k: getattr(place.host, k) for k in ("user", "port", "identity", "python", "connection")}}
            as_given = {"env_specs": list(lopts.env), "env_files": list(lopts.env_files), "src": str(code.source) if code is not None else None}
            src_there = Path(folder) / "src" if code is not None else None
            sup_options = replace(options, launch=sup_lopts, src=src_there, run_id=run_id, supervisor={**where, "as_given": as_given})
            the_spec = {"run_id": run_id, "inventory": as_seen_from(inventory, place), "options": sup_options, "environ": environ}
            kept = dict(job=job.to_record(), recipe=job.recipe, detach=True, supervisor=where, hosts={}, attempts=[],
                        code_hash=code.tree.digest if code is not None else None,
                        code={"src": str(code.source), "hash": code.tree.digest} if code is not None else None,
                        env_specs=list(lopts.env), env_files=list(lopts.env_files))
            if options.sweep is not None:  # one supervisor keeps the sweep's queue; its points are runs of their own
                from mnft.run.sweep import KIND

                the_sweep = options.sweep.record(run_id, options.after)
                the_spec.update(sweep=the_sweep, record=dict(kept, kind=KIND, sweep=the_sweep, inventory=snapshot(as_seen_from(inventory, place)),
                                                             state="running", launched=True, resumed_from=options.sweep.resumed_from))
                kept.update(kind=KIND, sweep=the_sweep, resumed_from=options.sweep.resumed_from)
            spec = pickle.dumps(the_spec)
            record = records.RunRecord.create(
                run_id, **dict(dict(job_id=run_id if previous is None else previous.data.get("job_id", previous.run_id),
                                    resumed_from=previous.run_id if previous else None), **kept),
                state="handed-over", launched=False, inventory=snapshot(inventory),
            )
            try:  # the supervisor starts (its imports) while the code is copied there; its spec follows the code
                started = _start(fleet, place.host, run_id, the_bundle.digest, spec,
                                 lambda: _push(place.host, code.tree.root, f"{folder}/src", inventory) if code is not None else None)
            except (MnftError, KeyboardInterrupt) as exc:  # recorded as ended, never left `handed-over`
                record.update(state="failed" if isinstance(exc, MnftError) else "interrupted",
                              reason=f"its supervisor on {place.host.name} did not start: {str(exc).splitlines()[0] if str(exc) else 'interrupted'}")
                raise
        finally:
            if code is not None:
                code.release()
        spent["handoff_s"] = round(time.monotonic() - t0, 3)
        where.update(pid=started["pid"], start=started["start"], since=time.time(), alive=True, seen=time.time(), timings=spent)
        record.update(supervisor=where, launched=True, state="supervised")
        if options.sweep is not None:
            points = len(record.data["sweep"]["points"])
            console.print(Text.assemble((f"sweep {run_id}", "bold"), f" ({points} point(s), each a run of its own) handed to its supervisor on "
                                        f"{place.host.name} ({place.why}; pid {started['pid']}): it starts the points on free GPUs as they free up, "
                                        "with this terminal closed"), soft_wrap=True)
        else:
            console.print(Text.assemble((f"run {run_id}", "bold"), f" handed to its supervisor on {place.host.name} ({place.why}; pid {started['pid']}): "
                                        "it checks, syncs, waits in line, runs and restarts there, with this terminal closed"), soft_wrap=True)
        exit_code = _until_started(fleet, place.host, record, console)
    refresh(record)
    if exit_code == ExitCode.OK:
        console.print(Text(f"follow it: mnft attach {run_id}   status: mnft status {run_id}   stop it: mnft stop {run_id}"), soft_wrap=True)
    return exit_code


START_STATES = ("running", "waiting")  # a handed-over run has started once its record says one of these


def _until_started(fleet: Fleet, host: Host, record: records.RunRecord, console: Console, poll: float = 1.0) -> int:
    """The supervisor's console, here, until its run runs on the hosts or waits in line (0), or the supervisor ended
    first (its exit code: a refused check, a busy host, bad code): as an attached start says it. Ctrl-C here only
    stops following."""
    offset = 0
    try:
        while True:
            found = _one(fleet, host, "state", record.run_id, str(offset), timeout=30)
            if found.get("log"):
                console.out(found["log"], end="", highlight=False)
            offset = found.get("offset", offset)
            if found.get("run_state") in START_STATES:
                return ExitCode.OK
            if not found.get("alive") and not found.get("log"):
                return int((found.get("exit") or {}).get("code", ExitCode.FAILED))
            time.sleep(poll)
    except KeyboardInterrupt:
        console.print(Text(f"\nstopped following; run {record.run_id} goes on", style="yellow"))
        return ExitCode.OK


def _alone(inventory: Inventory, host: Host) -> Inventory:
    return replace(inventory, hosts=(host,), master_name=host.name, supervisor=None)


def _unsupervised(why: str, asked: str | None, console: Console) -> None:
    if asked is not None:
        raise SupervisorError(f"--detach with {asked} needs a supervisor on the lab, and none can run: {why}")
    console.print(Text.assemble(("warning: ", "bold yellow"), f"this detached run has no supervisor (a failed rank or lost host is not "
                                f"torn down until the collective times out): {why}"), soft_wrap=True)
    return None


# ------------------------------------------------------------------------------------------------ afterwards


def is_point(record: records.RunRecord) -> bool:
    """A point of a sweep (its train runs in the sweep's supervisor): its end is its own, not its supervisor's."""
    return bool((record.data.get("supervisor") or {}).get("sweep")) and record.data.get("kind") != "sweep"


def supervised(record: records.RunRecord) -> bool:
    return isinstance(record.data.get("supervisor"), dict) and bool(record.data["supervisor"].get("pid"))


def _host_of(record: records.RunRecord) -> tuple[Host, Inventory]:
    from mnft.hosts.settings import validate_host
    from mnft.run.rerun import from_snapshot

    inventory = from_snapshot(record.data.get("inventory"), f"{record.path}/run.json")
    where = record.data["supervisor"]
    for host in inventory.hosts:
        if host.name == where.get("host"):
            return host, inventory
    reach = where.get("reach") if isinstance(where.get("reach"), dict) else {}
    settings = {"address": where.get("address"), **{k: v for k, v in reach.items() if k in ("user", "port", "identity", "python", "connection") and v is not None}}
    return validate_host(str(where.get("host")), -1, settings, {}, f"{record.path}/run.json: supervisor"), inventory


def refresh(record: records.RunRecord, console: Console | None = None) -> dict:
    """The supervisor's record mirrored into runs/<id>/ and its liveness said in `supervisor` (alive, seen); a
    supervisor gone while its run had not ended makes the run `supervisor-lost`, with the command that resumes it."""
    if not supervised(record):
        return {}
    if (record.data.get("supervisor") or {}).get("sweep") and record.data.get("kind") != "sweep":  # a point: its sweep is what is refreshed
        try:
            sweep_record = records.load(record.data["supervisor"]["sweep"], anywhere=True)
        except InputError:
            return dict(record.data["supervisor"])
        where = refresh(sweep_record, console)
        if (record.path / "run.json").is_file():
            record.data = records.read_record(record.path / "run.json")
        return where
    mine = {k: record.data.get(k) for k in KEEP_LOCAL}
    where = dict(mine["supervisor"])
    if record.data.get("state") in FINAL and where.get("alive") is False and not _points_going(record):
        return where
    host, inventory = _host_of(record)
    try:
        with Fleet(_alone(inventory, host), Timeouts(connect=10.0)) as fleet:
            found = _one(fleet, host, "state", record.run_id, "0", timeout=30)
    except MnftError as exc:
        where.update(alive=None, error=str(exc).splitlines()[0])
        record.update(supervisor=where)
        return where
    pid_ok = (found.get("supervisor") or {}).get("pid") == where.get("pid")
    alive = bool(found.get("alive")) and pid_ok
    if record.data.get("kind") == "sweep":
        _points_mirrored(record, host, inventory, dict(where, alive=alive, seen=time.time()))
    else:
        _pull(host, record.run_id, record.path, inventory)
    fresh = records.read_record(record.path / "run.json") if (record.path / "run.json").is_file() else record.data
    fresh.update({k: v for k, v in mine.items() if v is not None})
    where.update(alive=alive, seen=time.time(), exit=found.get("exit"), error=None)
    fresh["supervisor"] = where
    record.data = fresh
    if not alive and fresh.get("state") not in FINAL:
        from mnft.run.control import job_of
        from mnft.run.rerun import resume_hint

        fresh.update(state="supervisor-lost", reason=f"its supervisor on {where['host']} (pid {where.get('pid')}) is gone while the run had not ended; "
                                                     f"{resume_hint(record.run_id, job_of(fresh))}")
    record.save()
    return where


def attach(record: records.RunRecord, console: Console, poll: float = 1.0) -> int:
    """The supervisor's console as it grows, until the supervisor ends; Ctrl-C only stops following."""
    host, inventory = _host_of(record)
    offset = 0
    try:
        with Fleet(_alone(inventory, host), Timeouts(connect=10.0)) as fleet:
            while True:
                found = _one(fleet, host, "state", record.run_id, str(offset), timeout=30)
                if found.get("log"):
                    console.out(found["log"], end="", highlight=False)
                offset = found.get("offset", offset)
                if not found.get("alive") and not found.get("log"):
                    break
                time.sleep(poll)
    except KeyboardInterrupt:
        console.print(Text(f"\nstopped following; run {record.run_id} goes on (mnft stop {record.run_id} stops it)", style="yellow"))
        return ExitCode.OK
    refresh(record)
    exit_ = (record.data.get("supervisor") or {}).get("exit") or {}
    console.print(Text(f"run {record.run_id}: {record.data.get('state')}" + (f": {record.data.get('reason')}" if record.data.get("reason") else "")),
                  soft_wrap=True)
    return int(exit_.get("code", ExitCode.FAILED)) if exit_ else ExitCode.FAILED


def request_stop(record: records.RunRecord) -> dict:
    """Ask the run's supervisor to stop the run (its request file, then SIGINT to it alone)."""
    host, inventory = _host_of(record)
    by = f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"
    sweep = (record.data.get("supervisor") or {}).get("sweep") if record.data.get("kind") != "sweep" else None
    with Fleet(_alone(inventory, host), Timeouts(connect=10.0)) as fleet:  # a point of a sweep: its own train, in the sweep's supervisor
        return _one(fleet, host, "stop", *((sweep, by, record.run_id) if sweep else (record.run_id, by)), timeout=30)


def settled(record: records.RunRecord, within: float, every: float = 1.0, sleep=time.sleep, say=None) -> dict:
    """Refresh until the supervisor has ended (the run's record final, its logs collected), at most `within` s;
    a supervisor that cannot be reached is asked again, and `say` told so once (and once when it answers again)."""
    deadline = time.monotonic() + within
    where = refresh(record)
    unreached = False
    point = is_point(record)  # a point of a sweep: its own end, not its sweep's

    def going() -> bool:
        return where.get("alive") is not False and not (point and record.data.get("state") in FINAL)

    while going() and time.monotonic() < deadline:
        if say is not None and (where.get("alive") is None) != unreached:
            unreached = not unreached
            say(f"its supervisor on {where.get('host')} is not reached ({where.get('error')}): still asking" if unreached
                else f"its supervisor on {where.get('host')} answers again")
        sleep(every)
        where = refresh(record)
    return where


def stopped(record: records.RunRecord, within: float, console: Console, as_json: bool) -> int:
    """`mnft stop` of a supervised run that had not started on the hosts (waiting in line, checking): its
    supervisor ended, the run recorded stopped."""
    from mnft.core.output import print_json

    where = settled(record, within)
    state = record.data.get("state")
    if is_point(record):  # its sweep's supervisor goes on with the other points
        where = dict(where, alive=state not in FINAL)
    if as_json:
        print_json({"run": record.run_id, "state": state, "supervisor": where})
    else:
        console.print(Text(f"run {record.run_id}: {state}" + (f" ({record.data.get('reason')})" if record.data.get("reason") else "")
                           + ("" if not where.get("alive") else f"; its supervisor on {where.get('host')} has not ended yet")), soft_wrap=True)
    return ExitCode.OK if state == "stopped" and not where.get("alive") else ExitCode.FAILED


def judge_after(after: Any, detached: bool) -> dict | None:
    """What the dependent run needs to wait for RUN (None: no --after); a RUN unknown here is bad input."""
    if after is None:
        return None
    from mnft.run.after import ENDED

    record = records.load(after.run_id, anywhere=True)
    if record.data.get("slurm"):
        raise InputError(f"--after {after.run_id}: run {after.run_id} is a Slurm job: chain Slurm jobs with Slurm's own --dependency (sbatch)")
    if supervised(record):
        refresh(record)
    dep: dict[str, Any] = {"run_id": after.run_id, "any": after.any_end, "state": record.data.get("state")}
    if record.data.get("state") in ENDED:
        return dep
    where = record.data.get("supervisor") if supervised(record) else None
    if where is not None:
        folder = where.get("dir")
        dep["where"] = {k: where.get(k) for k in ("host", "address", "reach", "pid", "start")}
        dep["where"]["dir"] = folder
        dep["where"]["name"] = os.path.basename(str(folder).rstrip("/")) if folder else after.run_id
        return dep
    if detached:
        raise InputError(f"--after {after.run_id}: run {after.run_id} is attached to a terminal on this machine, which a detached run's "
                         f"supervisor on the lab cannot watch: wait for it here (leave out --detach), or start {after.run_id} with --detach")
    dep["local"] = True
    return dep


# ------------------------------------------------------------------------------------------------ mnft check


def look_supervision(inventory: Inventory) -> tuple[dict, str | None]:
    """For `mnft check`: whether this user's detached runs can be supervised on this lab (where, and the hosts its
    key reaches), and the fix when they cannot: (what was found, why not or None)."""
    place = place_of(inventory)
    if place is None:
        why = "the inventory has hosts both local and over SSH: give it a `supervisor:` host that reaches them all"
        return {"host": None, "ok": False, "why": why}, why
    found: dict = {"host": place.host.name, "why_here": place.why}
    the_bundle = bundling.described()
    try:
        with Fleet(_alone(inventory, place.host), Timeouts(connect=10.0)) as fleet:
            seen = _one(fleet, place.host, "look", the_bundle.digest or "0" * 32)
            found["bundle"] = bool(seen.get("bundle"))
            why = why_not(seen, the_bundle, place)
            if why is None and not place.host.is_local:
                peers = [{"name": h.name, "address": h.address, "port": h.port or 22, "user": h.user}
                         for h in as_seen_from(inventory, place).hosts]
                said = _one(fleet, place.host, "reach", stdin=json.dumps(peers).encode(), timeout=60).get("peers") or {}
                refused = {name: text for name, text in said.items() if text}
                found["reaches"] = sorted(name for name, text in said.items() if not text)
                if refused:
                    why = (f"{place.host.name}'s ssh (your mesh key) does not reach " + "; ".join(f"{n}: {t}" for n, t in sorted(refused.items()))
                           + ": run `mnft setup --only mesh` with this inventory (as yourself)")
    except MnftError as exc:
        why = f"{place.host.name} did not answer: {str(exc).splitlines()[0]}"
    found.update(ok=why is None, why=why)
    return found, why


def supervision_line(found: dict) -> str:
    if not found.get("ok"):
        return f"detached runs: no supervisor can run on this lab: {found.get('why')}"
    placed = "" if found.get("bundle") else "; mnft places itself there at the first --detach"
    reached = f"; its ssh reaches {', '.join(found['reaches'])}" if found.get("reaches") else ""
    return f"detached runs: supervised on {found['host']} ({found['why_here']}){reached}{placed}"
