"""mnft's command line: thin Invoke tasks that parse arguments, call mnft, and map errors to exit codes.

Run `invoke --list` for the tasks and `invoke --help TASK` for each one's options.
"""

from __future__ import annotations

from functools import wraps
from pathlib import Path

from invoke import Collection, Exit, task

from mnft.cli import OptionalPositionalTask

HERE = Path(__file__).resolve().parent
DEFAULT_INVENTORY = HERE / "inventory" / "local.yaml"


def _mnft_errors(fn):
    """Expected errors become one line and their exit code; a bug keeps its traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        from mnft.errors import ExitCode, MnftError

        try:
            code = fn(*args, **kwargs)
        except MnftError as exc:
            raise Exit(f"mnft: {exc}", code=int(exc.exit_code)) from None
        except KeyboardInterrupt:
            raise Exit("mnft: interrupted", code=int(ExitCode.INTERRUPTED)) from None
        if code:
            raise Exit(code=int(code))

    return wrapper


def _inventory(hosts: str | None):
    from mnft import inventory

    return inventory.load(hosts or DEFAULT_INVENTORY)


def _timeouts(connect_timeout: float, timeout: float):
    from mnft.connection import Timeouts

    return Timeouts(connect=connect_timeout, command=timeout)


@task(help={"hosts": "inventory file (mnft YAML, Ansible YAML or hostfile); default: inventory/local.yaml", "json": "machine-readable output"})
@_mnft_errors
def inventory(c, hosts=None, json=False):
    """Print the effective per-host settings: what each host will actually use."""
    from mnft.report import print_inventory

    print_inventory(_inventory(hosts), json)


@task(
    help={
        "hosts": "inventory file; default: inventory/local.yaml",
        "json": "machine-readable output (per host: outcome, facts, problems)",
        "port": "rendezvous port to test (default: the inventory's, 29500)",
        "min_free_gb": "free disk floor at each host's workdir, GiB",
        "max_clock_skew": "largest clock difference to the master, seconds",
        "no_network": "skip the rendezvous port test",
        "connect_timeout": "seconds to wait for each SSH connection",
        "timeout": "seconds each remote command may take",
    }
)
@_mnft_errors
def check(c, hosts=None, json=False, port=0, min_free_gb=2.0, max_clock_skew=2.0, no_network=False, connect_timeout=10.0, timeout=60.0):
    """Prove every host can join one training job: same Python/torch/CUDA/NCCL/driver, disk, rsync, interface, port, clock.

    Exit codes: 0 every host ok, 1 some host failed a check, 2 bad input, 4 some host unreachable or its key rejected.
    """
    from mnft.check import CheckOptions, gather
    from mnft.fleet import Fleet
    from mnft.report import print_check

    inv = _inventory(hosts)
    options = CheckOptions(min_free_gb=float(min_free_gb), max_clock_skew_s=float(max_clock_skew), port=int(port) or None, network=not no_network)
    with Fleet(inv, _timeouts(connect_timeout, timeout)) as fleet:
        report = gather(fleet, options)
    print_check(report, json)
    return report.exit_code()


@task(
    name="trust-hosts",
    help={
        "hosts": "inventory file",
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
    from mnft.errors import ExitCode
    from mnft.report import print_trust
    from mnft.trust import trust_hosts as trust

    results = trust(_inventory(hosts), _timeouts(connect_timeout, 30.0), dry_run=dry_run)
    print_trust(results, json)
    if any(r.state in ("unreachable", "changed", "other-type") for r in results):
        return ExitCode.UNREACHABLE
    return ExitCode.OK


def _console():
    from mnft.report import console

    return console()


def _record_fleet(run, hosts):
    """The run record and a fleet over its inventory snapshot (or --hosts when given)."""
    from mnft import runs
    from mnft.errors import InputError
    from mnft.fleet import Fleet
    from mnft.train import from_snapshot, launched

    record = runs.load(run, launched)
    if not launched(record.data):
        raise InputError(f"{record.path}: run {record.run_id} never started on the hosts ({record.data.get('state')}: {record.data.get('reason')})")
    inv = _inventory(hosts) if hosts else from_snapshot(record.data["inventory"])
    return record, Fleet(inv)


@task(
    iterable=["set", "env", "env_file"],
    help={
        "recipe": "lora or full",
        "hosts": "inventory file; default: inventory/local.yaml (this machine)",
        "set": "recipe override key=value (repeat)",
        "env": "environment for the run: NAME (value from here) or NAME=VALUE (repeat); secret names (TOKEN/KEY/SECRET/PASSWORD) only as NAME",
        "env_file": "NAME=VALUE lines for the run, file mode 0600 (repeat): the way to pass secrets not in this environment",
        "rdzv": "static (node_rank from the inventory) or c10d",
        "detach": "start, print the run id and return; the run goes on",
        "resume": "continue the latest run (or --resume-run ID) from its latest complete checkpoint",
        "resume_run": "the run to continue",
        "force": "launch even if the check finds problems",
        "dry_run": "print every host's exact command and environment (secrets redacted); start nothing",
        "no_sync": "do not sync the code first",
        "src": "the tree to sync (default: the top of the git repository around the current directory)",
        "port": "rendezvous port (default: the inventory's; the next free one on the master if taken)",
    },
)
@_mnft_errors
def train(c, recipe="lora", hosts=None, set=None, env=None, env_file=None, rdzv="static", detach=False, resume=False, resume_run=None,
          force=False, dry_run=False, no_sync=False, src=None, port=0):
    """torchrun on every host in parallel with the right node_rank, supervised as one gang."""
    from mnft.check import CheckOptions
    from mnft.launch import LaunchOptions
    from mnft.train import TrainOptions, train as run_train

    overrides, envs, env_files = tuple(set or ()), tuple(env or ()), tuple(env_file or ())
    if resume or resume_run:  # the previous run's hosts file, overrides and env names, unless given again
        from mnft.train import previous_run, reuse_previous

        reused = reuse_previous(previous_run(resume_run).data, hosts=hosts, overrides=overrides, env=envs, env_files=env_files)
        hosts, overrides, envs, env_files, resume_run = reused.hosts, reused.overrides, reused.env, reused.env_files, reused.run_id
        _console().print(f"resuming run {reused.run_id}" + (": reusing " + " ".join(reused.notes) if reused.notes else ""), highlight=False, soft_wrap=True)
    options = TrainOptions(
        launch=LaunchOptions(recipe=recipe, overrides=overrides, rdzv=rdzv, env=envs, env_files=env_files, detach=detach, resume=resume),
        check=CheckOptions(port=int(port) or None),
        force=force,
        src=Path(src) if src else None,
        sync=not no_sync,
        dry_run=dry_run,
        resume_run=resume_run,
    )
    return run_train(_inventory(hosts), options, _console())


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "follow": "keep printing new lines until the run ends", "lines": "lines per host", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def logs(c, run=None, follow=False, lines=20, hosts=None):
    """Collect every host's logs and metrics into runs/<id>/<host>/, write loss.png, print a merged tail."""
    from mnft.train import collect, follow as follow_logs, merged_tail

    record, fleet = _record_fleet(run, hosts)
    with fleet:
        if follow:
            return follow_logs(record, fleet, _console())
        collect(record, fleet, _console())
    merged_tail(record, int(lines), _console())


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "json": "machine-readable output", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def status(c, run=None, json=False, hosts=None):
    """A table per host: running / exited with code / unreachable, step, loss, since. Exit 0 only when healthy."""
    from mnft.report import print_status
    from mnft.train import status as run_status

    record, fleet = _record_fleet(run, hosts)
    with fleet:
        states = run_status(record, fleet)
    return print_status(record, states, json)


@task(klass=OptionalPositionalTask, positional=["run"], help={"run": "run id (default: the latest)", "grace": "seconds between SIGTERM and SIGKILL", "json": "machine-readable output", "hosts": "inventory (default: the run's)"})
@_mnft_errors
def stop(c, run=None, grace=10.0, json=False, hosts=None):
    """Kill exactly that run's process groups on every host (by recorded group and run id), verify none remain."""
    from mnft.report import print_stop
    from mnft.train import stop as run_stop

    record, fleet = _record_fleet(run, hosts)
    with fleet:
        result = run_stop(record, fleet, float(grace))
    code = print_stop(record, result, json)
    from mnft.train import gpu_verdict

    return gpu_verdict(result, code, None if json else _console())


@task(
    iterable=["exclude"],
    help={
        "hosts": "inventory file; default: inventory/local.yaml",
        "src": "the tree to copy (default: the top of the git repository around the current directory)",
        "data": "copy this data directory to every host's data_dir instead of the code (shared_fs hosts: once)",
        "exclude": "one more rsync exclude pattern (repeat); also invoke.yaml's sync.exclude list",
        "dry_run": "list what would change per host; copy nothing",
        "no_delete": "keep files that exist only on the hosts",
        "json": "machine-readable output (per host: status, files, bytes, hash)",
        "workers": "rsyncs at once",
        "timeout": "with --data: seconds each host's rsync may take in all (default 3600)",
    },
)
@_mnft_errors
def sync(c, hosts=None, src=None, data=None, exclude=None, dry_run=False, no_delete=False, json=False, workers=16, timeout=3600.0):
    """Copy the code (or --data) to every host in parallel and prove each copy by its tree hash.

    Exit codes: 0 every host identical, 1 a host failed or differs (the files are named), 2 bad input or a
    refused target, found before the sync or by a host's probe (nothing touched there), 4 a host unreachable or
    its key rejected. --dry-run lists per host what would be sent and deleted (--no-delete: nothing deleted).
    """
    from mnft.sync import print_sync, sync_code, sync_data

    options = dict(progress=not json, delete=not no_delete, dry_run=dry_run, extra_excludes=list(exclude or []), workers=int(workers),
                   config=c.config)  # sync.exclude from the config is added by mnft.sync, as for check and train
    inv = _inventory(hosts)
    if data:
        report = sync_data(inv, Path(data), timeout=float(timeout), **options)
    else:
        report = sync_code(inv, Path(src) if src else None, **options)
    print_sync(report, json)
    return report.exit_code()


@task(
    iterable=["only"],
    help={
        "hosts": "inventory file; default: inventory/local.yaml",
        "playbook": "the playbook (default: playbooks/setup.yaml)",
        "check": "print what each step would change on each host; change nothing",
        "only": "run only this step (step, step name or tag: trust, names, firewall, ports); repeat or comma-separate",
        "undo": "remove exactly what mnft's steps added (in reverse order)",
        "json": "machine-readable output (per host and step: status, changes, error)",
        "connect_timeout": "seconds to wait for each SSH connection",
        "timeout": "seconds each remote call may take",
    },
)
@_mnft_errors
def setup(c, hosts=None, playbook=None, check=False, only=None, undo=False, json=False, connect_timeout=10.0, timeout=120.0):
    """Prepare the hosts for multi-node jobs: controller key, node-to-node SSH mesh, /etc/hosts, peers-only firewall.

    Idempotent: a second run reports 0 changed. Exit codes: 0 ok, 1 a step failed on some host, 2 bad playbook or
    inventory (nothing applied anywhere), 4 some host unreachable or its key rejected.
    """
    from mnft import playbook as pb

    book = pb.load(playbook or pb.DEFAULT_PLAYBOOK)
    chosen = [w for item in (only or []) for w in item.split(",")]
    report = pb.run(_inventory(hosts), book, check=check, undo=undo, only=chosen or None, timeouts=_timeouts(connect_timeout, timeout))
    pb.print_report(report, json)
    return report.exit_code()


ns = Collection(inventory, check, trust_hosts, train, logs, status, stop, sync, setup)
