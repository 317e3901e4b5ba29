"""Step `hosts_file`: every node resolves every node's name to its cluster address, from /etc/hosts.

A marked block (`# BEGIN mnft cluster hosts` … `# END mnft cluster hosts`) with one `<address>\t<name>` line per
node (a node not reached this run whose address is unknown keeps its line). It is replaced where it is; a new block goes before the first line someone else wrote that names a node
(Debian's `127.0.1.1 <hostname>`: the resolver takes the first match, and gloo/NCCL would otherwise bind or
connect to 127.0.1.1), else at the end. Lines outside the block are kept byte for byte. The file is replaced
atomically; a bind-mounted /etc/hosts (containers) is rewritten in place. Needs root (become).
"""

from __future__ import annotations

import ipaddress

from mnft.hosts.settings import Host
from mnft.setup.steps import blocks
from mnft.setup.steps.base import FAILED, Context, Outcome, Param, Plan, first_error, standard, write_op

TAGS = ("names",)
NEEDS_ROOT = True
PARAMS = {
    "path": Param("str", "/etc/hosts", "the hosts file to edit"),
}

BLOCK = blocks.Block("# BEGIN mnft cluster hosts (managed by mnft setup; remove with: invoke setup --undo)", "# END mnft cluster hosts")


def block_lines(names: dict[str, str | None], old_body: list[str] | None = None) -> list[str]:
    """name -> address, in inventory order; a name whose address is unknown this run (None: not reached) keeps
    its line from the old block, if it had one."""
    old = {}
    for line in old_body or []:
        words = line.split()
        if len(words) >= 2:
            old.setdefault(words[1], line)
    return [f"{address}\t{name}" if address else old[name] for name, address in names.items() if address or name in old]


def _names_in(line: str) -> list[str]:
    words = line.split("#", 1)[0].split()
    return words[1:] if len(words) >= 2 else []


def conflicts(text: str, names: dict[str, str]) -> list[str]:
    """Lines outside mnft's block mapping a node's name to another address (kept; reported)."""
    lines = blocks.split_lines(text)
    try:
        span = BLOCK.find(lines)
    except ValueError:
        span = None
    out = []
    for i, line in enumerate(lines):
        if span and span[0] <= i <= span[1]:
            continue
        words = line.split("#", 1)[0].split()
        for name in _names_in(line):
            if names.get(name) and words[0] != names[name]:
                out.append(f"line {i + 1} maps {name} to {words[0]} (kept; mnft's block comes first)")
    return out


def plan_host(current: dict, names: dict[str, str | None], path: str) -> Plan:
    if not current.get("exists"):
        return Plan(error=f"{path} does not exist")
    text = current["text"]
    try:
        lines = block_lines(names, BLOCK.body(text))
        new = blocks.set_block(text, BLOCK, lines, insert_before=lambda line: any(n in names for n in _names_in(line)))
    except ValueError as exc:
        return Plan(error=f"{path}: {exc}")
    plan = Plan(notes=conflicts(new, names))
    if new != text:
        plan.changes.append(f"write the cluster's {len(lines)} names into {path}")
        plan.ops.append(write_op(path, new, expect=current["sha256"]))
    return plan


def plan_undo(current: dict, path: str) -> Plan:
    if not current.get("exists"):
        return Plan()
    try:
        new = blocks.remove_block(current["text"], BLOCK)
    except ValueError as exc:
        return Plan(error=f"{path}: {exc}")
    if new == current["text"]:
        return Plan()
    return Plan([f"remove mnft's block from {path}"], [write_op(path, new, expect=current["sha256"])])


def check_names(names: dict[str, str]) -> str | None:
    for name, address in names.items():
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            return f"no cluster address for {name}"
    return None


def _reader(path: str):
    def read(ctx: Context, host: Host):
        results, failure = ctx.remote(host, [{"op": "read", "path": path}], root=True)
        if failure:
            return None, failure
        error = first_error(results)
        return (None, Outcome(FAILED, error=error)) if error else (results[0], None)

    return read


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    names = {h.name: ctx.addresses.get(h.name) for h in ctx.inventory.hosts}
    return standard(ctx, _reader(params["path"]), lambda facts: {n: plan_host(f, names, params["path"]) for n, f in facts.items()}, root=True)


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, _reader(params["path"]), lambda facts: {n: plan_undo(f, params["path"]) for n, f in facts.items()}, root=True)
