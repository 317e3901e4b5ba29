"""`invoke train`: the launch sequence of a job (one of mnft's recipes or the lab's own script).

check (refuse on a mismatch unless forced; the entry point must exist) -> sync -> on resume, the job's latest
complete checkpoint made whole on every host -> a free rendezvous port on the master -> plan one torchrun per
host (mnft.run.launch) -> start all in parallel under gang supervision (mnft.run.gang) -> collect logs (mnft.run.logs).
The run record (runs/<id>/run.json) is written as it goes. What happens to a run afterwards (status, stop) is
mnft.run.control.
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.text import Text

from mnft.check.findings import CheckOptions, CheckReport
from mnft.check.gather import gather as gather_check
from mnft.check.rules import verified_image_id
from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.core.output import command
from mnft.hosts.command import shell_line, shell_word
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet, Status
from mnft.hosts.lab import check_gpus, with_gpus
from mnft.hosts.leases import Scope
from mnft.hosts.settings import Inventory
from mnft.image.runtime import Runtime
from mnft.run import diagnose as diagnosing
from mnft.run import launch as launching
from mnft.run import records, recover
from mnft.run.control import exit_meaning, job_of
from mnft.run.gang import Gang, GangError, GangInterrupted, GangResult, failure_excerpt
from mnft.run.guard import Guard
from mnft.run.job import Job, parse_overrides, resumable
from mnft.run.launch import HostLaunch, LaunchOptions
from mnft.run.logs import LIVE_METRICS, keep_step_times
from mnft.run.needs import job_needs
from mnft.run.progress import Display
from mnft.run.recover import Policy
from mnft.run.rerun import previous_run, resume_hint, snapshot
from mnft.run.scrape import for_job_output
from mnft.sync.source import PROJECT_DIR, default_source
from mnft.sync.targets import source_problem


class RunFailed(MnftError):
    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class TrainOptions:
    launch: LaunchOptions
    check: CheckOptions = CheckOptions()
    force: bool = False
    src: Path | None = None
    sync: bool = True
    dry_run: bool = False
    resume_run: str | None = None
    recovery: Policy = Policy()  # --max-restarts, --min-nodes (mnft.run.recover)
    gpus: int | None = None  # --gpus G: G devices on each host (None: every device, as a host's slots say)
    nodes: int | None = None  # --nodes N: N hosts of the inventory, where the devices are free
    wait: float | None = None  # --wait [S]: wait in line for the devices (inf: as long as it takes)
    notify: Any = None  # --notify CMD (mnft.run.notify.Notify): told when it starts after waiting in line and when it ends
    run_id: str | None = None  # the run's id when its supervisor starts it (mnft.run.supervisor chose it); None: a new one
    supervisor: dict | None = None  # where this run's supervisor lives (host, why, dir): a detached run, supervised on the lab
    after: dict | None = None  # --after RUN[:any], as judged on the controller (mnft.run.after.judge): waited for before the line
    sweep: Any = None  # --sweep / a job file's sweep: (mnft.run.sweepspec.SweepSpec): one run per point, under its supervisor (mnft.run.sweeper)


# ------------------------------------------------------------------------------------------------ port


def chosen_port(report: CheckReport) -> int:
    """The rendezvous port the check found free on the master (it searched past a taken one)."""
    if not report.port_free:
        raise RunFailed(f"no free rendezvous port on the master from {report.port}: {report.port_error}; stop what holds it (ss -ltnp) or set rendezvous_port")
    return report.port


# ------------------------------------------------------------------------------------------------ the entry point


def source_for(job: Job, src: Path | None) -> Path | None:
    """The tree to sync: --src, else the git repository around the current directory (None: sync decides). A
    recipe runs mnft's own code, so from a repository that lacks it, mnft's checkout is synced instead."""
    if src is not None or not job.recipe:
        return src
    top = default_source()
    if (top / "mnft" / "recipes").is_dir():
        return top
    if (PROJECT_DIR / "mnft" / "recipes").is_dir() and (PROJECT_DIR / "pyproject.toml").is_file():
        return PROJECT_DIR
    return top


def pass_env_specs(job: Job, environ: dict[str, str], env_files: tuple[str, ...]) -> tuple[str, ...]:
    """The job file's pass_env names as --env NAME specs; a name set nowhere is bad input."""
    in_files: set[str] = set()
    for path in env_files:
        in_files |= set(launching.read_env_file(path))
    missing = [n for n in job.pass_env if n not in environ and n not in in_files]
    if missing:
        raise InputError(f"{job.source or 'the job'}: pass_env {', '.join(missing)}: not set in this environment (export it, or give it with --env-file FILE)")
    return tuple(n for n in job.pass_env if n in environ)


# ------------------------------------------------------------------------------------------------ train


def train(inventory: Inventory, options: TrainOptions, console: Console) -> int:
    warn = lambda text: console.print(Text(text, style="yellow"), soft_wrap=True)  # noqa: E731
    with Guard(options.notify, warn) as guard:  # the hosts' leases, let go at the end; an interrupt recorded; --notify (mnft.run.guard)
        try:
            return _train(inventory, options, console, guard)
        finally:
            if guard.code is not None:
                guard.code.release()


def _train(inventory: Inventory, options: TrainOptions, console: Console, guard: Guard) -> int:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    lopts = options.launch
    job = lopts.job
    options = replace(options, src=source_for(job, options.src))
    job_id = previous = None
    if options.resume_run is not None or lopts.resume:
        previous = previous_run(options.resume_run)
        job_id = previous.data.get("job_id", previous.run_id)
        lopts = replace(lopts, resume=True)
        if why := not_resumable(job):
            raise InputError(why)
        if (previous.data.get("launch") or {}).get("in_workdir"):  # a job started in the workdir goes on there, on its code
            lopts, options = replace(lopts, in_workdir=True), replace(options, sync=False)
    elif not options.sync:  # a new job without code of its own (--no-sync): what `sync` left in the workdir, run there
        lopts = replace(lopts, in_workdir=True)
    policy = options.recovery
    env, secrets, tree, needs, gpus = judged_input(inventory, options, lopts)
    if policy.max_restarts and not_resumable(job):
        console.print(Text.assemble(("warning: ", "bold yellow"), f"{job.label} has no resume rule: a restart after a failure "
                                    "begins again at step 1 (and may overwrite the checkpoints it wrote)\n  fix: " + RESUME_FIX), soft_wrap=True)
    if options.nodes is not None:
        inventory = picked_nodes(inventory, options, gpus, console)
    run_id = options.run_id or launching.new_run_id()
    job_id = job_id or run_id
    if options.sync and not options.dry_run:  # the code this run runs, fixed now: nothing done to the tree later changes it
        from mnft.sync.snapshot import fix

        guard.code = fix(options.src)
        timings["fix_s"] = guard.code.seconds
    record = None
    given = (options.supervisor or {}).get("as_given") or {}  # a supervised run records what its user gave (--env-file, --src), not its copies
    if not options.dry_run:  # the record exists from the start: a refused or failed launch is recorded too
        record = records.RunRecord.create(
            run_id, job_id=job_id, job=job.to_record(), recipe=job.recipe, overrides=list(job.extra_args) if job.recipe else [],
            env_specs=list(given.get("env_specs", lopts.env)), env_files=list(given.get("env_files", lopts.env_files)), rdzv=lopts.rdzv, resume=lopts.resume,
            resumed_from=previous.run_id if previous else None, detach=lopts.detach or options.supervisor is not None,
            supervisor=options.supervisor, sweep=point_of_sweep(options.supervisor), inventory=snapshot(inventory), hosts={},
            timings=timings, state="checking", launched=False, launch={"in_workdir": lopts.in_workdir},
            code_hash=guard.code.tree.digest if guard.code is not None else None,
            code={"src": given.get("src") or str(guard.code.source), "hash": guard.code.tree.digest, "files": len(guard.code.tree.files),
                  "snapshot": str(guard.code.tree.root), "job_dir": launching.job_dir(inventory.hosts[0], job_id)} if guard.code is not None else None,
            recovery={"max_restarts": policy.max_restarts, "min_nodes": policy.min_nodes,
                      "spares": [h.name for h in inventory.spares]}, attempts=[],
        )
    if options.after is not None and record is not None:  # --after RUN: no place in any line until RUN has ended as asked
        guard.record = record  # a stop or Ctrl-C meanwhile is recorded, the end told (--notify)
        waited_for(options, record, console)
    # the run's devices and workdir on every host; taken by another run (or a host under setup) refuses it here,
    # untouched, unless it waits in line
    guard.hold(record, inventory, run_id, Scope(gpus=gpus, wait=options.wait, below="" if lopts.in_workdir else f"outputs/{job_id}"), on_wait=WaitLine(console).update,
               image=job.image)
    held = guard.leases
    visible = {h: tuple(d["index"] for d in found if d.get("index") is not None) for h, found in held.devices.items()} \
        if held is not None and gpus is not None else {}
    inventory = with_gpus(inventory, gpus)
    with Fleet(inventory) as fleet:
        port_asked = options.check.port or rendezvous_port(inventory, visible)
        # the code's hash is not compared with the workdir's: this run's code goes into a snapshot and its job's directory
        check_options = replace(options.check, port=port_asked, find_free_port=True, required_files=needs.files, modules=needs.modules,
                                own_devices=visible or None, image=job.image, code=False,
                                image_id=recover.resumed_image_id(previous.data, job.image) if previous else None)
        report = gather_check(fleet, check_options)
        image_id = check_options.image_id or (verified_image_id(inventory, report.facts) if job.image else None)
        timings["check_s"] = round(time.monotonic() - t0, 3)
        spares = usable_spares(inventory, report, console)
        gang_names = tuple(h.name for h in inventory.gang().hosts)
        refuse_bad_check(inventory.only(gang_names), report, options, record)
        ifaces = {name: reach.iface for name, reach in report.reach.items()}
        reached = {name: reach.ok for name, reach in report.reach.items()}
        port = chosen_port(report)
        run = Run(record, console, lopts, options, env, secrets, run_id, job_id, timings, t0, ifaces, policy, inventory, reached,
                  {name: (f.get("python") or {}).get("executable") or inventory.host(name).python for name, f in report.facts.items()},
                  visible, {h: tuple(p) for h, p in held.paths.items()} if held is not None else {}, runtimes_of(report, job),
                  recover.later_check(check_options, image_id, None),
                  taken={h: tuple(d for d in found if isinstance(d, dict)) for h, found in held.devices.items()} if held is not None and gpus is not None else {},
                  publish=held.progress if held is not None else None)
        try:  # the launch plan refuses (slots, rendezvous, the master's address) before any byte is synced
            run.plan(inventory.gang(gang_names), report.master_addr, port, 1, lopts.resume)
        except InputError as exc:
            if record is not None:
                record.update(state="refused", reason=str(exc))
            raise
        if options.dry_run:
            return run.dry_run(inventory.gang(), report.master_addr, port)
        assert record is not None
        record.update(master_addr=report.master_addr, rendezvous_port=port, state="syncing" if options.sync else "starting",
                      image={"ref": job.image, "id": image_id} if job.image else None)
        if guard.code is not None:
            t_sync = time.monotonic()
            try:
                place_code(inventory.only(gang_names + spares), guard.code, job_id, fleet, console)
            except Exception as exc:
                timings["sync_s"] = round(time.monotonic() - t_sync, 3)
                record.update(state="sync-failed", reason=str(exc), sync={"ok": False, "error": str(exc)}, timings=timings)
                raise
            timings["sync_s"] = round(time.monotonic() - t_sync, 3)
        record.update(sync={"ok": True, "src": given.get("src") or str(guard.code.source), "hash": guard.code.tree.digest} if guard.code is not None else None,
                      timings=timings)
    return run.supervise(gang_names, spares, report.master_addr, port)


def waited_for(options: TrainOptions, record: records.RunRecord, console: Console) -> None:
    """--after RUN: wait (here, or on the lab where this run is supervised) until RUN has ended; RUN not succeeded
    (or ended at all, for RUN:any) ends this run `dependency-failed`, naming RUN and its state."""
    from mnft.run.after import wait_for

    dep = options.after
    record.update(state="waiting", reason=f"after run {dep['run_id']}", after={"run": dep["run_id"], "any": bool(dep.get("any"))})
    say = lambda text: console.print(Text(text, style="yellow"), soft_wrap=True)  # noqa: E731
    why = wait_for(dep, say)
    if why is not None:
        record.update(state="dependency-failed", reason=why)
        raise RunFailed(why)
    record.update(state="checking", reason=None)
    say(f"run {dep['run_id']} ended {'' if dep.get('any') else 'succeeded'}: this run takes its place in line now".replace("ended succeeded", "succeeded"))


def point_of_sweep(where: dict | None) -> dict | None:
    """A sweep's point names its sweep in its record: {id, index, values} (None: a run of its own)."""
    if not where or not where.get("sweep"):
        return None
    return {"id": where["sweep"], "index": where.get("point"), "values": where.get("values") or {}}


def judged_input(inventory: Inventory, options: TrainOptions, lopts: LaunchOptions) -> tuple[dict, dict, Path, Any, int | None]:
    """Bad input refused before any host is touched, as train (and a detached run's hand-over) judge it: a recipe's
    overrides, the recovery options, the environment the run passes, the tree and its entry point, --gpus. Returns
    (env, secrets, tree, needs, gpus)."""
    job = lopts.job
    if job.recipe:
        parse_overrides(job.extra_args)
    check_recovery(options.recovery, job, inventory, lopts)
    environ = launching.environ()
    env, secrets = launching.split_env(lopts.env + pass_env_specs(job, environ, lopts.env_files), environ, lopts.env_files)
    tree = options.src or default_source()
    if options.sync and (why := source_problem(tree)):
        raise InputError(why)
    needs = job_needs(job, tree, options.sync)  # a missing entry point: bad input, here
    gpus = check_gpus(options.gpus if options.gpus is not None else job.gpus)
    return env, secrets, tree, needs, gpus


def rendezvous_port(inventory: Inventory, visible: dict[str, tuple[int, ...]]) -> int | None:
    """Where the master's free-port search starts: past the inventory's port by the lowest GPU the run holds on
    the master, so two runs on disjoint devices of one master never reach for the same port (None: the inventory's)."""
    mine = visible.get(inventory.master_name) if inventory.master_name in visible else None
    return inventory.rendezvous_port + min(mine) if mine else None


def picked_nodes(inventory: Inventory, options: TrainOptions, gpus: int | None, console: Console) -> Inventory:
    """--nodes N: the inventory cut to the N hosts picked where the devices are free (mnft.hosts.lab.pick_nodes),
    after one look at every host; a dry run prints the pick and why."""
    from mnft.hosts.lab import look, not_picked_line, pick_nodes

    with Fleet(inventory) as fleet:
        views = look(fleet, inventory.hosts)
    pick = pick_nodes(inventory, views, options.nodes, gpus, wait=options.wait is not None)
    if options.dry_run:
        for name, why in pick.why:
            console.print(Text.assemble((name, "bold"), f": {why}"), soft_wrap=True)
    if pick.hosts is None:
        from mnft.hosts.leases import HostBusy

        raise HostBusy(not_picked_line(pick, options.nodes, gpus) + "; nothing was changed on any host")
    if options.dry_run:
        console.print(Text(f"--nodes {options.nodes}: {', '.join(pick.hosts)} (node_rank in this order)"), soft_wrap=True)
    return inventory.only(pick.hosts)


class WaitLine:
    """What a run waiting in line says: each host's place and what holds the devices, a line each time it changes."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.said: dict[str, str] = {}  # host -> its line last said: a reply that says nothing new is not said again

    def update(self, host: str, reply: dict) -> None:
        from mnft.hosts.leases import describe, holders_of

        ahead = [describe(h) for h in reply.get("ahead") or []]
        parts = [f"{host}: waiting in line, position {reply.get('position') or 1}"]
        if ahead:
            parts.append("ahead: " + "; ".join(ahead[:3]) + (f" and {len(ahead) - 3} more" if len(ahead) > 3 else ""))
        if reply.get("what") == "workdir":
            parts.append(f"workdir held by {describe(reply.get('holder'))}")
        elif reply.get("what") == "host":
            parts.append(f"the host is held by {describe(reply.get('holder'))}")
        held = holders_of(reply.get("devices") or [])
        if held:
            parts.append("; ".join(held))
        line = " — ".join(parts)
        if self.said.get(host) == line:
            return
        self.said[host] = line
        self.console.print(Text(line, style="yellow"), soft_wrap=True)


RESUME_FIX = ("give the job a resume rule in a job file (docs/jobs.md), e.g. for an HF Trainer script "
              "`resume: {layout: hf, checkpoints: '{output_dir}', args: [--resume_from_checkpoint, '{latest_checkpoint}']}`, "
              "for torchtune `resume: {layout: torchtune, args: [resume_from_checkpoint=True]}`, "
              "for a script that resumes itself from its own directory `resume: {layout: none, args: []}`; "
              "a recorded run takes it with `--resume-run ID --job FILE`")


def not_resumable(job: Job) -> str | None:
    """Why --resume cannot continue this job (None: it can): a job with no resume rule would start again at step 1
    and overwrite what it saved, while the person asked to continue."""
    if resumable(job):
        return None
    return (f"--resume: {job.label} has no resume rule, so mnft cannot tell it where to continue: it would start again "
            f"at step 1 and overwrite its checkpoints; {RESUME_FIX}")


def check_recovery(policy: Policy, job: Job, inventory: Inventory, lopts: LaunchOptions) -> None:
    """Bad recovery options are bad input, refused before any host is touched."""
    for flag, value in (("--max-restarts", policy.max_restarts), ("--min-nodes", policy.min_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (0 if flag == "--max-restarts" else 1)):
            raise InputError(f"{flag} {value!r}: must be a whole number {'≥ 0' if flag == '--max-restarts' else '≥ 1'}")
    training = len(inventory.gang().hosts)
    if policy.min_nodes is not None:
        if not job.elastic:
            raise InputError(f"--min-nodes: {job.label} cannot run on fewer hosts (a job file's `elastic: true` says it can)")
        if policy.min_nodes > training:
            raise InputError(f"--min-nodes {policy.min_nodes}: the inventory has {training} training hosts")


def usable_spares(inventory: Inventory, report: CheckReport, console: Console) -> tuple[str, ...]:
    """The spares that passed the check: a spare that did not is left out (said once), it never refuses the run."""
    out = []
    for host in inventory.spares:
        if report.status(host.name) == Status.OK.value:
            out.append(host.name)
        else:
            why = "; ".join(f"{p.field}: {p.message}" for p in report.problems if p.host == host.name and p.severity == "error")
            console.print(Text(f"spare {host.name} left out: {why or report.outcomes[host.name].error or report.status(host.name)}", style="yellow"))
    return tuple(out)


def refuse_bad_check(gang: Inventory, report: CheckReport, options: TrainOptions, record: records.RunRecord | None) -> None:
    bad = [h.name for h in gang.hosts if report.status(h.name) != Status.OK.value]
    problems = [{"host": p.host, "field": p.field, "severity": p.severity, "message": p.message} for p in report.problems]
    if record is not None:
        record.update(facts=report.facts, check={"ok": not bad, "failed_hosts": bad, "problems": problems, "forced": bool(bad and options.force)})
    if bad and not options.force:
        from mnft.check.report import print_check

        print_check(report, as_json=False)
        details = "; ".join(
            f"{p.host}: {p.field}: {p.message}" for p in report.problems if p.severity == "error" and p.host in bad
        ) or "; ".join(f"{n}: {report.outcomes[n].error}" for n in bad if report.outcomes[n].error)
        error = RunFailed(f"check failed on {', '.join(bad)} ({details}); fix it or pass --force")
        error.exit_code = report.exit_code() or ExitCode.FAILED  # a host whose probe failed has no "problem" rows
        if record is not None:
            record.update(state="refused", reason=str(error))
        raise error
    if report.master_addr is None:
        error = RunFailed(f"cannot tell the master's address: {next((p.message for p in report.problems if p.field == 'master_addr'), 'unknown')}")
        if record is not None:
            record.update(state="refused", reason=str(error))
        raise error


@dataclass
class Run:
    """One `invoke train`: its attempts, each a gang started, supervised and torn down; after a failed attempt,
    recovery (mnft.run.recover) decides whether and on which hosts the next one starts."""

    record: records.RunRecord | None
    console: Console
    lopts: LaunchOptions
    options: TrainOptions
    env: dict[str, str]
    secrets: dict[str, str]
    run_id: str
    job_id: str
    timings: dict[str, float]
    t0: float
    ifaces: dict[str, str | None]
    policy: Policy
    inventory: Inventory  # every host, spares included
    reached: dict[str, bool] = field(default_factory=dict)  # host -> it reached the master's port in the check
    pythons: dict[str, str] = field(default_factory=dict)  # host -> the Python that runs the job there
    visible: dict[str, tuple[int, ...]] = field(default_factory=dict)  # host -> the GPUs the run took (--gpus)
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)  # host -> the lease files the run holds there
    runtimes: dict[str, Runtime] = field(default_factory=dict)  # host -> its container runtime (a job with an image)
    later: CheckOptions = CheckOptions()  # what each later check judges: the first check's (recover.later_check)
    taken: dict[str, tuple[dict, ...]] = field(default_factory=dict)  # host -> the GPUs the run took, each its index, UUID and bus
    publish: Callable[[dict], None] | None = None  # the last step, told to the hosts' leases for the lab to see (Leases.progress)

    def plan(self, gang: Inventory, master_addr: str, port: int, attempt: int, resume: bool, latest: str | None = None) -> list[HostLaunch]:
        return launching.plan(
            gang, master_addr=master_addr, port=port, run_id=self.run_id, job_id=self.job_id,
            options=replace(self.lopts, resume=resume), ifaces=self.ifaces, env=self.env,
            secret_names=tuple(sorted(self.secrets)), latest_checkpoint=latest, attempt=attempt,
            visible=self.visible, held=self.held, runtimes=self.runtimes,
        )

    def dry_run(self, gang: Inventory, master_addr: str, port: int) -> int:
        job = self.lopts.job
        for p in self.plan(gang, master_addr, port, 1, self.lopts.resume):
            shown = p.display()  # printed literally: an argument like checkpoint_files=[model.pt] is not rich markup
            self.console.print(Text.assemble((p.host, "bold"), f" (node_rank {p.node_rank}, cwd {shown['cwd']})"))
            self.console.print(Text("  env: " + " ".join(shell_word(f"{k}={v}") for k, v in shown["env"].items())), soft_wrap=True)
            self.console.print(Text("  " + shown["command"]), soft_wrap=True)
        gpus = self.options.gpus if self.options.gpus is not None else job.gpus
        if gpus is not None:
            self.console.print(Text(f"(--gpus {gpus}: the GPUs are picked when the run starts, among those free on each host then, "
                                    "and set as CUDA_VISIBLE_DEVICES; `mnft lab` shows which are free now)"), soft_wrap=True)
        if self.lopts.resume and job.resume.layout not in ("none", "mnft"):
            self.console.print(Text(f"(on resume, mnft looks for the latest complete checkpoint ({job.resume.layout}) in {job.resume.checkpoints} "
                               "and passes " + shell_line(job.resume.args) + " only when it finds one)"), soft_wrap=True)
        return ExitCode.OK

    # -------------------------------------------------------------------------------------------- the attempts

    def supervise(self, gang_names: tuple[str, ...], spares: tuple[str, ...], master_addr: str, port: int) -> int:
        record = self.record
        assert record is not None
        live = Live(record.path, self.policy.max_restarts, self.publish)
        try:
            return self._supervise(live, gang_names, spares, master_addr, port)
        except (KeyboardInterrupt, MnftError):
            raise
        except Exception as exc:  # a bug in mnft (the gang tore the hosts down): the run ends recorded, never `running`
            record.update(state="failed", reason=f"mnft error: {type(exc).__name__}: {exc}")
            raise
        finally:
            live.close()

    def _supervise(self, live: "Live", gang_names: tuple[str, ...], spares: tuple[str, ...], master_addr: str, port: int) -> int:
        record, inventory = self.record, self.inventory
        history: list[recover.Attempt] = []
        width = max(len(h.name) for h in inventory.hosts) + 4
        attempt, resume = 1, self.lopts.resume
        while True:
            gang = inventory.gang(gang_names)
            entry = {"number": attempt, "hosts": list(gang_names), "started": time.time(), "master_addr": master_addr, "port": port,
                     "resumed": resume, "checkpoint": None, "resumed_step": None}
            record.data["attempts"].append(entry)
            record.update(attempt=attempt)
            live.update(attempt=attempt, hosts=list(gang_names), state="starting")
            with Fleet(gang) as fleet:
                label = attempt_label(attempt, self.policy, history) if self.policy.max_restarts else ""
                outcome = self.attempt(fleet, gang, master_addr, port, attempt, resume, entry, width, live, label)
                if outcome is None:  # detached: the hosts run on their own
                    return ExitCode.OK
                result, display = outcome
                if not result.ok and (asked := records.stop_requested(record)) is not None:  # `mnft stop`: on purpose
                    entry.update(ended=time.time(), state="stopped", steps=[display.first_step, display.last_step])
                    live.update(state="stopped")
                    return finish(record, result, self.timings, self.t0, fleet, self.console, stopped_by=asked.get("by") or "mnft stop")
                if not result.ok and any(h.ended_by for h in result.hosts.values()):  # its keepers ended it: idle GPUs
                    entry.update(ended=time.time(), state="idle-stopped", steps=[display.first_step, display.last_step])
                    live.update(state="idle-stopped")
                    return finish(record, result, self.timings, self.t0, fleet, self.console, idle_stopped=True)
                failed_run = result.hosts.get(result.failed_host) if result.failed_host else None
                entry.update(ended=time.time(), state="succeeded" if result.ok else "failed", steps=[display.first_step, display.last_step],
                             detected=failed_run.ended_at if failed_run is not None else None)
                if result.ok:
                    live.update(state="succeeded")
                    return finish(record, result, self.timings, self.t0, fleet, self.console)
                cause = recover.classify(self.seen(result, display, entry["started"]))
                decision = recover.should_restart(self.policy, history, cause)
                diagnosis = self.diagnose(fleet, result, cause, display, port)
                entry.update(cause=cause.to_json(), diagnosis=diagnosis.to_json(), decision=decision.why,
                             counted=decision.counted if decision.restart else None)
                record.save()
                if not decision.restart:
                    live.update(state="failed")
                    note = attempts_note(record.data["attempts"], decision.why) if self.policy.max_restarts else None
                    return finish(record, result, self.timings, self.t0, fleet, self.console, note, diagnosis)
                self.console.print(Text(f"attempt {attempt} failed: {cause.detail}{stopped_note(result)}; {decision.why}", style="bold yellow"),
                                   soft_wrap=True)
                t_logs = time.monotonic()
                self.keep_logs(record, fleet, attempt)
                entry["logs_s"] = round(time.monotonic() - t_logs, 3)
            history.append(recover.Attempt(attempt, gang_names, cause, decision.counted))
            wait = self.policy.backoff(sum(1 for a in history if a.counted))
            live.update(state="waiting", note=f"attempt {attempt} failed: {cause.detail}")
            lost = [n for n, h in result.hosts.items() if h.state == "lost"]
            t_wait = time.monotonic()
            back = self.wait_for(inventory, lost, wait)
            entry["wait_s"] = round(time.monotonic() - t_wait, 3)
            new = recover.next_gang(gang_names, lost, back, [s for s in spares if s not in lost], self.policy.min_nodes, self.lopts.job.elastic,
                                    cause.unfit)
            entry.update(next=new.why)
            record.save()
            if new.hosts is None:
                live.update(state="failed")
                reason = f"no gang for attempt {attempt + 1}: {new.why}"
                record.update(state="failed", reason=attempts_note(record.data["attempts"], reason))
                raise RunFailed(f"run {record.run_id} failed: {attempts_note(record.data['attempts'], reason)} (logs: {record.path})")
            self.console.print(f"{attempt_label(attempt + 1, self.policy, history)}: {new.why} (waited {wait:.0f}s)",
                               highlight=False, soft_wrap=True)
            spares = tuple(s for s in spares if s not in new.replaced.values())
            gang_names, attempt, resume = new.hosts, attempt + 1, True
            master_addr, port = self.recheck(inventory.gang(gang_names), port, record)

    def attempt(self, fleet: Fleet, gang: Inventory, master_addr: str, port: int, attempt: int, resume: bool, entry: dict,
                width: int, live: "Live", label: str) -> tuple[GangResult, Display] | None:
        record, console, job, timings = self.record, self.console, self.lopts.job, self.timings
        plans = self.plan(gang, master_addr, port, attempt, resume)
        if resume and job.resume.layout != "none":
            from mnft.run import checkpoints

            t_ckpt = time.monotonic()
            try:
                found = checkpoints.prepare(fleet, job.resume, {p.host: p.checkpoints for p in plans}, console,
                                            checkpoints.RECIPE_NEEDS.get(job.recipe or "", "all"))
            except MnftError as exc:
                record.update(state="refused" if attempt == 1 else "failed", reason=str(exc))
                raise
            timings["checkpoint_s"] = entry["checkpoint_s"] = round(time.monotonic() - t_ckpt, 3)
            record.update(checkpoint=found.to_record(), timings=timings)
            entry.update(checkpoint=found.name, resumed_step=checkpoints.step_of(found.name))
            before = record.data["attempts"][-2] if len(record.data["attempts"]) > 1 else None
            if before is not None and (before.get("steps") or [None, None])[1] is not None:
                # the steps the failed attempt trained past the checkpoint it leaves behind: done again now
                before["steps_lost"] = max(0, before["steps"][1] - (entry["resumed_step"] or 0))
            if job.resume.layout != "mnft":
                plans = self.plan(gang, master_addr, port, attempt, resume, found.name)
        record.update(state="starting", hosts={p.host: {"node_rank": p.node_rank, **p.display(), "output_dir": p.output_dir, "metrics": p.metrics,
                                                        "collect": list(p.collect), "checkpoints": p.checkpoints} for p in plans})
        console.print(Text.assemble("run ", (self.run_id, "bold"), (f" attempt {attempt}" if attempt > 1 else "")
                                    + f": {job.label} on {len(plans)} hosts, world size {gang.world_size}, master {master_addr}:{port}"))
        display = Display(console, width, on_stragglers=lambda found: live.update(stragglers=[s.to_json() for s in found]))
        display.attempt = label
        fmt = job.metrics.format
        gang_run = Gang(fleet, plans, launching.attempt_id(self.run_id, attempt), self.lopts, self.secrets, on_line=display.line,
                        on_metric=live.follow(attempt, display), on_sample=display.sample, parse_metric=for_job_output(fmt, job.metrics.regex),
                        metrics_from_output=fmt not in ("mnft", "none") and not any(p.metrics for p in plans))
        t_launch = time.monotonic()
        try:
            gang_run.start()
        except GangError as exc:
            timings["launch_s"] = round(time.monotonic() - t_launch, 3)
            for name, run in gang_run.runs.items():
                record.data["hosts"][name].update(state=run.state, error=run.error or None, started=run.started_at,
                                                  last_lines=[text for _, text in list(run.tail)[-8:]])
            record.update(state="failed", launched=True, reason=str(exc), timings=timings)
            raise
        timings["launch_s"] = round(time.monotonic() - t_launch, 3)
        for p in plans:
            record.data["hosts"][p.host].update(state="running", started=gang_run.runs[p.host].started_at)
        record.update(state="running", launched=True, timings=timings)
        live.update(state="running")
        if self.lopts.detach:
            console.print(f"detached: follow with `{command('logs -f ' + self.run_id)}`, stop with `{command('stop ' + self.run_id)}`")
            print(self.run_id)
            return None
        try:
            with (console.status("waiting for the first step…") if console.is_terminal else nullcontext()) as display.status:
                result = gang_run.wait(tick=lambda: (display.tick(), live.beat()))
            display.end()
        except GangInterrupted as exc:
            keep_step_times(record, attempt, display.step_times)
            record.update(stragglers=display.watch.seen)
            entry.update(ended=time.time(), state="interrupted", steps=[display.first_step, display.last_step])
            try:
                finish(record, exc.result, timings, self.t0, fleet, console)
            except RunFailed:
                pass
            raise KeyboardInterrupt from None
        keep_step_times(record, attempt, display.step_times)
        record.update(stragglers={**record.data.get("stragglers", {}), **display.watch.seen})
        if result.first_step_at is not None:
            entry["first_step_s"] = round(result.first_step_at - entry["started"], 3)
        return result, display

    def seen(self, result: GangResult, display: Display, started: float) -> recover.Seen:
        """What the supervisor saw of the failed attempt (started at `started`), for recover.classify."""
        failed = result.hosts.get(result.failed_host) if result.failed_host else None
        tail = [text for _, text in list(failed.tail)] if failed is not None else []
        _, trace = failure_excerpt(list(failed.tail)) if failed is not None else (None, [])
        loss = display.last_metric.get("loss") if display.last_metric else None
        try:
            loss = float(loss) if loss is not None else None
        except (TypeError, ValueError):
            loss = None
        return recover.Seen(
            failed_host=result.failed_host, host_state=failed.state if failed is not None else None,
            exit_code=failed.exit_code if failed is not None else None, tail=tuple(tail), traceback=tuple(trace),
            first_step=display.first_step is not None or result.first_step_at is not None,
            last_step=display.last_step, last_loss=loss, resume_codes=self.lopts.job.resume.exit_codes,
            oom=self.oom(result.failed_host, tail), container=bool(self.lopts.job.image),
            xids=self.gpu_xids([n for n, h in result.hosts.items() if h.state != "lost"], started),
        )

    def gpu_xids(self, hosts: list[str], since: float) -> tuple[recover.GpuXid, ...]:
        """The Xids the run's GPUs on these hosts logged since `since`: one look at each (mnft.hosts.lab.look, the
        health read `mnft lab` makes, bounded), judged by recover.new_xids."""
        from mnft.hosts.lab import look

        if not hosts:
            return ()
        with Fleet(self.inventory.only(hosts), Timeouts(connect=5.0)) as fleet:
            views = look(fleet, fleet.inventory.hosts)
        return recover.new_xids(views, self.visible, since, self.taken)

    def diagnose(self, fleet: Fleet, result: GangResult, cause: recover.Cause, display: Display, port: int) -> diagnosing.Diagnosis:
        """The failed attempt's cause and fix, for a person (mnft.run.diagnose)."""
        failed = result.hosts.get(result.failed_host) if result.failed_host else None
        rank, trace = failure_excerpt(list(failed.tail)) if failed is not None else (None, [])
        gang = fleet.inventory
        evidence = diagnosing.Evidence(
            cause=cause, rank=rank, trace=tuple(trace), tail=tuple(t for _, t in failed.tail) if failed is not None else (),
            tails={name: tuple(run.tail) for name, run in result.hosts.items()},
            ranks={name: tuple(range(run.launch.rank_offset, run.launch.rank_offset + run.launch.slots)) for name, run in result.hosts.items()},
            python=self.pythons, reached=self.reached, port=port, master=gang.master_name,
            straggler="; ".join(f"straggler {name}: {s.get('why')}" for name, s in display.watch.seen.items()) or None,
        )
        found = diagnosing.diagnose(evidence)
        if found.kind == "address-in-use" and result.failed_host:
            holder = port_holder(fleet, result.failed_host, port)
            if holder:
                found = diagnosing.diagnose(replace(evidence, holder=holder))
        return found

    def oom(self, host: str | None, tail: list[str]) -> bool:
        """Whether the host's kernel log (where this user may read it) says the OOM killer killed a worker."""
        pids = recover.killed_pids(tail)
        if host is None or not pids:
            return False
        from mnft.hosts.command import Command

        with Fleet(self.inventory.only([host]), Timeouts(connect=5.0)) as fleet:
            (result,) = list(fleet.run(lambda h: Command(("dmesg",)), timeout=10))
        return result.ok and recover.oom_killed(result.stdout, pids)

    def keep_logs(self, record: records.RunRecord, fleet: Fleet, attempt: int) -> None:
        """A failed attempt's logs into runs/<id>/attempt-<k>/<host>/ before the next one starts."""
        from mnft.run.logs import keep_attempt

        try:
            keep_attempt(record, fleet, attempt, self.console)
        except Exception as exc:  # noqa: BLE001 - logs that cannot be brought back must not stop the recovery
            self.console.print(Text(f"attempt {attempt}'s logs were not collected: {exc}", style="yellow"))

    def wait_for(self, inventory: Inventory, lost: list[str], backoff: float) -> set[str]:
        """Wait the backoff; meanwhile (and for at most reuse_wait_s) ask each lost host whether it answers again."""
        deadline = time.monotonic() + max(backoff, self.policy.reuse_wait_s if lost else 0.0)
        earliest = time.monotonic() + backoff
        back: set[str] = set()
        while True:
            pending = [n for n in lost if n not in back]
            if pending:
                with Fleet(inventory.only(pending), Timeouts(connect=5.0)) as probe:
                    back |= {r.host for r in probe.connect_all() if r.ok}
            now = time.monotonic()
            if now >= earliest and (len(back) == len(lost) or now >= deadline):
                return back
            time.sleep(min(2.0, max(0.1, (earliest if now < earliest else deadline) - now)))

    def recheck(self, gang: Inventory, port: int, record: records.RunRecord) -> tuple[str, int]:
        """A quick re-check of the next gang (reachable, same stack, code, a free port on its master)."""
        t = time.monotonic()
        with Fleet(gang) as fleet:
            report = gather_check(fleet, replace(self.later, port=port))
        bad = [h.name for h in gang.hosts if report.status(h.name) != Status.OK.value]
        record.data["attempts"][-1]["recheck_s"] = round(time.monotonic() - t, 3)
        reason = None
        if bad and not self.options.force:
            details = "; ".join(f"{p.host}: {p.field}: {p.message}" for p in report.problems if p.severity == "error" and p.host in bad)
            reason = f"the re-check before attempt {len(record.data['attempts']) + 1} failed on {', '.join(bad)}" + (f" ({details})" if details else "")
        elif report.master_addr is None:
            reason = f"cannot tell the new master's address before attempt {len(record.data['attempts']) + 1}"
        if reason is not None:  # the record says why the run ended, not "running"
            record.update(state="failed", reason=attempts_note(record.data["attempts"], reason))
            raise RunFailed(f"run {record.run_id} failed: {attempts_note(record.data['attempts'], reason)} (logs: {record.path})")
        self.ifaces.update({name: reach.iface for name, reach in report.reach.items()})
        self.reached.update({name: reach.ok for name, reach in report.reach.items()})
        self.runtimes.update(runtimes_of(report, self.lopts.job))
        return report.master_addr, chosen_port(report)


def runtimes_of(report: CheckReport, job: Job) -> dict[str, Runtime]:
    """host -> its container runtime as the check found it (a job with an image; the check refused a host without one)."""
    if not job.image:
        return {}
    found = {}
    for name, facts in report.facts.items():
        container = facts.get("container") or {}
        if container.get("runtime") and container.get("path") and container.get("home") is not None:
            found[name] = Runtime.from_facts(container)
    return found


def attempt_label(attempt: int, policy: Policy, history: list[recover.Attempt]) -> str:
    """"attempt k/n": n is every attempt --max-restarts allows, plus the restarts that did not count (resume codes)."""
    return f"attempt {attempt}/{policy.max_restarts + 1 + sum(1 for a in history if not a.counted)}"


def stopped_note(result: GangResult) -> str:
    """The hosts mnft stopped because another failed: they did not fail (their shutdown output is in the logs)."""
    stopped = [name for name, run in result.hosts.items() if run.stopping and name != result.failed_host]
    return f"; {', '.join(stopped)} stopped by mnft" if stopped else ""


def attempts_note(attempts: list[dict], why: str) -> str:
    """Each attempt's cause, then why there is no other: the one line a failed recovery ends with."""
    causes = [f"attempt {a['number']}: {(a.get('cause') or {}).get('detail') or a.get('state', '?')}" for a in attempts if a.get("cause")]
    if len(causes) <= 1:
        return why
    return "; ".join(causes) + f"; {why}"


class Live:
    """runs/<id>/live.json: what the attached supervisor knows now (attempt, its hosts, the stragglers it names, the
    last step record as `metric`), for `invoke status` from another terminal and `mnft board`. Rewritten on each
    change, at most every second for a step record, and every few seconds; gone when the supervisor ends.

    runs/<id>/live-metrics.jsonl: every step record of rank 0 as it reached the supervisor, with its attempt and
    the wall time it arrived (`t`): the loss curve of a run still going (`mnft board`); kept after the run, where
    metrics.jsonl (mnft.run.logs) is the run's timeline once its logs are collected."""

    EVERY = 5.0
    METRIC_EVERY = 1.0
    METRICS = LIVE_METRICS

    def __init__(self, path: Path, max_restarts: int, publish: Callable[[dict], None] | None = None) -> None:
        self.publish = publish
        self.file = path / "live.json"
        self.metrics = path / self.METRICS
        self.data: dict[str, Any] = {"pid": os.getpid(), "max_restarts": max_restarts, "stragglers": []}
        self.written = 0.0

    def follow(self, attempt: int, display: Display):
        """The gang's on_metric: the display shows each record; a step record (not HF's bar nor a summary) is also
        appended to live-metrics.jsonl and becomes live.json's `metric`."""

        def on_metric(data: dict) -> None:
            seen = display.last_metric
            display.metric(data)
            if display.last_metric is not seen:
                self.metric(attempt, display.last_metric)

        return on_metric

    def metric(self, attempt: int, data: dict) -> None:
        point = {"attempt": attempt, "t": round(time.time(), 3), **data}
        with self.metrics.open("a") as out:
            out.write(json.dumps(point) + "\n")
        self.data["metric"] = point
        if self.publish is not None:
            self.publish(data)
        if time.monotonic() - self.written >= self.METRIC_EVERY:
            self._write()

    def update(self, **data: Any) -> None:
        self.data.update(data)
        self._write()

    def beat(self) -> None:
        if time.monotonic() - self.written >= self.EVERY:
            self._write()

    def _write(self) -> None:
        self.data["updated"] = time.time()
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.file)
        self.written = time.monotonic()

    def close(self) -> None:
        self.file.unlink(missing_ok=True)


class CodeConflict(RunFailed):
    """Files in the way in a job's working directory: the run is refused, nothing written there."""


def place_code(inventory: Inventory, code: Any, job_id: str, fleet: Fleet, console: Console) -> None:
    """The run's fixed code (mnft.sync.snapshot.fix) into its snapshot on every host, then its job's working
    directory; files in the way there (the job's own outputs at a path the new code has) refuse the run."""
    from mnft.sync.snapshot import place

    placed = place(inventory, code.tree, job_id, fleet=fleet)
    if (why := placed.failure()) is not None:
        raise (CodeConflict if placed.conflicts() else RunFailed)(why)
    console.print(Text(placed.line(code, launching.job_dir(inventory.hosts[0], job_id))), soft_wrap=True)


def port_holder(fleet: Fleet, host: str, port: int) -> str | None:
    """The process listening on a TCP port of a host, as `ss` shows it to this user ("python3 pid 4242"), or None."""
    from mnft.hosts.command import Command

    (result,) = list(fleet.run(lambda h: Command(("ss", "-H", "-tlnp", f"sport = :{port}")), hosts=[fleet.inventory.host(host)], timeout=10))
    match = re.search(r'users:\(\("([^"]+)",pid=(\d+)', result.stdout) if result.ok else None
    return f"{match.group(1)} pid {match.group(2)}" if match else None


def finish(record: records.RunRecord, result: GangResult, timings: dict, t0: float, fleet: Fleet, console: Console, note: str | None = None,
           diagnosis: diagnosing.Diagnosis | None = None, stopped_by: str | None = None, idle_stopped: bool = False) -> int:
    """The end of a run: the record's final state, logs collected, and the outcome said (note: after automatic
    restarts, each attempt's cause and why there is no other attempt; stopped_by: who ran `stop` — the run was
    stopped on purpose, not failed, and is never restarted)."""
    from mnft.run.logs import collect, summarize

    if result.first_step_at is not None:
        timings["first_step_s"] = round(result.first_step_at - record.data["created"], 3)
    timings["total_s"] = round(time.monotonic() - t0, 3)
    record.data["ended"] = time.time()
    for name, run in result.hosts.items():
        record.set_host(name, state=run.state, exit_code=run.exit_code, ended=run.ended_at, error=run.error or None,
                        last_lines=[text for _, text in list(run.tail)[-8:]], leftover_pids=result.leftovers.get(name, []))
    job = job_of(record.data)
    failed = result.hosts.get(result.failed_host) if result.failed_host else None
    meaning = exit_meaning(job, failed.exit_code) if failed is not None else None
    rank, trace = failure_excerpt(list(failed.tail)) if failed is not None else (None, [])
    reason = result.reason + (f": {meaning}" if meaning else "") + (f" (rank {rank}: {trace[-1]})" if trace and not meaning else "")
    warnings = [diagnosing.after_work(name, [t for _, t in result.hosts[name].tail]) for name in result.after_work]
    if stopped_by is not None:
        record.update(state="stopped", reason=f"stopped by `mnft stop` ({stopped_by})", timings=timings)
    elif idle_stopped:  # result.reason: the host whose keeper ended it, and why (--idle-stop, the lab's idle_stop)
        record.update(state="idle-stopped", reason=result.reason, failed_host=result.failed_host, timings=timings)
    else:
        record.update(state="succeeded" if result.ok else ("resumable" if meaning else "failed"), reason=reason, failed_host=result.failed_host,
                      failed_rank=rank, traceback=trace or None, timings=timings,
                      diagnosis=diagnosis.to_json() if diagnosis else None, warnings=[w.to_json() for w in warnings] or None)
    summary: dict = {}
    try:
        summary = summarize(record, collect(record, fleet, console, quiet=True))
    except Exception as exc:  # noqa: BLE001 - a failed collection must not hide the run's outcome
        console.print(Text(f"log collection failed: {exc}", style="yellow"))
    if summary.get("time"):
        from mnft.run.report import time_table

        console.print(time_table(summary["time"]))
    if result.leftovers:
        console.print(Text(f"processes of the run survived on: {result.leftovers}", style="bold red"))
    if result.ok:
        for warning in warnings:
            console.print(Text.assemble(("warning: ", "bold yellow"), warning.cause, "\n  fix: ", warning.fix))
        synced = record.data.get("sync") or {}
        console.print(Text.assemble((f"run {record.run_id} finished on every host", "green"), f" ({timings['total_s']:.1f}s)"
                                    + (f"; code {str(synced.get('hash') or '')[:12]} from {synced['src']}" if synced.get("src") else "")
                                    + f"; logs in {record.path}"))
        return ExitCode.OK
    if idle_stopped:
        console.print(Text.assemble((f"run {record.run_id} idle-stopped: {result.reason}", "bold yellow"),
                                    f"; {resume_hint(record.run_id, job)}; logs in {record.path}"), soft_wrap=True)
        return ExitCode.FAILED
    if stopped_by is not None:
        console.print(Text.assemble((f"run {record.run_id} stopped by `mnft stop` ({stopped_by})", "bold yellow"),
                                    f"; {resume_hint(record.run_id, job)}; logs in {record.path}"), soft_wrap=True)
        return ExitCode.INTERRUPTED
    shown = trace or ([text for _, text in list(failed.tail)[-8:]] if failed is not None else [])
    label = f"{result.failed_host} r{rank}" if rank is not None else result.failed_host
    lines = "\n".join(f"  {label}| {t}" for t in shown)
    if note:
        record.update(attempts_note=note)
    console.print(Text.assemble((f"run {record.run_id} failed: {reason}", "bold red"), (stopped_note(result) or "; every host's run was stopped") + "\n", lines))
    if diagnosis is not None:
        console.print(Text.assemble(("cause: ", "bold"), diagnosis.cause, "\n", ("fix:   ", "bold"), diagnosis.fix))
    raise RunFailed(f"run {record.run_id} failed: {reason}" + (f" [{note}]" if note else "")
                    + f" (logs: {record.path})")
