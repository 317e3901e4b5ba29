"""mnft's command line: thin Invoke tasks that parse arguments, call mnft, and map errors to exit codes.

The same collection serves `mnft TASK …` (the console command, mnft.cli.main.main) and `invoke TASK …` in the mnft
checkout (its tasks.py imports `ns` from here). Run `mnft --list` for the tasks and `mnft --help TASK` for each
one's options.
"""

from __future__ import annotations

import atexit
import gc
import sys
from dataclasses import replace
from functools import partial, wraps
from pathlib import Path

import invoke
from invoke import Collection, Exit

from mnft.cli.parsing import LetterFlagsTask, OptionalPositionalTask, remainder

task = partial(invoke.task, klass=LetterFlagsTask)  # short flags are letters (mnft.cli.parsing); klass= still chooses

DEFAULT_INVENTORY = Path(__file__).resolve().parent / "local.yaml"  # this machine only, no SSH
INVENTORY_FORMATS = "mnft YAML, Ansible YAML or INI, or a hostfile"
HOSTS_HELP = (f"inventory file ({INVENTORY_FORMATS}); default: the embedded mnft/cli/local.yaml (this machine, 2 processes, "
              "no SSH; inventory/local.yaml in mnft's checkout)")

# Once a command is done, the interpreter's teardown runs full garbage collections over every object it ever made
# (invoke, paramiko, the hosts' facts): 50-70 ms of CPU after the last line is out, on every command (check at 8
# hosts takes ~1 s). Frozen then, they are not traversed again; the process ends, and its memory with it. Objects
# are still freed module by module (files closed, buffers flushed); only garbage in reference cycles is left to
# the end of the process, as Python's own documentation allows for anything alive at exit.
atexit.register(gc.freeze)


def _mnft_errors(fn):
    """Expected errors become one line and their exit code; a bug keeps its traceback. SIGINT and SIGTERM alike
    end every child mnft started and unwind (mnft.core.interrupts): exit 130 (Ctrl-C) or 143 (SIGTERM)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        from mnft.core import interrupts
        from mnft.core.errors import MnftError

        try:
            with interrupts.handling():
                code = fn(*args, **kwargs)
        except MnftError as exc:
            raise Exit(f"mnft: {exc}", code=int(exc.exit_code)) from None
        except KeyboardInterrupt as exc:  # interrupts.handling() made it an Interrupted with its signal
            raise Exit(f"mnft: {exc}", code=getattr(exc, "exit_code", 130)) from None
        if code:
            raise Exit(code=int(code))

    return wrapper


def _inventory(hosts: str | None):
    """The inventory --hosts names, else the embedded one. The embedded one's hosts (also read through the checkout's
    inventory/local.yaml) run the Python running mnft unless they name a python: this machine's, with its torch."""
    from mnft.env.record import effective
    from mnft.hosts import inventory

    path = Path(hosts or DEFAULT_INVENTORY)
    python = sys.executable if path.resolve() == DEFAULT_INVENTORY else None
    return effective(inventory.load(path, python=python))  # a provisioned host uses its environment's python


def _seconds(option: str, value: str | None, default: float, most: float = 3600.0) -> float:
    """A number of seconds given on the command line (0 to `most`), or the default; anything else is one line."""
    import math

    from mnft.core.errors import InputError

    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= most:  # also refuses nan
        raise InputError(f"{option} {str(value)[:40]!r}: give seconds from 0 to {most:g}")
    return seconds


def _whole(option: str, value) -> int | None:
    """A whole number given on the command line (None: not given); anything else is one line."""
    from mnft.core.errors import InputError

    if value is None:
        return None
    try:
        return int(str(value), 10)
    except ValueError:
        raise InputError(f"{option} {str(value)[:40]!r}: a whole number") from None


def _wait(value) -> float | None:
    """--wait (as long as it takes: inf) or --wait SECONDS; None when not given."""
    if value is None or value is False:
        return None
    if value is True:
        return float("inf")
    return _seconds("--wait", value, 0.0, most=30 * 86400.0)


NOTIFY_HELP = ("run this shell line on this machine when the run starts after waiting in line and when it ends, its outcome in "
               "MNFT_NOTIFY_* variables (docs/lab.md); killed after 30s (notify.timeout); default: notify: in ~/.mnft.yaml")


def _notify(c, given: str | None, job_notify: str | None = None):
    """--notify, else the job file's notify:, else the user's default (notify: in mnft's user config)."""
    from mnft.run.notify import settings

    config = getattr(c, "config", None)
    name = f"~/.{getattr(type(config), 'prefix', 'mnft')}.yaml"
    return settings(given, job_notify, config, name)


def _timeouts(connect_timeout: float, timeout: float):
    from mnft.hosts.connection import Timeouts

    return Timeouts(connect=connect_timeout, command=timeout)


@task(help={"hosts": HOSTS_HELP, "json": "machine-readable output"})
@_mnft_errors
def inventory(c, hosts=None, json=False):
    """Print the effective per-host settings: what each host will actually use."""
    from mnft.hosts.report import print_inventory

    print_inventory(_inventory(hosts), json)


@task(
    help={
        "hosts": HOSTS_HELP,
        "json": "machine-readable output (per host: outcome, facts, problems)",
        "port": "rendezvous port to test (default: the inventory's, 29500)",
        "min_free_gb": "free disk floor at each host's workdir, GiB",
        "max_clock_skew": "largest clock difference to the master, seconds",
        "no_network": "skip the rendezvous port test",
        "connect_timeout": "seconds to wait for each SSH connection",
        "timeout": "seconds each remote command may take",
        "perf": "also measure speed: link matrix (TCP Gbit/s, RTT), matmul TFLOP/s per device, all_reduce busbw (docs/perf.md)",
        "perf_out": "with --perf: directory for perf.json and links.png (default: runs/perf-<time>)",
        "perf_launcher": "with --perf: direct (default: the ranks with torchrun's environment, without its agent: half the start-up) or torchrun (as training)",
        "recipe": "also prove this job can start: one of mnft's recipes (lora, full)",
        "job": "also prove this job can start: a job file (see docs/jobs.md); or give your script after -- as for train",
        "src": "the tree train would sync (default: the top of the git repository around the current directory)",
        "image": "the job runs in this container image (a reference or a .sif path; default: the job file's image:): its id "
                 "compared on every host, Python, torch, CUDA, NCCL and the job's modules looked up inside it (docs/containers.md)",
    }
)
@_mnft_errors
def check(c, hosts=None, json=False, port=0, min_free_gb=2.0, max_clock_skew=2.0, no_network=False, connect_timeout=10.0, timeout=60.0,
          perf=False, perf_out=None, perf_launcher="direct", recipe=None, job=None, src=None, image=None):  # image last: the others keep their short flags
    """Prove every host can join one training job: same Python/torch/CUDA/NCCL/driver, disk, rsync, interface, port, clock.
    With a job (--recipe, --job FILE, or `-- SCRIPT.py ARGS…` / `-- -m pkg.mod`): also that it can start on every
    host: its entry point is in the tree and every module it imports resolves in each host's Python.

    Exit codes: 0 every host ok, 1 some host failed a check, 2 bad input, 4 some host unreachable or its key rejected.
    """
    from mnft.check.findings import CheckOptions
    from mnft.check.gather import gather
    from mnft.check.report import print_check
    from mnft.hosts.fleet import Fleet

    inv = _inventory(hosts)
    if image is not None:
        from mnft.image.runtime import check_ref

        image = check_ref(image, "--image")
    options = CheckOptions(min_free_gb=float(min_free_gb), max_clock_skew_s=float(max_clock_skew), port=int(port) or None, network=not no_network,
                           code_src=src, image=image)
    entry = tuple(remainder())
    if recipe or job or entry:  # the job preflight train runs, here without launching anything
        from mnft.run.needs import job_needs
        from mnft.run.train import source_for
        from mnft.sync.source import default_source

        the_job = _job(recipe, job, entry, ())
        tree = source_for(the_job, Path(src) if src else None) or default_source()
        needs = job_needs(the_job, tree, synced=True)
        options = replace(options, code_src=str(tree), required_files=needs.files, modules=needs.modules,
                          image=options.image or the_job.image)
    if perf:
        from mnft.perf.gather import PerfOptions

        perf_options = PerfOptions(launcher=perf_launcher)  # bad input before any host is touched
    with Fleet(inv, _timeouts(connect_timeout, timeout)) as fleet:
        report = gather(fleet, options)
        if perf:
            from mnft.perf.report import check_perf

            return check_perf(fleet, report, json, Path(perf_out) if perf_out else None, perf_options)
    _check_supervision(inv, report)
    print_check(report, json)
    return report.exit_code()


def _check_supervision(inv, report) -> None:
    """Whether this user's detached runs can be supervised on this lab (mnft.run.supervisor): where, or why not with
    the fix; a line of its own, never a problem (attached runs do not need it)."""
    from mnft.run.supervisor import look_supervision, supervision_line

    found, _ = look_supervision(inv)
    report.supervision = {**found, "line": supervision_line(found)}


@task(
    name="trust-hosts",
    help={
        "hosts": HOSTS_HELP,
        "dry_run": "show the keys and fingerprints without recording them",
        "json": "machine-readable output",
        "connect_timeout": "seconds to wait for each host",
    },
)
@_mnft_errors
def trust_hosts(c, hosts=None, dry_run=False, json=False, connect_timeout=10.0):
    """Trust the hosts' SSH keys on purpose: record new keys in ~/.mnft/known_hosts and print their fingerprints.

    Compare the printed fingerprints with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on each host.
    A changed key is never recorded (possible man-in-the-middle): remove the old one first.
    """
    from mnft.core.errors import ExitCode
    from mnft.hosts.report import print_trust
    from mnft.hosts.trust import trust_hosts as trust

    results = trust(_inventory(hosts), _timeouts(connect_timeout, 30.0), dry_run=dry_run)
    print_trust(results, json)
    if any(r.state in ("unreachable", "changed", "other-type", "revoked") for r in results):
        return ExitCode.UNREACHABLE
    return ExitCode.OK


def _console():
    from mnft.core.output import console

    return console()


def launched_on_hosts(record) -> bool:
    from mnft.run.rerun import launched

    return launched(record.data) and bool(record.data.get("hosts"))


def _record_fleet(run, hosts, anywhere=True, not_started_ok=False):
    """The run record (by id from any directory; without one, the latest here, else, `anywhere`, the latest of
    the user's) and a fleet over its inventory snapshot (or --hosts when given)."""
    from mnft.core.errors import InputError
    from mnft.hosts.fleet import Fleet
    from mnft.run import records
    from mnft.run.rerun import from_snapshot, launched

    record = records.load(run, launched, anywhere=anywhere)
    _refreshed(record)
    if not launched(record.data) and not (not_started_ok and record.data.get("supervisor")):
        raise InputError(f"{record.path}: run {record.run_id} never started on the hosts ({record.data.get('state')}: {record.data.get('reason')})")
    inv = _inventory(hosts) if hosts else from_snapshot(record.data.get("inventory"), f"{record.path}/run.json")
    return record, Fleet(inv)


def _refreshed(record) -> None:
    """A detached run's record brought up to date from its supervisor on the lab (mnft.run.supervisor.refresh)."""
    from mnft.run import supervisor

    if supervisor.supervised(record):
        supervisor.refresh(record)


def _someone_elses(run) -> bool:
    """A run id this controller has no record of (another user's run, seen in `mnft lab`)."""
    from mnft.run import records

    return bool(run) and isinstance(run, str) and bool(records.RUN_ID.fullmatch(run)) and records.path_of(run) is None


def _sweep_record(run, anywhere=True):
    """The sweep's record, brought up to date from its supervisor, when `run` names a sweep; else None."""
    from mnft.core.errors import InputError
    from mnft.run import records, supervisor
    from mnft.run.sweep import KIND

    try:
        record = records.load(run, anywhere=anywhere)
        if run is None and (record.data.get("sweep") or {}).get("id") and record.data.get("kind") != KIND:  # the latest is a point: its sweep
            record = records.load(record.data["sweep"]["id"], anywhere=True)
    except InputError:
        return None
    if record.data.get("kind") != KIND:
        return None
    supervisor.refresh(record)
    return record


def _slurm_record(run, anywhere=True):
    """The run's record when it is a Slurm run (status, stop and logs then ask Slurm), else None."""
    from mnft.run import records
    from mnft.run.rerun import launched

    record = records.load(run, launched, anywhere=anywhere)
    return record if record.data.get("slurm") else None


def _job(recipe, job_file, entry, overrides, sweep_keys=()):
    """The job from --recipe, --job FILE and/or the words after `--` (verbatim): exactly one entry point."""
    from mnft.core.errors import InputError
    from mnft.run import job as jobs

    if recipe and (job_file or entry):
        raise InputError(f"--recipe {recipe} runs mnft's recipe: leave out " + ("--job" if job_file else "the script after --")
                         + " (or leave out --recipe to run your own script)")
    if job_file:
        job = jobs.load_job_file(Path(job_file), tuple(sweep_keys)).with_extra(tuple(entry))
        if overrides and not job.recipe:
            raise InputError("--set is for mnft's recipes: pass your script's arguments after --")
        return job.with_extra(jobs.parse_overrides(overrides)) if job.recipe else job
    if entry:
        if overrides:
            raise InputError("--set is for mnft's recipes: pass your script's arguments after --")
        return jobs.cli_job(entry)
    return jobs.recipe_job(recipe or "lora", tuple(overrides))


def _run_placeholders():
    from mnft.run.job import PLACEHOLDERS

    return frozenset(PLACEHOLDERS)


def _is_sweep(run_id):
    from mnft.run import records
    from mnft.run.sweep import KIND

    return records.load(run_id, anywhere=True).data.get("kind") == KIND


def _sweep_of(flags, the_job, max_parallel, *, slurm, dry_run, resume, src, nodes=None, wait=None):
    """The sweep asked (--sweep, or the job file's sweep:), judged whole before any host is touched."""
    from mnft.core.errors import InputError
    from mnft.run import sweep as sweeping
    from mnft.run import sweepspec

    if flags is not None and the_job.sweep is not None:
        raise InputError(f"{the_job.source}: the job file has a sweep: and --sweep was given: give the sweep once")
    spec = flags or the_job.sweep
    where = "--sweep" if flags is not None else f"{the_job.source}: sweep"
    left_out = ("--slurm" if slurm else "--dry-run (one point's commands: --dry-run without the sweep)" if dry_run else
                "--resume (mnft train --resume-run SWEEP runs its points that did not succeed again)" if resume else
                "--nodes (each point runs on the one host the sweep places it on)" if nodes is not None else
                "--wait (each point waits in line as its turn comes: the sweep does it)" if wait is not None else None)
    if left_out is not None:
        raise InputError(f"{where}: a sweep runs under its supervisor on the lab: leave out {left_out}")
    sweeping.check_used(the_job, spec, where)
    if the_job.recipe:
        from mnft.cli.recipes import check_overrides

        for values in spec.values():
            check_overrides(the_job.recipe, sweeping.point_job(the_job, values).extra_args, Path(src) if src else None)
    return sweeping.SweepRun(spec, sweepspec.max_parallel(max_parallel) if max_parallel is not None else None)


def _sweep_again(sweep_id, hosts, envs, env_files, src, max_parallel):
    """`--resume-run SWEEP`: the recorded sweep's job and hosts, its points that did not succeed."""
    from mnft.core.errors import InputError
    from mnft.run import records, sweepspec
    from mnft.run import sweep as sweeping
    from mnft.run.job import resumable
    from mnft.run.rerun import reuse_previous
    from mnft.run.supervisor import refresh

    record = records.load(sweep_id, anywhere=True)
    refresh(record)
    if record.data.get("state") not in ("succeeded", "failed", "stopped", "supervisor-lost", "dependency-failed"):
        raise InputError(f"sweep {sweep_id} is still {record.data.get('state')}: `mnft stop {sweep_id}` first, or wait for it (`mnft wait {sweep_id}`)")
    from mnft.run.supervisor import FINAL

    for point in (record.data.get("sweep") or {}).get("points") or []:  # each point's own record says how it ended
        path = records.path_of(str(point.get("run_id")))
        if path is not None:
            point["state"] = records.read_record(path / "run.json").get("state") or point.get("state")
    going = [p["run_id"] for p in (record.data.get("sweep") or {}).get("points") or [] if p.get("started") and p.get("state") not in FINAL]
    if going:
        raise InputError(f"sweep {sweep_id}: {len(going)} point(s) still run ({', '.join(going[:3])}{' …' if len(going) > 3 else ''}: their supervisor "
                         f"is gone, they go on under their keepers): `mnft stop {sweep_id}` first, or wait for them")
    reused = reuse_previous(record.data, hosts=hosts, overrides=(), env=envs, env_files=env_files, src=src)
    spec, again = sweeping.rerun_of(record.data, resumable(reused.job))
    if not again:
        raise InputError(f"sweep {sweep_id}: every point succeeded: nothing to run again")
    kept = []
    for point in again:
        if point.get("resume_from"):
            try:
                kept.append(records.load(point["resume_from"], anywhere=True))
            except InputError:
                point["resume_from"] = None
    count = len((record.data.get("sweep") or {}).get("points") or [])
    _console().print(f"sweep {sweep_id}: running again {len(again)} of {count} point(s), those that did not succeed", highlight=False)
    swept = sweeping.SweepRun(spec, sweepspec.max_parallel(max_parallel) if max_parallel is not None else (record.data.get("sweep") or {}).get("max_parallel"),
                              rerun=again, count=count, resumed=tuple(kept), resumed_from=sweep_id)
    return swept, reused.hosts, reused.job, reused.env, reused.env_files, reused.src


@task(
    iterable=["set", "env", "env_file", "sbatch_arg", "sweep"],
    optional=["wait"],
    help={
        "recipe": "one of mnft's recipes: lora or full (the default when no script or job is given)",
        "job": "a job file (YAML): your script, its arguments, env, resume rule and metrics; see docs/jobs.md",
        "hosts": HOSTS_HELP,
        "set": "recipe override key=value (repeat)",
        "env": "environment for the run: NAME (value from here) or NAME=VALUE (repeat); secret names (TOKEN/KEY/SECRET/PASSWORD) only as NAME",
        "env_file": "NAME=VALUE lines for the run, file mode 0600 (repeat): the way to pass secrets not in this environment",
        "rdzv": "static (node_rank from the inventory) or c10d",
        "rdzv_timeout": "seconds the rendezvous waits for every host to join before the run fails naming the missing hosts (default 300)",
        "detach": "start, print the run id and return; the run goes on",
        "resume": "continue the latest run's job (or --resume-run ID's) from its latest complete checkpoint",
        "resume_run": "the run to continue (by id, from any directory); with --job FILE: FILE's resume rule, the rest as the run recorded it",
        "force": "launch even if the check finds problems",
        "dry_run": "print every host's exact command and environment (secrets redacted); start nothing",
        "no_sync": "do not sync the code first",
        "src": "the tree to sync (default: the top of the git repository around the current directory)",
        "port": "rendezvous port (default: the inventory's; the next free one on the master if taken)",
        "max_restarts": "after a failure, restart the gang from the latest checkpoint up to N times (a lost host is "
                        "waited for, then replaced by a spare: true host or dropped with --min-nodes); 0: stop at once",
        "min_nodes": "with --max-restarts: continue on fewer hosts (at least this many) when a lost host has no spare "
                     "(recipes; a job file must say elastic: true)",
        "backoff": "with --max-restarts: seconds before the first restart, doubled for each later one up to 60 (default 5)",
        "wait_for_lost": "with --max-restarts: seconds a lost host may take to answer again before a spare takes its place "
                         "or the gang shrinks (default 20)",
        "slurm": "run on Slurm: submit an sbatch script rendered from the launch plan (or, inside salloc, use the allocation); "
                 "see docs/slurm.md. With --slurm, --max-restarts is how often the batch requeues itself (default 3)",
        "partition": "--slurm: the partition (default: Slurm's default)",
        "nodes": "N hosts of the inventory where the run's devices are free (node_rank in inventory order; --dry-run shows the pick "
                 "and why); with --slurm: nodes to allocate (one agent, one torchrun per node)",
        "gpus": "G GPUs on each host, picked among the free ones (the fastest-linked), seen by the ranks as CUDA_VISIBLE_DEVICES; "
                "the rest stay free for other runs (default: every device of every host); also a job file's gpus:",
        "wait": "when the devices are taken, wait in line for them (first come, first served across users) instead of failing; "
                "--wait SECONDS gives up after that long",
        "time": "--slurm: the time limit, in Slurm's format (minutes, HH:MM:SS, D-HH:MM …)",
        "account": "--slurm: the account to charge",
        "gpus_per_node": "--slurm: GPUs per node (also the processes per node)",
        "requeue": "--slurm: requeue after a node failure, and after a save on the warning signal; resume from the latest checkpoint",
        "signal": "--slurm: the warning before the time limit, SIGNAL@SECONDS (default USR2@90): the job saves, the batch requeues it",
        "sbatch_arg": "--slurm: one more sbatch option, --name or --name=value (repeat)",
        "image": "run torchrun inside this container image on every host (podman, docker or apptainer: a reference, or a .sif "
                 "path); check compares its id on every host; also a job file's image: (see docs/containers.md)",
        "notify": NOTIFY_HELP,
        "idle_stop": "end the run once its GPUs have all been idle this long (30m, 2h …: utilisation at most 5% and memory "
                     "unchanged; docs/lab.md); a host's lab-wide idle_stop applies when lower",
        "sweep": "KEY=V1,V2,…: one run per value (repeat: every combination), each filling {KEY} in the script's arguments; "
                 "handed to a supervisor on the lab, points placed on free GPUs as they free up (docs/sweeps.md)",
        "max_parallel": "with a sweep: at most K points running (or waiting in a host's line) at once",
        "after": "RUN[:any]: start once run (or sweep) RUN has succeeded (RUN:any: once it has ended, however); "
                 "no place in line until then; RUN not succeeding ends this one dependency-failed",
    },
)
@_mnft_errors
def train(c, recipe=None, job=None, hosts=None, set=None, env=None, env_file=None, rdzv="static", detach=False, resume=False,
          resume_run=None, force=False, dry_run=False, no_sync=False, src=None, port=0, max_restarts=0, min_nodes=0, rdzv_timeout=300,
          slurm=False, partition=None, nodes=None, time=None, account=None, gpus_per_node=0, requeue=False, signal="USR2@90", sbatch_arg=None,
          backoff=None, wait_for_lost=None, gpus=None, wait=None, image=None, notify=None, idle_stop=None, sweep=None, max_parallel=None,
          after=None):  # last: the earlier options keep their short flags
    """Run a job on every host with torchrun, the right node_rank, supervised as one gang: one of mnft's recipes
    (--recipe lora), or your own entry point and its arguments after `--` (`-- train.py ARGS…`, `-- -m pkg.train
    ARGS…`, passed verbatim), or a job file (--job FILE [-- more args])."""
    from mnft.check.findings import CheckOptions
    from mnft.core import durations
    from mnft.core.errors import InputError
    from mnft.run.launch import LaunchOptions
    from mnft.run.recover import Policy
    from mnft.run.train import TrainOptions
    from mnft.run.train import train as run_train

    from mnft.run import sweepspec

    overrides, envs, env_files, entry = tuple(set or ()), tuple(env or ()), tuple(env_file or ()), tuple(remainder())
    gpus, nodes = _whole("--gpus", gpus), _whole("--nodes", nodes)
    flags_sweep = sweepspec.from_flags(tuple(sweep or ()), _run_placeholders())
    swept, depends = None, sweepspec.after(after)
    if resume_run and _is_sweep(resume_run):  # the points of a sweep that did not succeed, run again
        if entry or recipe or job or flags_sweep:
            raise InputError(f"--resume-run {resume_run} runs the sweep's points that did not succeed, as recorded: leave out the job and --sweep")
        swept, hosts, the_job, envs, env_files, src = _sweep_again(resume_run, hosts, envs, env_files, src, max_parallel)
        resume_run = None  # each point resumes from its own record (SweepRun.rerun), not the sweep as one run
    elif resume or resume_run:  # the previous run's job, hosts file and env names, unless given again
        from mnft.run.job import load_job_file
        from mnft.run.rerun import previous_run, reuse_previous, with_rule_of

        if entry or recipe:
            raise InputError("--resume continues the recorded job: leave out --recipe and the script (start a new run to change them; "
                             "--job FILE gives the run FILE's resume rule)")
        reused = reuse_previous(previous_run(resume_run).data, hosts=hosts, overrides=overrides, env=envs, env_files=env_files, src=src)
        hosts, the_job, envs, env_files, resume_run, src = reused.hosts, reused.job, reused.env, reused.env_files, reused.run_id, reused.src
        notes = reused.notes
        if job:  # the recorded job, with the job file's resume rule (a run started without one can be continued)
            the_job = with_rule_of(the_job, load_job_file(Path(job)), job)
            notes = (*notes, f"(the resume rule of {job})")
        _console().print(f"resuming run {reused.run_id}" + (": reusing " + " ".join(notes) if notes else ""), highlight=False, soft_wrap=True)
    else:
        the_job = _job(recipe, job, entry, overrides, flags_sweep.keys if flags_sweep else ())
    if swept is None and (flags_sweep is not None or the_job.sweep is not None):
        swept = _sweep_of(flags_sweep, the_job, max_parallel, slurm=slurm, dry_run=dry_run, resume=resume or bool(resume_run), src=src,
                          nodes=nodes, wait=wait)
    elif max_parallel is not None and swept is None:
        raise InputError("--max-parallel is for a sweep (--sweep KEY=V1,V2, or a job file's sweep:)")
    if image is not None:
        from mnft.image.runtime import check_ref

        the_job = replace(the_job, image=check_ref(image, "--image"))
    if the_job.recipe and swept is None:  # a typo in --set is bad input here, before any host is touched (a sweep's: each point's)
        from mnft.cli.recipes import check_overrides

        check_overrides(the_job.recipe, the_job.extra_args, Path(src) if src else None)
    if slurm and depends is not None:
        raise InputError("--after is kept by mnft's supervisor on the lab: under --slurm, chain jobs with Slurm's own dependency "
                         "(--sbatch-arg --dependency=afterok:JOBID)")
    if slurm:  # the same job on a Slurm allocation (mnft.slurm)
        from mnft.slurm.plan import SlurmOptions
        from mnft.slurm.submit import SlurmTrain
        from mnft.slurm.submit import train as slurm_train

        if idle_stop is not None:
            raise InputError("--idle-stop is enforced by mnft's keepers on the lab's own hosts: under --slurm, Slurm's time limit (--time) bounds the job")
        if gpus is not None or wait is not None:
            raise InputError("--gpus and --wait share a lab's hosts without a scheduler: under --slurm, Slurm places the job "
                             "(--gpus-per-node, and it queues the job itself)")
        asked = SlurmOptions(nodes=1 if nodes is None else nodes, partition=partition, time=time, account=account, gpus_per_node=gpus_per_node or None, requeue=requeue,
                             signal=signal, max_requeues=max_restarts or 3, sbatch_args=tuple(sbatch_arg or ()))
        template = _inventory(hosts).hosts[0] if hosts else None
        return slurm_train(SlurmTrain(the_job, asked, template, envs, env_files, rdzv, rdzv_timeout, int(port), Path(src) if src else None,
                                      not no_sync, dry_run, resume_run, resume, detach), _console())
    options = TrainOptions(
        launch=LaunchOptions(job=the_job, rdzv=rdzv, env=envs, env_files=env_files, detach=detach, resume=resume, rdzv_timeout=rdzv_timeout,
                             idle_stop=durations.parse(idle_stop, "--idle-stop") if idle_stop is not None else None),
        check=CheckOptions(port=int(port) or None),
        force=force,
        src=Path(src) if src else None,
        sync=not no_sync,
        dry_run=dry_run,
        resume_run=resume_run,
        recovery=Policy(max_restarts=max_restarts, min_nodes=min_nodes or None,  # invoke parses both as int
                        backoff_s=_seconds("--backoff", backoff, Policy.backoff_s),
                        reuse_wait_s=_seconds("--wait-for-lost", wait_for_lost, Policy.reuse_wait_s)),
        gpus=gpus,
        nodes=nodes,
        wait=_wait(wait),
        notify=_notify(c, notify, the_job.notify),
        sweep=swept,
    )
    inventory = _inventory(hosts)
    if depends is not None:
        from mnft.run.after import refuse_failed
        from mnft.run.supervisor import judge_after

        options = replace(options, after=refuse_failed(judge_after(depends, detached=bool(detach or swept))))
    if swept is not None:  # handed to its supervisor on the lab, always: a sweep outlives this terminal
        from mnft.run.supervisor import hand_off

        return hand_off(inventory, options, _console())
    if detach and not dry_run:  # supervised on the lab (mnft.run.supervisor); None: no supervisor can, and none was needed
        from mnft.run.supervisor import hand_off

        handed = hand_off(inventory, options, _console())
        if handed is not None:
            return handed
    return run_train(inventory, options, _console())



@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "follow": "keep printing new lines until the run ends", "lines": "lines per host", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def logs(c, run=None, follow=False, lines=20, hosts=None):
    """Collect every host's logs and metrics into runs/<id>/<host>/, write loss.png, print a merged tail."""
    from mnft.run.logs import collect, merged_tail
    from mnft.run.logs import follow as follow_logs

    if (slurm_run := _slurm_record(run)) is not None:
        from mnft.slurm.submit import logs as slurm_logs

        return slurm_logs(slurm_run, int(lines), follow, _console())
    if (swept := _sweep_record(run)) is not None:  # every point's logs, point after point
        return _sweep_logs(swept, int(lines), follow, hosts)
    record, fleet = _record_fleet(run, hosts)
    with fleet:
        if follow:
            return follow_logs(record, fleet, _console())
        metrics = collect(record, fleet, _console())
    merged_tail(record, int(lines), _console(), metrics)


def _stop_points(swept, grace):
    from mnft.hosts.fleet import Fleet
    from mnft.run import records
    from mnft.run.control import stop as run_stop
    from mnft.run.rerun import from_snapshot
    from mnft.run.supervisor import FINAL

    for point in (swept.data.get("sweep") or {}).get("points") or []:
        path = records.path_of(str(point.get("run_id")))
        if path is None:
            continue
        record = records.load(point["run_id"], anywhere=True)
        if record.data.get("state") in FINAL or not launched_on_hosts(record):
            continue
        records.request_stop(record, "mnft stop of its sweep")
        with Fleet(from_snapshot(record.data.get("inventory"), f"{record.path}/run.json")) as fleet:
            run_stop(record, fleet, grace)
        _console().print(f"point {point.get('index')}: run {record.run_id}: {record.data.get('state')}", highlight=False)


def _sweep_logs(swept, lines, follow, hosts):
    from mnft.core.errors import InputError
    from mnft.hosts.fleet import Fleet
    from mnft.run import records
    from mnft.run.logs import collect, merged_tail
    from mnft.run.rerun import from_snapshot
    from mnft.run.sweep import values_label

    if follow:
        raise InputError(f"sweep {swept.run_id}: follow one point (mnft logs -f POINT) or the sweep's supervisor (mnft attach {swept.run_id})")
    for point in (swept.data.get("sweep") or {}).get("points") or []:
        _console().rule(f"point {point.get('index')} ({values_label(point.get('values') or {})}): run {point.get('run_id')}: {point.get('state')}")
        try:
            record = records.load(str(point.get("run_id")), anywhere=True)  # brought here with its sweep's refresh, once
            if not launched_on_hosts(record):
                raise InputError(f"run {record.run_id} never started on the hosts ({record.data.get('state')}: {record.data.get('reason')})")
            fleet = Fleet(_inventory(hosts) if hosts else from_snapshot(record.data.get("inventory"), f"{record.path}/run.json"))
        except InputError as exc:
            _console().print(f"  {exc}", highlight=False, soft_wrap=True)
            continue
        with fleet:
            metrics = collect(record, fleet, _console(), quiet=True)
        merged_tail(record, lines, _console(), metrics)


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "json": "machine-readable output", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def status(c, run=None, json=False, hosts=None):
    """A table per host: running / exited with code / unreachable, step, loss, since. Exit 0 only when healthy."""
    from mnft.run.control import status as run_status
    from mnft.run.control import supervisor
    from mnft.run.report import print_status

    if _someone_elses(run):  # not started from here: as its leases on the hosts show it
        from mnft.run import others

        return others.print_status(run, others.find(_inventory(hosts), run), json, _console())
    if (slurm_run := _slurm_record(run)) is not None:
        from mnft.slurm.submit import status as slurm_status

        return slurm_status(slurm_run, json, _console())
    if (swept := _sweep_record(run)) is not None:  # every point of a sweep, one table
        from mnft.run.sweepreport import print_sweep

        return print_sweep(swept, json)
    record, fleet = _record_fleet(run, hosts, not_started_ok=True)
    if record.data.get("supervisor") and not launched_on_hosts(record):  # a detached run its supervisor has not started yet (in line, checking)
        from mnft.run.report import print_supervised

        return print_supervised(record, json)
    with fleet:
        states = run_status(record, fleet)
    return print_status(record, states, json, supervisor(record))


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "a detached run's id (default: the latest)"})
@_mnft_errors
def attach(c, run=None):
    """Follow a detached run live: its supervisor's output on the lab (steps, failures, restarts, the time table) as
    it comes, until the run ends; Ctrl-C only stops following (`mnft stop RUN` stops the run)."""
    from mnft.core.errors import InputError
    from mnft.run import records, supervisor

    record = records.load(run, anywhere=True)
    if not supervisor.supervised(record):
        raise InputError(f"run {record.run_id} has no supervisor on the lab (an attached run, or one started unsupervised): "
                         f"follow it with mnft logs -f {record.run_id}")
    return supervisor.attach(record, _console())


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "grace": "seconds between SIGTERM and SIGKILL", "json": "machine-readable output", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def stop(c, run=None, grace=10.0, json=False, hosts=None):
    """Kill exactly that run's process groups on every host (by recorded group and run id), verify none remain."""
    from mnft.run.control import stop as run_stop
    from mnft.run.report import print_stop

    if _someone_elses(run):  # another user's run (only its holder or root may stop it)
        from mnft.run import others

        inv = _inventory(hosts)
        held = others.find(inv, run)
        others.refuse_stop(run, held, inv)
        return others.print_stop(run, others.stop(inv, run, held, float(grace)), json, _console())
    if (slurm_run := _slurm_record(run, anywhere=False)) is not None:  # no id: this directory's latest, never another's
        from mnft.slurm.submit import stop as slurm_stop

        return slurm_stop(slurm_run, json, _console())
    if (swept := _sweep_record(run, anywhere=False)) is not None:  # its supervisor stops every point, and starts no other
        from mnft.core.errors import ExitCode
        from mnft.run import supervisor
        from mnft.run.sweepreport import print_sweep

        if (swept.data.get("supervisor") or {}).get("alive"):
            supervisor.request_stop(swept)
            supervisor.settled(swept, float(grace) + 60)
        else:  # its supervisor is gone: its points still running (each under its keepers) are stopped on their hosts
            _stop_points(swept, float(grace))
        print_sweep(swept, json)
        return ExitCode.OK if swept.data.get("state") in ("stopped", "succeeded", "failed") and not (swept.data.get("supervisor") or {}).get("alive") else ExitCode.FAILED
    record, fleet = _record_fleet(run, hosts, anywhere=False, not_started_ok=True)
    from mnft.run import supervisor

    if supervisor.supervised(record):
        if (record.data.get("supervisor") or {}).get("alive"):
            supervisor.request_stop(record)  # its supervisor tears the gang down and records the stop, as Ctrl-C does
        if not launched_on_hosts(record):  # in line or checking: nothing of it on the hosts to stop
            return supervisor.stopped(record, float(grace) + 20, _console(), json)
    with fleet:
        result = run_stop(record, fleet, float(grace))
    if supervisor.supervised(record):
        supervisor.settled(record, float(grace) + 20)
    code = print_stop(record, result, json)
    from mnft.run.control import gpu_verdict, job_of
    from mnft.run.rerun import resume_hint

    code = gpu_verdict(result, code, None if json else _console())
    if not json and record.data.get("state") == "stopped" and record.data.get("kind") != "session":
        _console().print(f"run {record.run_id} stopped; {resume_hint(record.run_id, job_of(record.data))}", highlight=False, soft_wrap=True)
    return code


@task(
    iterable=["exclude"],
    help={
        "hosts": HOSTS_HELP,
        "src": "the tree to copy (default: the top of the git repository around the current directory)",
        "data": "copy this data directory to every host's data_dir instead of the code (hosts found sharing it, and hosts declared shared_fs: one copy, verified by the others)",
        "exclude": "one more rsync exclude pattern (repeat); also invoke.yaml's sync.exclude list",
        "dry_run": "list what would change per host; copy nothing",
        "no_delete": "keep even the files mnft placed earlier that the source no longer has (files mnft did not place are never deleted)",
        "json": "machine-readable output (per host: status, files, bytes, hash)",
        "workers": "rsyncs at once",
        "timeout": "with --data: seconds each host's rsync may take in all (default 3600)",
        "image": "bring this container image (a reference, or a .sif path) to every host that lacks it, from this machine or the "
                 "first host that has it, verified by its id; no registry",
        "force": "replace host files in the way that mnft did not place (code, data); with --image: hosts holding another image under that name receive the reference too (else: refused, named)",
        "no_relay": "with --image: send from this machine to every host, even with the SSH mesh",
    },
)
@_mnft_errors
def sync(c, hosts=None, src=None, data=None, exclude=None, dry_run=False, no_delete=False, json=False, workers=16, timeout=3600.0,
         image=None, force=False, no_relay=False):
    """Copy the code (or --data, or an --image) to every host in parallel and prove each copy by its tree hash (an image: its id).

    Exit codes: 0 every host identical, 1 a host failed or differs (the files are named) or is busy with another
    mnft operation (its lease: nothing touched), 2 bad input or a
    refused target, found before the sync or by a host's probe (nothing touched there; --image: a host holding
    another image, without --force), 4 a host unreachable or its key rejected. --dry-run lists per host what would
    be sent, removed and in the way. Nothing mnft did not place is ever removed or replaced: a host file in the way of a
    source file is a conflict (exit 1, nothing written on that host; --force replaces it); --no-delete keeps even
    mnft's own files the source dropped.
    """
    if image is not None:
        return _sync_image(hosts, image, dry_run=dry_run, force=force, relay=not no_relay, json=json, src=src, data=data)
    from mnft.sync.mirror import sync_code, sync_data
    from mnft.sync.report import print_sync

    options = dict(progress=not json, delete=not no_delete, dry_run=dry_run, extra_excludes=list(exclude or []), workers=int(workers),
                   config=c.config, force=bool(force))  # sync.exclude from the config is added by mnft.sync.mirror, as for check and train
    inv = _inventory(hosts)
    if data:
        report = sync_data(inv, Path(data), timeout=float(timeout), **options)
    else:
        report = sync_code(inv, Path(src) if src else None, **options)
    print_sync(report, json)
    return report.exit_code()


def _sync_image(hosts, image, *, dry_run: bool, force: bool, relay: bool, json: bool, src, data) -> int:
    from mnft.core.errors import InputError
    from mnft.core.output import console, plain
    from mnft.image.distribute import Progress, sync_image
    from mnft.image.report import print_image_sync

    if src or data:
        raise InputError("--image syncs an image only: run the code (--src) or --data sync on its own")
    err = console(stderr=True)
    say = (lambda message: None) if json else (lambda message: err.print(plain(message, style="dim")))
    report = sync_image(_inventory(hosts), image if isinstance(image, str) else "", force=force, dry_run=dry_run, relay=relay, say=say,
                        progress=None if json else Progress(err))
    print_image_sync(report, json)
    return report.exit_code()


@task(
    iterable=["only"],
    help={
        "hosts": HOSTS_HELP,
        "playbook": "the playbook (default: playbooks/setup.yaml)",
        "check": "print what each step would change on each host; change nothing",
        "only": "run only this step (step, step name or tag: trust, names, firewall, ports, gpu, admins); repeat or comma-separate",
        "undo": "remove exactly what mnft's steps added (in reverse order)",
        "admin_group": "name the group whose members may drain and undrain (/etc/mnft/admin-group on every host; it must exist there); runs only that step",
        "json": "machine-readable output (per host and step: status, changes, error)",
        "connect_timeout": "seconds to wait for each SSH connection",
        "timeout": "seconds each remote call may take",
    },
)
@_mnft_errors
def setup(c, hosts=None, playbook=None, check=False, only=None, undo=False, json=False, connect_timeout=10.0, timeout=120.0, admin_group=None):
    """Prepare the hosts for multi-node jobs: controller key, node-to-node SSH mesh, /etc/hosts, peers-only firewall;
    the members' view of GPU Xids (kernel_log) and the lab's admins (admin_group, `--admin-group NAME`).

    Idempotent: a second run reports 0 changed. Exit codes: 0 ok, 1 a step failed on some host (or one is busy with
    another mnft operation: nothing applied), 2 bad playbook or
    inventory (nothing applied anywhere), 4 some host unreachable or its key rejected.
    """
    from mnft.core.errors import InputError
    from mnft.setup import playbook as pb

    if admin_group is not None and (playbook or only):
        raise InputError("--admin-group runs only the admin_group step: leave out --playbook and --only")
    book = pb.single("admin_group", {"group": admin_group}, "The lab's admins", "--admin-group") if admin_group is not None else pb.load(playbook or pb.DEFAULT_PLAYBOOK)
    chosen = [w for item in (only or []) for w in item.split(",")]
    report = pb.run(_inventory(hosts), book, check=check, undo=undo, only=chosen or None, timeouts=_timeouts(connect_timeout, timeout))
    pb.print_report(report, json)
    return report.exit_code()


@task(
    iterable=["find_links"],
    help={
        "hosts": HOSTS_HELP,
        "lock": "the lock file (requirements.lock or pylock.toml); default: the one at the top of --src",
        "src": "the project tree whose lock is the default (default: the git top level around the current directory)",
        "dry_run": "per host what would be installed, upgraded and removed; change nothing",
        "rollback": "switch every host back to its previous environment",
        "online": "hosts install straight from the lock's index (they need internet); still exactly pinned",
        "offline": "this machine uses no index either: only the wheelhouse, the lock's local wheels and --find-links",
        "find_links": "a local directory of wheels for this machine's fetch (repeat)",
        "wheelhouse": "where this machine keeps the wheels (default: $MNFT_HOME/wheelhouse)",
        "python": "the Python X.Y to build with when the lock does not name one (default: the master's)",
        "no_relay": "send the wheels from this machine to every host, even with the SSH mesh",
        "json": "machine-readable output",
        "connect_timeout": "seconds to wait for each SSH connection",
    },
)
@_mnft_errors
def provision(c, hosts=None, lock=None, src=None, dry_run=False, rollback=False, online=False, offline=False, find_links=None,
              wheelhouse=None, python=None, no_relay=False, json=False, connect_timeout=10.0):
    """The same Python environment on every host, from a lock file: offline, atomic, verified, idempotent.

    Exit codes: 0 every host matches the lock, 1 a host failed (it keeps its previous environment) or is busy with
    another mnft operation (nothing changed), 2 bad input
    (nothing changed on any host), 4 a host unreachable or its key rejected.
    """
    from mnft.core.output import console, plain
    from mnft.env.provision import ProvisionOptions
    from mnft.env.provision import provision as run
    from mnft.env.report import print_report, print_table

    options = ProvisionOptions(lock=Path(lock) if lock else None, src=Path(src) if src else None, dry_run=dry_run, rollback=rollback,
                               online=online, offline=offline, find_links=tuple(find_links or ()), wheelhouse=Path(wheelhouse) if wheelhouse else None,
                               python=python, relay=not no_relay)
    err = console(stderr=True)
    say = (lambda message: None) if json else (lambda message: err.print(plain(message, style="dim")))
    show = None if json else (lambda title, outcomes, report: print_table(title, outcomes, report))
    report = run(_inventory(hosts), options, say=say, show=show, timeouts=_timeouts(connect_timeout, 60.0))
    print_report(report, json)
    return report.exit_code()


@task(help={"hosts": HOSTS_HELP, "dry_run": "list per host what would be removed and its size; change nothing",
            "include_outputs": "also remove what runs wrote: <workdir>/outputs (the jobs' directories, checkpoints) and <workdir>/runs",
            "only": "these hosts of the inventory only (NAME[,NAME…]): the others keep everything, and so does this machine while they use it",
            "json": "machine-readable output", "connect_timeout": "seconds to wait for each host's SSH connection"})
@_mnft_errors
def uninstall(c, hosts=None, dry_run=False, include_outputs=False, only=None, json=False, connect_timeout=10.0):
    """Take mnft off the hosts and this machine: the environment provision built, code snapshots, the files sync
    placed (those still as placed), caches, share marks; here the wheelhouse and code snapshot store. What runs wrote
    stays unless --include-outputs; setup's changes are `setup --undo`'s (docs/uninstall.md).

    Exit codes: 0 done, 1 a host failed (or is busy with a run or another mnft operation: nothing changed),
    2 bad input, 4 a host unreachable or its key rejected.
    """
    from mnft.uninstall.report import print_report
    from mnft.uninstall.uninstall import UninstallOptions
    from mnft.uninstall.uninstall import uninstall as run

    inventory = _inventory(hosts)
    if only:
        inventory = inventory.only(_named_hosts(inventory, only, "--only"))
    report = run(inventory, UninstallOptions(dry_run=dry_run, include_outputs=include_outputs), _timeouts(connect_timeout, 60.0))
    print_report(report, json)
    return report.exit_code()


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "hosts": "inventory (default: the run's)",
                                                              "notify": "run this shell line once the run has ended, its outcome in MNFT_NOTIFY_* variables "
                                                                        "(a detached run's end; docs/lab.md)"})
@_mnft_errors
def wait(c, run=None, hosts=None, notify=None):
    """Block until a run (detached, another terminal's, or a session) has ended; exit 0 if it succeeded (a session:
    ended by itself), 130 if it was stopped or interrupted, 1 otherwise."""
    from mnft.hosts.fleet import Fleet
    from mnft.run import records
    from mnft.run.control import status as run_status
    from mnft.run.notify import exit_code
    from mnft.run.notify import wait as wait_for
    from mnft.run.rerun import from_snapshot, launched

    told = _notify(c, notify) if notify is not None else None  # only when asked: the run's own controller told its end
    record = records.load(run, anywhere=True)
    inv = _inventory(hosts) if hosts else from_snapshot(record.data.get("inventory"), f"{record.path}/run.json")
    from mnft.run import supervisor

    def look(r):
        if supervisor.supervised(r):  # the supervisor on the lab keeps the record: brought here
            supervisor.refresh(r)
        elif launched(r.data) and r.data.get("kind") != "session":
            run_status(r, fleet)

    if supervisor.supervised(record):  # ended when its supervisor has (the record final, the logs collected)
        supervisor.settled(record, float("inf"), every=2.0, say=lambda text: _console().print(f"run {record.run_id}: {text}", style="yellow",
                                                                                               highlight=False, soft_wrap=True))
        state = record.data.get("state")
        if record.data.get("kind") == "sweep":
            from mnft.run.sweepreport import print_sweep

            print_sweep(record, False)
    else:
        with Fleet(inv) as fleet:
            state = wait_for(record, look)
    _console().print(f"{'sweep' if record.data.get('kind') == 'sweep' else 'run'} {record.run_id}: {state}"
                     + (f": {record.data.get('reason')}" if record.data.get("reason") else ""), highlight=False, soft_wrap=True)
    from mnft.run.notify import tell

    tell(told, "ended", record, lambda text: _console().print(text, style="yellow", highlight=False, soft_wrap=True))
    return exit_code(state)


@task(
    optional=["wait"],
    help={
        "hosts": HOSTS_HELP,
        "host": "the host to open the session on (default: the first host of the inventory where the GPUs are free)",
        "gpus": "G free GPUs (the fastest-linked), seen in the session as CUDA_VISIBLE_DEVICES (default 1; 0: none)",
        "wait": "when the GPUs are taken, wait in line for them; --wait SECONDS gives up after that long",
        "time": "end the session after this long (90m, 2h …), told in the session 5 minutes before",
        "idle_stop": "end the session once its GPUs have all been idle this long (30m …; lower than the hosts' idle_stop)",
        "forward": "carry this port of the host to one here (printed: open it in a browser), e.g. for jupyter",
        "notify": NOTIFY_HELP.replace("the run", "the session"),
        "image": "open the session inside this container image (podman/docker/apptainer, as train runs a job in one): "
                 "its GPUs, the workdir mounted, as you; the container is removed when the session ends",
        "src": "the code the session opens in, placed as train places a run's (default: the repository around this directory)",
        "no_code": "place no code: open in the inventory's workdir as it is",
    },
)
@_mnft_errors
def shell(c, hosts=None, host=None, gpus=1, wait=None, time=None, idle_stop=None, forward=None, notify=None, image=None, src=None,
          no_code=False):
    """An interactive session on leased GPUs: a terminal on one host (a login shell, or the command after `--`, e.g.
    `-- jupyter lab --no-browser`) in your code as of now (placed as train places a run's: outputs/<session> in the
    workdir), with the environment a run gets first on PATH and CUDA_VISIBLE_DEVICES set to the GPUs it holds. The GPUs are
    its for exactly as long as the session lasts: exit, a closed terminal, a lost controller, --time, --idle-stop or
    `mnft stop SESSION` end every process of it and free them."""
    from mnft.core import durations
    from mnft.run.session import ShellOptions
    from mnft.run.session import shell as open_shell

    options = ShellOptions(gpus=_whole("--gpus", gpus), host=host, wait=_wait(wait),
                           time=durations.parse(time, "--time") if time is not None else None,
                           idle_stop=durations.parse(idle_stop, "--idle-stop") if idle_stop is not None else None,
                           forward=_whole("--forward", forward), argv=tuple(remainder()), notify=_notify(c, notify), image=image,
                           src=src, code=not no_code)
    return open_shell(_inventory(hosts), options, _console())


@task(help={"hosts": HOSTS_HELP, "json": "machine-readable output",
            "connect_timeout": "seconds to wait for each host's SSH connection",
            "usage": "GPU-hours per user and per host, the idle share and the longest waits in line, from the hosts' usage logs",
            "since": "with --usage: how far back (7d, 24h …; default 7d)"})
@_mnft_errors
def lab(c, hosts=None, json=False, connect_timeout=10.0, usage=False, since=None):
    """The lab in one table: every host's devices, free / held by whom (user, run, command, since) / in use outside
    mnft, memory and utilisation, and the runs waiting in line; one round-trip per host. Exit 4 when a host did not answer."""
    import time as clock

    from mnft.hosts.fleet import Fleet
    from mnft.hosts.lab import look
    from mnft.hosts.report import print_lab

    inv = _inventory(hosts)
    if usage or since is not None:
        from mnft.core import durations
        from mnft.hosts import usage as usage_logs
        from mnft.hosts.report import print_usage

        window = durations.parse(since if since is not None else "7d", "--since")
        start = clock.time() - window
        with Fleet(inv, _timeouts(connect_timeout, 30.0)) as fleet:
            read = usage_logs.ask(fleet, inv.hosts, start)
        errors = {h: str(v.get("error") or v.get("refused")) for h, v in read.items() if "lines" not in v}
        summary = usage_logs.summarise({h: v["lines"] for h, v in read.items() if "lines" in v}, start)
        return print_usage(inv, summary, errors, json, window / 86400)
    started = clock.monotonic()
    with Fleet(inv, _timeouts(connect_timeout, 30.0)) as fleet:
        views = look(fleet, inv.hosts)
    return print_lab(inv, views, json, clock.monotonic() - started)


@task(help={"json": "machine-readable output"})
@_mnft_errors
def runs(c, json=False):
    """Your runs, wherever each was started (this directory's runs/ and your index in $MNFT_HOME/runs): id, repo
    (the directory it was started from), job, state, hosts, since; newest first. `status ID`, `logs ID`, `wait ID`
    and `stop ID` find a run by its id from any directory."""
    from mnft.run import records
    from mnft.run.report import print_runs, runs_rows

    return print_runs(runs_rows(records.every_run()), json)


@task(help={"hosts": "the inventory whose lab the board shows: " + HOSTS_HELP,
            "port": "TCP port to serve on (default 8765; 0: a free one, printed)",
            "listen": "address to listen on (default 127.0.0.1: reach it with ssh -L); another one shows the lab to anyone who can reach it",
            "connect_timeout": "seconds to wait for each host's SSH connection"})
@_mnft_errors
def board(c, hosts=None, port=8765, listen="127.0.0.1", connect_timeout=10.0):
    """The lab and its runs in a browser, live and read-only: every device free / held / in use outside mnft and the
    line (as `mnft lab`), every run with its state, step, loss and goodput, a run's loss curve, where its time went,
    its hosts' last lines and its first failure with the fix (docs/board.md). Nothing on the page changes a host."""
    from mnft.board.app import serve
    from mnft.board.state import Board

    console = _console()
    inv = _inventory(hosts)
    return serve(Board(inv, timeouts=_timeouts(connect_timeout, 30.0)), str(listen), int(port),
                 lambda message, style: console.print(message, style=style or None, highlight=False, soft_wrap=True))


def _named_hosts(inventory, names: str, flag: str) -> list[str]:
    """`h1,h2` -> those hosts of the inventory, in its order; one line naming what is not a host of it."""
    from mnft.core.errors import InputError

    wanted = [n.strip() for n in str(names).split(",") if n.strip()]
    known = [h.name for h in inventory.hosts]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise InputError(f"{flag} {names}: {', '.join(unknown) or 'no host'} is not a host of {inventory.path or 'the inventory'} "
                         f"(it has: {', '.join(known)})")
    return [n for n in known if n in wanted]


def _drain(target, reason, hosts, connect_timeout, undrain):
    from mnft.core.errors import ExitCode, InputError
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.lab import drain as set_drain, drain_target
    from mnft.hosts.leases import drained_words, shown

    inv = _inventory(hosts)
    host, gpus = drain_target(inv, target)
    if not undrain and not (reason or "").strip():
        raise InputError(f"drain {target}: --reason TEXT is required (what is wrong, for whoever finds it drained)")
    with Fleet(inv, _timeouts(connect_timeout, 30.0)) as fleet:
        reply = set_drain(fleet, host, gpus, reason, undrain)
    console = _console()
    if reply.get("refused") or reply.get("error"):
        console.print(f"{host.name}: {shown(reply.get('refused') or reply.get('error'), 1000)}", style="red", highlight=False, soft_wrap=True)
        return ExitCode.UNREACHABLE if reply.get("status") in ("unreachable", "host-key-rejected") else ExitCode.FAILED
    marks = reply.get("drained") or {}
    lines = ([f"{host.name}: {drained_words(dict(marks['host'], scope='host'))}"] if marks.get("host") else []) + [
        f"{host.name} GPU {index}: {drained_words(mark)}" for index, mark in sorted((marks.get("gpus") or {}).items())]
    console.print("\n".join(undrain_lines(host.name, gpus, lines) if undrain else lines or [f"{host.name}: in service (nothing drained)"]),
                  highlight=False, soft_wrap=True)
    return ExitCode.OK


def undrain_lines(host: str, gpus, still: list[str]) -> list[str]:
    """What an undrain did first (what is back in service), then what stays drained on the host, if anything."""
    back = f"{host}: back in service" if not gpus else f"{host} GPU {', '.join(str(g) for g in gpus)}: back in service"
    return [back] + ([f"still drained: {line}" for line in still] if still else [f"{host}: nothing else drained"])


@task(klass=OptionalPositionalTask, positional=["target"],
      help={"target": "HOST, or HOST:GPU[,GPU…]: the host or its GPUs (nvidia-smi's indices)", "reason": "why (required): shown to whoever finds it drained",
            "hosts": HOSTS_HELP, "connect_timeout": "seconds to wait for the host's SSH connection"})
@_mnft_errors
def drain(c, target=None, reason=None, hosts=None, connect_timeout=10.0):
    """Take a host or some of its GPUs out of service (root, or a member of the admin group the host names): they are
    never leased; runs holding them go on to their end; `mnft lab`, the board and refusals say who, when and why."""
    return _drain(target, reason, hosts, connect_timeout, False)


@task(klass=OptionalPositionalTask, positional=["target"],
      help={"target": "HOST (every mark of the host), or HOST:GPU[,GPU…]", "hosts": HOSTS_HELP,
            "connect_timeout": "seconds to wait for the host's SSH connection"})
@_mnft_errors
def undrain(c, target=None, hosts=None, connect_timeout=10.0):
    """Put a drained host or GPUs back in service (root, or a member of the admin group the host names)."""
    return _drain(target, None, hosts, connect_timeout, True)


ns = Collection(inventory, check, trust_hosts, train, logs, status, stop, sync, setup, provision, uninstall, lab, board, drain, undrain, shell,
                wait, runs, attach)
