"""A run started again from its record: the inventory snapshot a run keeps (so `status`, `stop` and `logs` of an
old run reach the hosts it ran on), and `--resume`'s choice of the run it continues and of the settings it reuses."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.output import command
from mnft.hosts.settings import HOST_KEYS, Inventory, port_number, validate_host
from mnft.run import records
from mnft.run.control import job_of
from mnft.run.job import Job, parse_overrides, resumable


def snapshot(inventory: Inventory) -> dict[str, Any]:
    return {
        "path": str(inventory.path) if inventory.path else None,
        "format": inventory.format,
        "master": inventory.master_name,
        "known_hosts": str(inventory.known_hosts) if inventory.known_hosts else None,
        "rendezvous_port": inventory.rendezvous_port,
        "hosts": [h.settings() for h in inventory.hosts],
    }


def from_snapshot(data: Any, where: str = "run.json") -> Inventory:
    """The inventory a run recorded, validated again as an inventory is (its values reach ssh and the hosts'
    commands: a damaged or edited record is one line, never a traceback or an unchecked value)."""
    try:
        hosts = []
        for rank, h in enumerate(data["hosts"]):
            settings = {key: h.get(key) for key in HOST_KEYS}
            settings["venv"] = "none" if settings["venv"] is None else settings["venv"]
            base = h.get("base_python")
            if base is not None and (not isinstance(base, str) or not base or any(ord(c) < 32 or ord(c) == 127 for c in base)):
                raise ValueError("base_python")
            host = validate_host(h["name"], rank, settings, {}, f"{where}: inventory")
            hosts.append(replace(host, base_python=base))
        if len(hosts) > limits.HOSTS:
            raise InputError(f"{where}: inventory: more than {limits.HOSTS} hosts")
        names = [h.name for h in hosts]
        if not hosts or data["master"] not in names:
            raise ValueError("no host, or a master that is not one of them")
        return Inventory(
            Path(data["path"]) if data.get("path") else None,
            str(data["format"]),
            tuple(hosts),
            data["master"],
            Path(data["known_hosts"]) if data.get("known_hosts") else None,
            port_number(data["rendezvous_port"], where, "inventory", "rendezvous_port"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{where}: the run's inventory snapshot is damaged ({type(exc).__name__}): pass --hosts FILE") from None


def launched(data: dict) -> bool:
    """A record of a run that was started on the hosts (not one refused by the check or stopped by sync)."""
    return bool(data.get("launched", data.get("state") in ("running", "succeeded", "failed", "stopped", "resumable")))


@dataclass(frozen=True)
class Reuse:
    run_id: str
    hosts: str | None
    job: Job
    env: tuple[str, ...]
    env_files: tuple[str, ...]
    notes: tuple[str, ...]
    src: str | None = None  # the tree the previous run's code came from (--src not given again: the same repository, as it is now)


NOT_REUSED = frozenset({"overwrite", "resume"})  # they decide how a run starts, and a resume starts from its checkpoint


def reuse_previous(previous: dict, *, hosts: str | None, overrides: tuple[str, ...], env: tuple[str, ...],
                   env_files: tuple[str, ...], src: str | None = None) -> Reuse:
    """--resume: the previous run's job, hosts file and env names, unless given again (explicit flags win; a
    recipe's overrides merge by key). Pure: the previous run.json's data in, the values to use and what was
    reused out."""
    notes = []
    if hosts is None and (previous.get("inventory") or {}).get("path"):
        hosts = previous["inventory"]["path"]
        notes.append(f"--hosts {hosts}")
    job = job_of(previous)
    if job.recipe:
        explicit = {o.partition("=")[0] for o in parse_overrides(overrides)} | NOT_REUSED
        kept = tuple(o for o in job.extra_args if o.partition("=")[0] not in explicit)
        if kept:
            notes.append("--set " + " --set ".join(kept))
        dropped = [o for o in job.extra_args if o.partition("=")[0] in NOT_REUSED]
        job = replace(job, extra_args=kept + tuple(overrides))
    else:
        if overrides:
            raise InputError("--set is for mnft's recipes: a script's arguments are recorded with its run")
        notes.append(f"the job {job.label}" + (" " + " ".join(job.extra_args) if job.extra_args else ""))
    named = {e.partition("=")[0] for e in env}
    kept_env = tuple(e for e in previous.get("env_specs") or () if e.partition("=")[0] not in named)
    if kept_env:
        notes.append("--env " + " --env ".join(kept_env))
    kept_files = tuple(f for f in previous.get("env_files") or () if f not in env_files)
    if kept_files:
        notes.append("--env-file " + " --env-file ".join(kept_files))
    if job.recipe and dropped:
        notes.append("(not " + " ".join(dropped) + ": a resume continues from the latest checkpoint)")
    recorded = ((previous.get("code") or {}).get("src") or (previous.get("sync") or {}).get("src")) if src is None else None
    if recorded:
        notes.append(f"--src {recorded} (as it is now)")
    return Reuse(previous["run_id"], hosts, job, kept_env + tuple(env), kept_files + tuple(env_files), tuple(notes), recorded or src)


def previous_run(run_id: str | None) -> records.RunRecord:
    """The run --resume continues: that one, or the latest that was started on the hosts."""
    return records.load(run_id) if run_id else records.load(None, launched)


def resume_hint(run_id: str, job: Job) -> str:
    """What to run to continue a run that was stopped, idle-stopped or interrupted: a command that works. A job
    with no resume rule is not told `--resume-run ID` (refused: it would start again at step 1) but how to give it
    one when it is resumed."""
    if resumable(job):
        return f"continue it with `{command(f'train --resume-run {run_id}')}`"
    return (f"{job.label} has no resume rule: to continue it, give one in a job file (`resume:`, docs/jobs.md) and run "
            f"`{command(f'train --resume-run {run_id} --job FILE')}`")


def with_rule_of(job: Job, rule_job: Job, where: str) -> Job:
    """--resume-run ID --job FILE: the recorded run's job, with FILE's resume rule (everything else as recorded)."""
    if not resumable(rule_job):
        raise InputError(f"{where}: no resume rule (resume: …) to continue the run with; see docs/jobs.md#resume")
    return replace(job, resume=rule_job.resume)
