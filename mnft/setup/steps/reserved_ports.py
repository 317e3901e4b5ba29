"""Step `reserved_ports` (optional): keep the rendezvous port(s) out of the kernel's ephemeral port range.

A port in `net.ipv4.ip_local_port_range` can be taken by any outgoing connection (an NCCL socket, a pip
download) just before torchrun binds it. `net.ipv4.ip_local_reserved_ports` excludes ports from that choice.
mnft adds its ports to the current value (the value's other ports are kept) and records the ports it added in
/run/mnft/reserved_ports (runtime state, gone at reboot like the runtime value). Only with `persist: true`
(default false: nothing in /etc changes) it also writes /etc/sysctl.d/90-mnft-reserved-ports.conf, which names
the ports mnft added in a comment, so an undo after a reboot (no /run record) still removes only those.
Undo removes only the ports mnft added. Needs root.
"""

from __future__ import annotations

from mnft.hosts.settings import Host
from mnft.setup.steps.base import FAILED, Context, Outcome, Param, Plan, read_ops, standard, write_op

TAGS = ("ports",)
NEEDS_ROOT = True
PARAMS = {
    "ports": Param("ports", None, "ports to reserve (default: the inventory's rendezvous_port)"),
    "persist": Param("bool", False, "also write /etc/sysctl.d/90-mnft-reserved-ports.conf (survives reboots)"),
}

SYSCTL = "/proc/sys/net/ipv4/ip_local_reserved_ports"
RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
RECORD = "/run/mnft/reserved_ports"
PERSIST = "/etc/sysctl.d/90-mnft-reserved-ports.conf"
ADDED = "# ports added by mnft:"


def parse_ports(text: str) -> set[int]:
    """`8080,29500-29502` -> {8080, 29500, 29501, 29502}."""
    out: set[int] = set()
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def render_ports(ports: set[int]) -> str:
    """Sorted, consecutive ports folded into ranges: {1, 2, 3, 7} -> `1-3,7`."""
    items = sorted(ports)
    parts, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def persisted_ports(text: str | None) -> set[int] | None:
    """The ports in mnft's sysctl.d file, or None when there is no (readable) file."""
    if text is None:
        return None
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "net.ipv4.ip_local_reserved_ports":
            try:
                return parse_ports(value)
            except ValueError:
                return None
    return None


def persisted_mnft_ports(text: str | None) -> set[int] | None:
    """The ports mnft added, as its sysctl.d file names them (`# ports added by mnft: …`), or None."""
    for line in (text or "").splitlines():
        if line.startswith(ADDED):
            try:
                return parse_ports(line[len(ADDED):])
            except ValueError:
                return None
    return None


def mnft_ports(facts: dict) -> set[int]:
    """The ports mnft added: its /run record, else (after a reboot) what its sysctl.d file names."""
    if facts["record"] is not None:
        return parse_ports(facts["record"])
    return persisted_mnft_ports(facts["persisted"]) or set()


def persisted_text(wanted: set[int], added: set[int]) -> str:
    return ("# written by mnft setup (reserved ports: the value when applied); remove with invoke setup --undo\n"
            f"{ADDED} {render_ports(added)}\n"
            f"net.ipv4.ip_local_reserved_ports = {render_ports(wanted)}\n")


def plan_host(facts: dict, ports: tuple[int, ...], persist: bool) -> Plan:
    current = parse_ports(facts["reserved"])
    recorded = mnft_ports(facts)
    missing = set(ports) - current
    plan = Plan()
    low, high = (int(x) for x in facts["range"].split())
    outside = sorted(p for p in ports if not low <= p <= high)
    if outside:
        plan.notes.append(f"{render_ports(set(outside))} outside the ephemeral range {low}-{high}: reserved anyway (harmless)")
    wanted = current | set(ports)
    if missing:
        plan.changes.append(f"reserve {render_ports(missing)} in net.ipv4.ip_local_reserved_ports")
        plan.ops.append({"op": "sysctl", "path": SYSCTL, "value": render_ports(wanted)})
    new_record = recorded | missing
    if new_record != recorded:
        plan.ops.append(write_op(RECORD, render_ports(new_record) + "\n", mode=0o644, dir_mode=0o700))
    if persist:
        have = persisted_ports(facts["persisted"])
        if have is None or not set(ports) <= have or persisted_mnft_ports(facts["persisted"]) != new_record:
            plan.changes.append(f"write {PERSIST}")
            plan.ops.append(write_op(PERSIST, persisted_text(wanted, new_record), mode=0o644))
    elif facts["persisted"] is not None:
        plan.notes.append(f"{PERSIST} (from an earlier run with persist: true) is kept; invoke setup --undo removes it")
    return plan


def plan_undo(facts: dict) -> Plan:
    current = parse_ports(facts["reserved"])
    recorded = mnft_ports(facts)
    plan = Plan()
    if recorded & current:
        plan.changes.append(f"unreserve {render_ports(recorded & current)} (added by mnft)")
        plan.ops.append({"op": "sysctl", "path": SYSCTL, "value": render_ports(current - recorded)})
    if facts["record"] is not None:
        plan.ops.append({"op": "remove", "path": RECORD})
        plan.changes = plan.changes or ["forget mnft's reserved-ports record"]
    if facts["persisted"] is not None:
        plan.changes.append(f"delete {PERSIST}")
        plan.ops.append({"op": "remove", "path": PERSIST})
    return plan


def read(ctx: Context, host: Host):
    results, failure = read_ops(ctx, host, [{"op": "read", "path": p} for p in (SYSCTL, RANGE, RECORD, PERSIST)], root=True)
    if failure:
        return None, failure
    reserved, port_range, record, persisted = results
    if not reserved.get("exists"):
        return None, Outcome(FAILED, error=f"{SYSCTL} does not exist")
    return {
        "reserved": reserved["text"],
        "range": port_range.get("text", "32768 60999"),
        "record": record["text"] if record.get("exists") else None,
        "persisted": persisted["text"] if persisted.get("exists") else None,
    }, None


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    ports = tuple(params["ports"] or (ctx.inventory.rendezvous_port,))
    return standard(ctx, read, lambda facts: {n: plan_host(f, ports, params["persist"]) for n, f in facts.items()}, root=True)


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    return standard(ctx, read, lambda facts: {n: plan_undo(f) for n, f in facts.items()}, root=True)
