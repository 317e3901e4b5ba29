"""mnft's command line: thin Invoke tasks that parse arguments, call mnft, and map errors to exit codes.

Run `invoke --list` for the tasks and `invoke --help TASK` for each one's options.
"""

from __future__ import annotations

from functools import wraps
from pathlib import Path

from invoke import Collection, Exit, task

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
    if any(r.state == "unreachable" for r in results) or any(r.state == "changed" for r in results):
        return ExitCode.UNREACHABLE
    return ExitCode.OK


ns = Collection(inventory, check, trust_hosts)
