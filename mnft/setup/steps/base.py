"""What every setup step shares: parameters, plans, outcomes, the remote call, and read → plan → apply.

A step module defines `PARAMS` (name -> Param), `TAGS`, `NEEDS_ROOT`, optional `prepare(inventory, params)`
(controller-side checks, before any host is contacted: may raise InputError), and
`run(ctx, params) -> {host: Outcome}` / `undo(ctx, params) -> {host: Outcome}`, built from pure plan functions.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from mnft.hosts import pyrun
from mnft.hosts.command import Command
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory

REMOTE_TIMEOUT = 60.0

# Outcome states, as reported.
OK, CHANGED, FAILED, UNREACHABLE, HOST_KEY_REJECTED, SKIPPED = "ok", "changed", "failed", "unreachable", "host-key-rejected", "skipped"


# ---------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Param:
    kind: str  # "int" | "port" | "number" | "bool" | "str" | "bool_or_str" | "ports" | "strs"
    default: Any
    help: str


def check_value(param: Param, value: Any) -> Any:
    """The value, converted, or raise ValueError with what was expected."""
    kind = param.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "bool_or_str":  # a switch with named settings beyond on/off (the step's validate() names them)
        if isinstance(value, bool):
            return value
        return check_value(Param("str", None, ""), value)
    if kind in ("int", "port"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {value!r}")
        if kind == "port" and not 1 <= value <= 65535:
            raise ValueError(f"{value!r} is not a port number (1-65535)")
        return value
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"expected a positive number of seconds, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str) or not value or "\n" in value or "\x00" in value:
            raise ValueError(f"expected one line of text, got {value!r}")
        return value
    if kind == "ports":
        items = value if isinstance(value, list) else [value]
        return tuple(check_value(Param("port", None, ""), item) for item in items)
    if kind == "cidrs":
        if not isinstance(value, list):
            raise ValueError(f"expected a list of IPv4 addresses or networks, got {value!r}")
        out = []
        for item in value:
            try:
                out.append(str(ipaddress.IPv4Network(str(item), strict=False)))
            except ValueError:
                raise ValueError(f"{item!r} is not an IPv4 address or network") from None
        return tuple(out)
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------- plans and outcomes


@dataclass
class Plan:
    """What one step would change on one host: human-readable changes plus the remote ops that make them."""

    changes: list[str] = field(default_factory=list)
    ops: list[dict] = field(default_factory=list)
    error: str = ""  # the step cannot be applied on this host (nothing is changed): why, and the fix
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # step-specific (e.g. the firewall's revert text)

    @property
    def empty(self) -> bool:
        return not self.changes and not self.error


@dataclass
class Outcome:
    status: str
    changes: list[str] = field(default_factory=list)
    error: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"status": self.status, "changes": self.changes, "error": self.error or None, "notes": self.notes}


def outcome_of(result: HostResult) -> Outcome:
    status = {Status.UNREACHABLE: UNREACHABLE, Status.HOST_KEY_REJECTED: HOST_KEY_REJECTED}.get(result.status, FAILED)
    return Outcome(status, error=result.error or result.tail(1) or "failed")


# ---------------------------------------------------------------------------------------------- become


@dataclass(frozen=True)
class Become:
    """How to get root on one host: "" (already root, or become is off), "nopasswd", or "password"."""

    mode: str = ""
    password: str | None = field(default=None, repr=False)

    def wrap(self, command: Command) -> Command:
        if self.mode == "nopasswd":
            return Command(("sudo", "-n", "sh", "-c", command.render()))
        if self.mode == "password":
            # -k: always ask, so the password line on stdin is consumed by sudo and never reaches the command.
            return Command(("sudo", "-k", "-S", "-p", "", "sh", "-c", command.render()))
        return command

    def stdin_prefix(self) -> bytes:
        return (self.password + "\n").encode() if self.mode == "password" and self.password is not None else b""


# ---------------------------------------------------------------------------------------------- context


@dataclass
class Context:
    fleet: Fleet
    inventory: Inventory
    check: bool = False  # plan only
    become: Mapping[str, Become] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)  # host -> cluster address (filled by the engine)
    ifaces: dict[str, str] = field(default_factory=dict)  # host -> cluster interface, where known
    targets: tuple[Host, ...] | None = None  # the hosts the step runs on (default: every host)

    @property
    def hosts(self) -> tuple[Host, ...]:
        """The hosts the step runs on; peers are always every host of the inventory (`inventory.hosts`)."""
        return self.inventory.hosts if self.targets is None else self.targets

    def remote(self, host: Host, ops: Sequence[dict], *, root: bool = False, timeout: float = REMOTE_TIMEOUT) -> tuple[list[dict] | None, Outcome | None]:
        """Run ops on the host in one round-trip: (results, None), or (None, Outcome) when the call itself failed."""
        command = pyrun.command(host, site=False)  # the host side is standard library only
        become = self.become.get(host.name, Become()) if root else Become()
        stdin = become.stdin_prefix() + pyrun.payload("setuphost") + (json.dumps({"ops": list(ops)}) + "\n").encode()
        result = self.fleet.run_one(host, become.wrap(command), stdin=stdin, timeout=timeout)
        if not result.ok:
            return None, outcome_of(result)
        try:
            results = pyrun.last_json(result.stdout)["results"]
        except (ValueError, IndexError, KeyError, TypeError):
            return None, Outcome(FAILED, error="the host printed no result: " + (result.tail(1) or "no output"))
        return results, None

    def map(self, fn: Callable[[Host], Any], hosts: Sequence[Host] | None = None) -> dict[str, Any]:
        """fn on every host in parallel; host name -> return value (fn must not raise for expected failures)."""
        return dict(self.fleet.map(fn, list(self.hosts if hosts is None else hosts)).by_host)


def first_error(results: Sequence[dict]) -> str | None:
    for r in results:
        if "error" in r:
            return r["error"]
    return None


def read_ops(ctx: Context, host: Host, ops: Sequence[dict], *, root: bool = False) -> tuple[list[dict] | None, Outcome | None]:
    """A step's facts in one round-trip: (results, None), or (None, the failed Outcome) when the call or an op failed."""
    results, failure = ctx.remote(host, ops, root=root)
    if failure:
        return None, failure
    error = first_error(results)
    if error:
        return None, Outcome(FAILED, error=error)
    return results, None


# ---------------------------------------------------------------------------------------------- read -> plan -> apply


Reader = Callable[[Context, Host], "tuple[dict | None, Outcome | None]"]
Planner = Callable[[dict[str, dict]], dict[str, Plan]]


def read_all(ctx: Context, reader: Reader) -> tuple[dict[str, dict], dict[str, Outcome]]:
    """(facts of the hosts read, outcomes of the hosts that could not be read)."""
    got = ctx.map(lambda h: reader(ctx, h))
    facts = {name: f for name, (f, o) in got.items() if o is None}
    failed = {name: o for name, (f, o) in got.items() if o is not None}
    return facts, failed


def apply_plans(ctx: Context, plans: Mapping[str, Plan], *, root: bool, applier: Callable[[Context, Host, Plan], Outcome] | None = None) -> dict[str, Outcome]:
    """Run each host's plan (or only report it under --check): ok / changed / failed per host."""

    def one(host: Host) -> Outcome:
        plan = plans[host.name]
        if plan.error:
            return Outcome(FAILED, plan.changes, plan.error, plan.notes)
        if not plan.changes:
            return Outcome(OK, notes=plan.notes)
        if ctx.check:
            return Outcome(CHANGED, plan.changes, notes=plan.notes)
        if applier is not None:
            return applier(ctx, host, plan)
        results, failure = ctx.remote(host, plan.ops, root=root)
        if failure is not None:
            failure.changes = plan.changes
            return failure
        error = first_error(results)
        if error:
            return Outcome(FAILED, plan.changes, error, plan.notes)
        return Outcome(CHANGED, plan.changes, notes=plan.notes)

    hosts = [h for h in ctx.hosts if h.name in plans]
    return ctx.map(one, hosts)


def standard(ctx: Context, reader: Reader, planner: Planner, *, root: bool, applier=None) -> dict[str, Outcome]:
    facts, failed = read_all(ctx, reader)
    plans = planner(facts) if facts else {}
    outcomes = apply_plans(ctx, plans, root=root, applier=applier)
    return {h.name: failed.get(h.name) or outcomes.get(h.name) or Outcome(FAILED, error="not planned") for h in ctx.hosts}


def write_op(path: str, text: str, *, mode: int | None = None, dir_mode: int | None = None, expect: str | None | bool = False) -> dict:
    """A `write` op; `expect` is the sha256 the file had when read (None: it did not exist; False: unchecked)."""
    op = {"op": "write", "path": path, "text": text}
    if mode is not None:
        op["mode"] = mode
    if dir_mode is not None:
        op["dir_mode"] = dir_mode
    if expect is not False:
        op["expect_sha256"] = expect
    return op
