"""What provision does on each host, pure: the host's facts and the lock in, a `HostPlan` out (nothing to do,
build a new environment with what it installs, upgrades and removes, refused with the reason, or skipped); hosts
that see one environment directory (a shared home) get one build or rollback, which the others verify."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from mnft.env import lockfile
from mnft.env.diff import Changes, EnvDiff, against_lock
from mnft.env.lockfile import Lock, Pin
from mnft.env.wheelhouse import Platform, Wheel
from mnft.hosts.fleet import HostResult
from mnft.hosts.settings import Host

DISK_MARGIN = 64 * 1024**2  # bytes kept free beyond what the copy and the unpacked environment take


@dataclass
class HostPlan:
    host: str
    action: str  # none | install | rollback | verify (a host of the group that shares it builds it) | refuse | skip
    reason: str = ""
    python: str | None = None  # the base interpreter the environment is built from
    python_version: str | None = None  # its full version
    platform: Platform | None = None
    pins: tuple[Pin, ...] = ()
    diff: EnvDiff = field(default_factory=EnvDiff)  # the environment now against the lock
    changes: Changes = field(default_factory=Changes)
    builder: str | None = None  # verify: the host of the group that installs or rolls back for it


def choose_python(facts: Mapping[str, Any], minor: str) -> dict | None:
    """The first Python of the wanted X.Y (CPython) the host has: the inventory's first, then pythonX.Y."""
    for candidate in facts.get("pythons") or []:
        if candidate.get("found") and candidate.get("implementation") == "cpython" and str(candidate.get("version", "")).startswith(minor + "."):
            return candidate
    return None


def env_state(facts: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(Python version, installed name -> version) of the host's current environment (none: (None, {}))."""
    env = facts.get("env") or {}
    if not env.get("exists") or env.get("dists") is None:
        return None, {}
    return env.get("python"), dict(env["dists"])


def plan_host(host: Host, outcome: HostResult | None, facts: Mapping[str, Any] | None, lock: Lock, minor: str) -> HostPlan:
    """What provisioning does on one host. Pure: its facts and the lock in, an action out."""
    if facts is None:
        return HostPlan(host.name, "skip", (outcome.error if outcome is not None else "") or "no facts")
    if host.venv is None:
        return HostPlan(host.name, "refuse", f"host {host.name}: 'venv' is none in the inventory: it is not provisioned")
    env = facts.get("env") or {}
    if env.get("exists") and not env.get("managed"):
        return HostPlan(host.name, "refuse", f"host {host.name}: {env.get('path')} exists and is not an environment mnft made: "
                                             "move it away or set 'venv' in the inventory to another path")
    chosen = choose_python(facts, minor)
    if chosen is None:
        tried = ", ".join(f"{c.get('name')} ({c.get('version') or 'not found'})" for c in facts.get("pythons") or [])
        return HostPlan(host.name, "refuse", f"host {host.name} has no Python {minor} (tried: {tried}): install python{minor} there "
                                             f"or set 'python' in the inventory to one")
    plat = Platform(minor, facts.get("arch") or "", (facts.get("libc") or {}).get("libc"), (facts.get("libc") or {}).get("version"))
    pins = lock.pins_for(lockfile.marker_environment(chosen["version"], plat.arch))
    env_python, installed = env_state(facts)
    diff = against_lock(installed, pins)
    if env_python and ".".join(env_python.split(".")[:2]) != minor:
        diff = replace(diff, python=(".".join(env_python.split(".")[:2]), minor))
    base = HostPlan(host.name, "none", python=chosen["path"], python_version=chosen["version"], platform=plat, pins=pins, diff=diff,
                    changes=Changes.of(diff))
    if env.get("exists") and env.get("complete") and diff.empty:
        base.reason = "matches the lock"
        return base
    base.action = "install"
    base.reason = "no environment yet" if not env.get("exists") else ("incomplete environment" if not env.get("complete") else "differs from the lock")
    return base


def plan_rollback(host: Host, outcome: HostResult | None, facts: Mapping[str, Any] | None) -> HostPlan:
    if facts is None:
        return HostPlan(host.name, "skip", (outcome.error if outcome is not None else "") or "no facts")
    previous = facts.get("previous") or {}
    if not previous.get("complete"):
        return HostPlan(host.name, "refuse", f"host {host.name}: no previous environment to roll back to")
    return HostPlan(host.name, "rollback", f"back to {os.path.basename(previous.get('target') or '')}")


def disk_needed(wheels: Mapping[str, Wheel], held: Mapping[str, int], uv_size: int, uv_held: bool) -> int:
    """Bytes a host needs free: the wheels it does not hold yet, uv, and the unpacked environment."""
    sending = sum(w.size for w in wheels.values() if held.get(w.file) != w.size) + (0 if uv_held else uv_size)
    return sending + sum(w.unpacked for w in wheels.values()) + DISK_MARGIN


# What an environment directory is bound to: a venv's interpreter is a link to one base Python, and its compiled
# wheels were chosen for one OS, libc and CPU architecture. Hosts that share the directory must agree on all of it.
BOUND_TO = ("OS", "libc", "architecture", "base Python")
DONE = {"install": "built", "rollback": "rolled back"}


def bound_to(facts: Mapping[str, Any], plan: HostPlan) -> dict[str, str]:
    """The values of BOUND_TO on one host, from its facts (the base Python from its plan, when it chose one)."""
    libc = facts.get("libc") or {}
    values = {
        "OS": " ".join(str(v) for v in (facts.get("system"), facts.get("os")) if v) or "unknown",
        "libc": " ".join(str(v) for v in (libc.get("libc"), libc.get("version")) if v) or "unknown",
        "architecture": str(facts.get("arch") or "unknown"),
    }
    if plan.python:
        values["base Python"] = f"{plan.python} ({plan.python_version})"
    return values


def differences(members: list[str], facts: Mapping[str, Mapping[str, Any]], plans: Mapping[str, HostPlan]) -> list[str]:
    """Pure: for each value of BOUND_TO the hosts disagree on, 'libc: glibc 2.36 on h1, h2; glibc 2.31 on h3'."""
    values = {name: bound_to(facts.get(name) or {}, plans[name]) for name in members}
    out = []
    for what in BOUND_TO:
        hosts_by_value: dict[str, list[str]] = {}
        for name in members:
            if what in values[name]:
                hosts_by_value.setdefault(values[name][what], []).append(name)
        if len(hosts_by_value) > 1:
            out.append(f"{what}: " + "; ".join(f"{value} on {', '.join(names)}" for value, names in hosts_by_value.items()))
    return out


def plan_shared(plans: Mapping[str, HostPlan], facts: Mapping[str, Mapping[str, Any]], groups: Mapping[str, tuple[str, ...]],
                where: Mapping[str, str]) -> dict[str, HostPlan]:
    """Pure: per-host plans and the groups of hosts that see one environment directory (mnft.sync.mirror's
    detection: host -> its group, in inventory order) in; the plans of a shared environment out. The group's first
    host with a build (or rollback) to do does it once; the others of the group verify it afterwards from their own
    side. When the group's hosts differ in what an environment is bound to (OS, libc, architecture, base Python),
    the first of them is refused, naming the hosts and values: one build cannot serve them all."""
    out = dict(plans)
    for members in dict.fromkeys(groups.values()):  # each group once, in order
        acting = [name for name in members if plans[name].action in ("install", "rollback")]
        if not acting:
            continue
        present = [name for name in members if plans[name].action not in ("skip", "refuse")]
        different = differences(present, facts, plans)
        if different:
            first = present[0]
            out[first] = HostPlan(first, "refuse", f"hosts {', '.join(present)} share one environment directory ({where[first]}) but differ in "
                                                   + "; and in ".join(different) + ": an environment is built for one platform, so give "
                                                   "them different 'venv' paths in the inventory (or make the hosts alike)")
            continue
        builder = acting[0]
        for name in present:
            if name != builder:
                out[name] = replace(plans[name], action="verify", builder=builder,
                                    reason=f"shares {where[name]} with {builder}: {DONE[plans[builder].action]} once there, verified here")
    return out
