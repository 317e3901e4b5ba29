"""`mnft sync --image REF`: an image present on this machine or on one host reaches every host that lacks it, without
a registry, verified by its id. Read → plan → apply, as everywhere in mnft:

* read: every host's image facts (mnft.image.facts: one round-trip each) and this machine's own;
* plan (pure, `plan`): the reference id is this machine's copy when it has one, else the first host's (inventory
  order) that has it; a host holding it does nothing, a host lacking it receives it, a host holding another id is a
  refusal naming it (`--force`: it receives the reference too), hosts sharing the directory of a .sif receive it
  once (the others verify that they see it), a host not read is skipped with its outcome;
* apply: the source saves the image once into a staging directory (`podman save` as a docker-archive, `docker
  save`; a .sif is linked there), the directory reaches the receivers through `mnft.sync.relay` (with `invoke
  setup`'s mesh: from the source host, or the controller's first receiver, host to host, holders doubling each
  round; without it, from the controller, after fetching it from a source host), each receiver loads it (a .sif:
  renamed into place), checks the id it got and tags it REF (imagehost's `load`, `place`), and every receiver and
  verifier reads its facts again: the id must be the reference's. The staging directories go on every host, failure
  or not: nothing is left but the image.

Staging directories: /var/tmp/mnft-image-TOKEN-HOST (an image), DIR/.mnft-image-TOKEN-HOST beside a .sif at DIR/…
(the same filesystem: the rename into place is atomic; hosts that see each other's directory there share it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from mnft.core.errors import ExitCode, InputError
from mnft.hosts import pyrun
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory
from mnft.onhost import imagehost
from mnft.image.facts import (
    CONTROLLER,
    FACTS_TIMEOUT,
    check_image,
    controller_facts,
    gather,
    local_inventory,
    payload,
    runtime_setting,
    script_command,
)
from mnft.image.runtime import expand

STAGE_PARENT = "/var/tmp"  # an image's archive is staged here (local disk: podman's own image_copy_tmp_dir)
MOVE_TIMEOUT = imagehost.MOVE_TIMEOUT + 60.0  # a save or load of many GB (the host's own timeout first)
SHARED_WAIT = 10.0  # seconds a host sharing a .sif's directory may still see the old file (an NFS client's cache)


def short(ident: str | None) -> str:
    """An id as a person reads it: sha256: and 12 hex digits (as `podman images` shows it)."""
    return ident[:19] if ident and ident.startswith("sha256:") else str(ident)


# ------------------------------------------------------------------------------------------------ plan (pure)


@dataclass(frozen=True)
class HostPlan:
    host: str
    action: str  # none (holds the reference) | receive | verify (sees a receiver's copy: a shared directory) | skip (not read)
    held: str | None = None  # the id it holds now
    reason: str = ""
    via: str | None = None  # verify: the receiver whose copy it sees


@dataclass(frozen=True)
class Plan:
    image: str
    sif: bool
    reference: str | None  # the id every host must hold
    source: str | None  # CONTROLLER or the host holding the reference
    hosts: dict[str, HostPlan]
    refusal: str | None = None  # bad input: nothing is done anywhere

    @property
    def receivers(self) -> list[str]:
        return [h.host for h in self.hosts.values() if h.action == "receive"]

    @property
    def verifiers(self) -> list[str]:
        return [h.host for h in self.hosts.values() if h.action == "verify"]


def plan(image: str, order: Sequence[str], facts: Mapping[str, dict], unread: Mapping[str, str], controller: dict | None = None, *,
         force: bool = False, shared: Mapping[str, tuple[str, ...]] | None = None) -> Plan:
    """Who holds the reference, who receives it, who refuses. facts: the hosts that answered (imagehost's facts);
    unread: the others, with why; controller: this machine's facts (None: it has no runtime or was not asked);
    shared: groups of hosts that see one directory (a .sif's), as mnft.sync.mirror.groups_of gives them."""
    sif = imagehost.is_path_image(image)
    held = {name: _held(f) for name, f in facts.items()}
    not_files = [f"{name}: {facts[name]['error']}" for name in order if name in facts and (facts[name].get("error") or "").endswith(" is not a file")]
    if not_files:
        return Plan(image, sif, None, None, {}, f"{image}: " + "; ".join(not_files) + ": a .sif image is a file")
    local = _held(controller) if controller else None
    if local:
        reference, source = local, CONTROLLER
    else:
        source = next((name for name in order if held.get(name)), None)
        reference = held.get(source) if source else None
    if reference is None:
        where = "this machine" if controller is not None else "this machine (it has no container runtime)"
        silent = [name for name in order if name in unread]
        missing = [f"{name} ({facts[name]['error']})" if facts[name].get("error") else name for name in order if name in facts]
        return Plan(image, sif, None, None, {}, f"{image}: no host has it, nor {where}" + (f"; looked on {', '.join(missing)}" if missing else "")
                    + (f"; not asked: {', '.join(silent)} (not reachable)" if silent else ""))
    hosts: dict[str, HostPlan] = {}
    differing = []
    for name in order:
        if name not in facts:
            hosts[name] = HostPlan(name, "skip", reason=unread.get(name, "not read"))
            continue
        have = held[name]
        error = facts[name].get("error")
        if have == reference:
            hosts[name] = HostPlan(name, "none", have, "holds it")
        elif not sif and error and not have:  # no runtime to load it into: that host fails, the others go on
            hosts[name] = HostPlan(name, "skip", reason=error)
        elif have is None:
            hosts[name] = HostPlan(name, "receive", None, "lacks it")
        elif force:
            hosts[name] = HostPlan(name, "receive", have, f"replaces {short(have)} (--force)")
        else:
            differing.append(name)
            hosts[name] = HostPlan(name, "none", have, "holds another image")
    if differing:
        holder = "this machine" if source == CONTROLLER else source
        shown = ", ".join(f"{name} has {short(held[name])}" for name in differing)
        return Plan(image, sif, reference, source, hosts, f"{image}: {shown}, {holder} has {short(reference)}: "
                    "pass --force to replace theirs with the reference (or make the reference the image you want)")
    return with_sharing(Plan(image, sif, reference, source, hosts), shared or {})


def with_sharing(p: Plan, shared: Mapping[str, tuple[str, ...]]) -> Plan:
    """Receivers that see one directory (groups as mnft.sync.mirror.groups_of gives them): the first receives, the
    others verify that they see its copy."""
    hosts = dict(p.hosts)
    for group in _groups(shared, p.receivers):
        for name in group[1:]:
            hosts[name] = replace(hosts[name], action="verify", via=group[0], reason=f"shares {group[0]}'s directory: sees its copy")
    return replace(p, hosts=hosts)


def _held(facts: dict | None) -> str | None:
    image = (facts or {}).get("image") or {}
    return imagehost.normal_id(image.get("id") or "") if image.get("present") else None


def _groups(shared: Mapping[str, tuple[str, ...]], receivers: Sequence[str]) -> list[tuple[str, ...]]:
    """The receivers grouped by the directory they share (each group in inventory order), more than one each."""
    out, placed = [], set()
    for name in receivers:
        if name in placed:
            continue
        group = tuple(n for n in shared.get(name, (name,)) if n in receivers)
        placed.update(group)
        if len(group) > 1:
            out.append(group)
    return out


def stage_dir(image: str, home: str, token: str, host: str) -> str:
    """Where a host keeps the image in transit (imagehost's prepare makes it, its load or place removes it)."""
    name = f"{imagehost.STAGE_PREFIX}{token}-{host}"
    if imagehost.is_path_image(image):
        return os.path.join(os.path.dirname(os.path.abspath(expand(image, home))), "." + name)
    return f"{STAGE_PARENT}/{name}"


# ------------------------------------------------------------------------------------------------ report


@dataclass
class HostOutcome:
    host: str
    status: str  # ok | changed | would-change | failed | unreachable | host-key-rejected
    action: str
    id: str | None = None  # what it holds after the sync
    via: str = ""  # where its copy came from: controller, a peer, or the host whose directory it shares
    error: str = ""
    seconds: float = 0.0
    controller_bytes: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class ImageReport:
    image: str
    reference: str | None
    source: str | None
    hosts: dict[str, HostOutcome]
    dry_run: bool = False
    relay: bool = False
    archive_bytes: int = 0
    controller_bytes: int = 0  # bytes this machine sent to the hosts: the sum of the hosts' rows
    fetched_bytes: int = 0  # bytes this machine fetched from the source host (no mesh to relay host to host)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code() is ExitCode.OK

    def exit_code(self) -> ExitCode:
        statuses = {h.status for h in self.hosts.values()}
        if statuses & {Status.UNREACHABLE.value, Status.HOST_KEY_REJECTED.value}:
            return ExitCode.UNREACHABLE
        return ExitCode.FAILED if "failed" in statuses else ExitCode.OK

    def to_json(self) -> dict:
        return {"image": self.image, "id": self.reference, "source": self.source, "dry_run": self.dry_run, "relay": self.relay,
                "archive_bytes": self.archive_bytes, "controller_bytes": self.controller_bytes, "fetched_bytes": self.fetched_bytes,
                "seconds": self.seconds,
                "ok": self.ok, "hosts": {name: asdict(h) for name, h in self.hosts.items()}}


# ------------------------------------------------------------------------------------------------ apply


Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def sync_image(inventory: Inventory, image: str, *, force: bool = False, dry_run: bool = False, relay: bool = True, say: Say = _quiet,
               progress: "Progress | None" = None, timeouts: Timeouts = Timeouts(connect=10, command=FACTS_TIMEOUT),
               controller_runtime: str = "auto") -> ImageReport:
    """read → plan → (dry run: stop) → prepare → save once → relay → load → verify; staging removed everywhere.
    controller_runtime: this machine's runtime, as imagehost takes it (auto, a kind, an absolute path)."""
    started = time.monotonic()
    check_image(image)
    if imagehost.is_path_image(image) and not image.startswith(("/", "~/")):
        raise InputError(f"--image {image!r}: a .sif is given by its path: absolute, or ~/… (the same path on every host)")
    _local_file(image)
    _, local = controller_facts(image, controller_runtime)
    with Fleet(inventory, timeouts) as fleet:
        say(f"reading {image} on {len(inventory.hosts)} host(s) and on this machine")
        outcomes, facts = gather(fleet, inventory.hosts, image)
        unread = {r.host: r.error or r.status.value for r in outcomes if r.host not in facts}
        order = [h.name for h in inventory.hosts]
        the_plan = plan(image, order, facts, unread, local, force=force)
        if the_plan.refusal:
            raise InputError(the_plan.refusal + "; nothing was changed on any host")
        report = ImageReport(image, the_plan.reference, the_plan.source, _before(the_plan, outcomes, dry_run), dry_run=dry_run)
        if dry_run or not the_plan.receivers:
            if not the_plan.receivers:
                say(f"every host that answered holds {short(the_plan.reference)}: nothing to do")
            report.seconds = round(time.monotonic() - started, 3)
            return report
        _apply(fleet, inventory, the_plan, facts, report, relay, say, progress, controller_runtime)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _local_file(image: str) -> None:
    """A .sif path that exists on this machine and is not a file: bad input, before any host is asked."""
    if not imagehost.is_path_image(image):
        return
    path = os.path.expanduser(image)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # not here: a host may have it
    if not stat.S_ISREG(mode):
        raise InputError(f"--image {image}: not a file (a .sif image is one file)")


def _before(p: Plan, outcomes, dry_run: bool) -> dict[str, HostOutcome]:
    out = {}
    for name, hp in p.hosts.items():
        if hp.action == "skip":
            result = outcomes[name]
            status = result.status.value if result.status is not Status.OK else "failed"
            out[name] = HostOutcome(name, status, hp.action, error=hp.reason)
        elif hp.action == "none":
            out[name] = HostOutcome(name, "ok", hp.action, id=hp.held, notes=[hp.reason])
        else:
            out[name] = HostOutcome(name, "would-change" if dry_run else "pending", hp.action, id=hp.held, notes=[hp.reason])
    return out


def _apply(fleet: Fleet, inventory: Inventory, p: Plan, facts: dict[str, dict], report: ImageReport, relay: bool,
           say: Say, progress: "Progress | None", controller_runtime: str = "auto") -> None:
    token = secrets.token_hex(6)
    by_name = {h.name: h for h in inventory.hosts}
    source_host = by_name.get(p.source) if p.source != CONTROLLER else None
    involved = [by_name[n] for n in [*([p.source] if source_host else []), *p.receivers]]
    targets = {h.name: stage_dir(p.image, facts[h.name]["home"], token, h.name) for h in involved}
    local_dir: Path | None = None
    prepared: list[Host] = []
    try:
        # ---- prepare: the staging directories (and, beside a .sif, who sees whose: one copy per shared directory)
        results = fleet.run(lambda h: script_command(h, "prepare", targets[h.name]), stdin=payload(), hosts=involved, timeout=60)
        replies = {}
        for result in results:
            data = pyrun.reply(result, "the image script")
            if data is not None and data.get("ok"):
                replies[result.host] = data
                prepared.append(by_name[result.host])
            elif result.host == p.source:
                raise _SourceFailed(f"{p.source} (the source) could not stage the image: {_why(result, data)}")
            else:
                _fail(report.hosts[result.host], result, data, "staging")
        if p.sif:
            from mnft.sync.mirror import groups_of

            names = [n for n in p.receivers if n in replies]
            p = with_sharing(p, groups_of(names, {n: set(replies[n].get("seen") or ()) for n in names}))
            for name in p.verifiers:
                report.hosts[name].action, report.hosts[name].notes = "verify", [p.hosts[name].reason]
        receivers = [by_name[n] for n in p.receivers if n in replies]
        if progress:
            progress.start([h.name for h in receivers] + p.verifiers)

        # ---- save once, on the source
        say(f"saving {p.image} on {'this machine' if source_host is None else p.source}")
        if source_host is None:
            local_dir = Path(tempfile.mkdtemp(prefix=imagehost.STAGE_PREFIX, dir=_local_stage_parent()))
            report.archive_bytes = _save_local(p.image, local_dir, controller_runtime)
        else:
            saved = fleet.run_one(source_host, script_command(source_host, "save", runtime_setting(source_host), p.image, targets[p.source]),
                                  stdin=payload(), timeout=MOVE_TIMEOUT)
            data = pyrun.reply(saved, "the image script")
            if data is None or not data.get("ok"):
                raise _SourceFailed(f"{p.source} (the source) could not save the image: {_why(saved, data)}")
            report.archive_bytes = int(data.get("bytes") or 0)

        # ---- send: through the mesh when every host involved has it, else from this machine
        from mnft.sync import relay as relaying

        mesh = {n: r.get("mesh") or [] for n, r in replies.items()}
        with_mesh = relay and relaying.mesh_ready([*([source_host] if source_host else []), *receivers], mesh)
        report.relay = with_mesh
        say(f"sending {_size(report.archive_bytes)} to {len(receivers)} host(s)" + (" through the mesh (relay)" if with_mesh else " from this machine"))

        def done(d) -> None:
            if progress:
                progress.update(d.host, f"received from {d.via}" if d.ok else f"not received: {d.error}", failed=not d.ok)

        if source_host is not None and not with_mesh:
            local_dir = _fetch(inventory, source_host, targets[p.source], report)
        deliveries = relaying.distribute(fleet, inventory, local_dir, targets, receivers, relay=with_mesh, on_done=done,
                                         seeds=[source_host] if source_host is not None and with_mesh else [])
        failed = [h for h in receivers if not deliveries[h.name].ok and deliveries[h.name].status == "failed" and local_dir is None]
        if failed:  # a relay hop from the source host failed: this machine fetches a copy and sends it itself
            local_dir = _fetch(inventory, source_host, targets[p.source], report)
            deliveries.update(relaying.distribute(fleet, inventory, local_dir, targets, failed, relay=False, on_done=done))
        got = []
        for host in receivers:
            d, outcome = deliveries[host.name], report.hosts[host.name]
            outcome.via, outcome.controller_bytes, outcome.seconds = d.via, d.controller_bytes, d.seconds
            outcome.notes += d.notes
            report.controller_bytes += d.controller_bytes
            if d.ok:
                got.append(host)
            else:
                outcome.status = d.status if d.status in ("unreachable", "host-key-rejected") else "failed"
                outcome.error = "sending the image failed: " + d.error

        # ---- load (a .sif: rename into place), each checking the id it got
        def load(host: Host) -> HostResult:
            if progress:
                progress.update(host.name, "loading")
            args = ("place", p.image, targets[host.name], p.reference) if p.sif else \
                ("load", runtime_setting(host), p.image, targets[host.name], p.reference)
            return fleet.run_one(host, script_command(host, *args), stdin=payload(), timeout=MOVE_TIMEOUT)

        loaded = fleet.map(load, got)
        for host in got:
            result, outcome = loaded[host.name], report.hosts[host.name]
            data = pyrun.reply(result, "the image script")
            outcome.seconds = round(outcome.seconds + result.seconds, 3)
            if data is None or not data.get("ok"):
                _fail(outcome, result, data, "loading")
            else:
                outcome.status = "changed"
                if data.get("replaced"):
                    outcome.notes.append(f"replaced {short(data['replaced'])}")
            if progress:
                progress.update(host.name, outcome.status if outcome.status != "failed" else f"failed: {outcome.error}", failed=outcome.status == "failed")

        # ---- verify: every host that changed, and those that share a receiver's directory, read again
        _verify(fleet, inventory, p, report, [h for h in got if report.hosts[h.name].status == "changed"])
    except _SourceFailed as exc:
        for name in p.receivers + p.verifiers:
            if report.hosts[name].status == "pending":
                report.hosts[name].status, report.hosts[name].error = "failed", str(exc)
    finally:
        if prepared:  # load and place remove their own; a failure anywhere leaves nothing behind either
            fleet.run(lambda h: script_command(h, "clean", targets[h.name]), stdin=payload(), hosts=prepared, timeout=120)
        if local_dir is not None:
            shutil.rmtree(local_dir, ignore_errors=True)
        if progress:
            progress.stop()
    for outcome in report.hosts.values():
        if outcome.status == "pending":
            outcome.status, outcome.error = "failed", outcome.error or "not reached (its staging failed)"


class _SourceFailed(Exception):
    pass


def _verify(fleet: Fleet, inventory: Inventory, p: Plan, report: ImageReport, changed: list[Host]) -> None:
    verifiers = [h for h in inventory.hosts if h.name in p.verifiers]
    for host in verifiers:  # their receiver did not make it: nothing to see
        via = report.hosts[p.hosts[host.name].via]
        if via.status != "changed":
            report.hosts[host.name].status = "failed"
            report.hosts[host.name].error = f"{via.host} receives the copy {host.name} shares and did not ({via.status})"
    hosts = changed + [h for h in verifiers if report.hosts[h.name].status == "pending"]
    if not hosts:
        return
    outcomes, after = gather(fleet, hosts, p.image)
    deadline = time.monotonic() + SHARED_WAIT
    while p.sif and time.monotonic() < deadline and any(_held(after.get(h.name)) != p.reference for h in hosts if h.name in p.verifiers):
        time.sleep(1.0)  # an NFS client may serve the old directory from its cache for a while
        stale = [h for h in hosts if h.name in p.verifiers and _held(after.get(h.name)) != p.reference]
        more_outcomes, more = gather(fleet, stale, p.image)
        outcomes.by_host.update(more_outcomes.by_host)
        after.update(more)
    for host in hosts:
        outcome = report.hosts[host.name]
        have = _held(after.get(host.name))
        outcome.id = have
        if host.name in p.verifiers:
            outcome.via = p.hosts[host.name].via
        if have == p.reference:
            outcome.status = "changed" if host.name not in p.verifiers else "ok"
            continue
        result = outcomes[host.name]
        outcome.status = result.status.value if result.status not in (Status.OK,) else "failed"
        seen = short(have) if have else "no image"
        outcome.error = (f"verification failed: {result.error}" if host.name not in after else
                         f"after the sync it holds {seen}, not {short(p.reference)}" + (
                             f" (it shares {p.hosts[host.name].via}'s directory: is the shared filesystem mounted alike on both?)"
                             if host.name in p.verifiers else ""))


def _save_local(image: str, folder: Path, runtime: str = "auto") -> int:
    """The source is this machine: the image saved (a .sif: linked) into a local staging directory."""
    if imagehost.is_path_image(image):
        (folder / imagehost.SIF_FILE).symlink_to(os.path.abspath(os.path.expanduser(image)))  # the relay's rsync follows it (-L)
        return os.path.getsize(os.path.expanduser(image))
    with Fleet(local_inventory()) as fleet:
        host = fleet.inventory.hosts[0]
        result = fleet.run_one(host, script_command(host, "save", runtime, image, str(folder)), stdin=payload(), timeout=MOVE_TIMEOUT)
    data = pyrun.reply(result, "the image script")
    if data is None or not data.get("ok"):
        raise _SourceFailed(f"this machine (the source) could not save the image: {_why(result, data)}")
    return int(data.get("bytes") or 0)


def _fetch(inventory: Inventory, host: Host, folder: str, report: ImageReport) -> Path:
    """The source host's staging directory, copied to this machine (no mesh to relay it host to host)."""
    from mnft.sync.rsync import SshSettings, classify, remote_spec, run_rsync, ssh_command

    local = Path(tempfile.mkdtemp(prefix=imagehost.STAGE_PREFIX, dir=_local_stage_parent()))
    argv = ["rsync", "-a", "-s", "--timeout=120", "--stats"]
    if not host.is_local:
        argv += ["-e", ssh_command(host, SshSettings.for_inventory(inventory))]
    outcome = run_rsync([*argv, remote_spec(host, folder), str(local) + "/"], timeout=MOVE_TIMEOUT)
    status, error = classify(outcome.exit_code, outcome.stderr)
    if status is not Status.OK:
        shutil.rmtree(local, ignore_errors=True)
        raise _SourceFailed(f"fetching the image from {host.name} (the source) failed: {error}")
    report.fetched_bytes += report.archive_bytes
    return local


def _local_stage_parent() -> str:
    return STAGE_PARENT if os.access(STAGE_PARENT, os.W_OK) else tempfile.gettempdir()


def _why(result: HostResult, data: dict | None) -> str:
    return (data or {}).get("error") or result.error or "failed"


def _fail(outcome: HostOutcome, result: HostResult, data: dict | None, what: str) -> None:
    if data is None:
        outcome.status = result.status.value if result.status is not Status.OK else "failed"
    else:
        outcome.status = "failed"
    outcome.error = f"{what} failed: {_why(result, data)}"


def _size(n: int) -> str:
    from mnft.core.output import fmt_size

    return fmt_size(n)


class Progress:
    """One line per receiving host (what it is doing), on stderr, while the image moves."""

    def __init__(self, console=None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True, highlight=False, markup=False)
        self.bar = None
        self.tasks: dict[str, int] = {}

    def start(self, hosts: Sequence[str]) -> None:
        from rich.progress import Progress as Bar
        from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

        if not hosts:
            return
        self.bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.fields[state]}", markup=False), TimeElapsedColumn(),
                       console=self.console, transient=False)
        width = max(len(h) for h in hosts)
        for host in hosts:
            self.tasks[host] = self.bar.add_task(host.ljust(width), total=1, state="waiting for the image")
        self.bar.start()

    def update(self, host: str, state: str, failed: bool = False) -> None:
        if self.bar is not None and host in self.tasks:
            done = failed or state in ("changed", "ok")
            self.bar.update(self.tasks[host], state=state[:120], completed=1 if done else 0)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
