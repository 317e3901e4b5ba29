"""Step `firewall`: a peers-only firewall on the cluster interface, in an nftables table owned by mnft.

The table `inet mnft` (its own input chain, priority filter - 10, policy accept) on the cluster interface:
accepts established traffic, the SSH port from anyone, everything from the nodes' cluster addresses (NCCL and
gloo listen on ephemeral ports: no setting pins them, so the firewall allows peers, not ports), the rendezvous
port(s) from `allow_from` networks, `open_ports` from anyone; and drops every other new inbound TCP connection.
Other interfaces and other tables are untouched; `nft list ruleset` minus this table is what it was.

Applied atomically (`nft -f`: create, delete and re-create the table in one transaction) with a revert armed on
the host first (a detached `sleep; nft -f <previous table>` whose pid is recorded). Then the controller opens a
NEW SSH connection: on success it cancels that revert (under a lock the sleeper takes before reverting, so a
revert that already ran or is running is reported as such, never as cancelled) and reads the table back; on
failure the revert fires and the step fails "reverted: would lock out SSH".
Idempotent: the table's comment carries a digest of its rules, and the live sets and rules are compared with
the planned ones; both the same, nothing to do (a table flushed or edited by hand is re-applied).

When ufw or firewalld is active, they manage the host's firewall: mnft's table cannot re-open what they drop,
so the step fails with the commands to run (or `manager: nftables` to add mnft's table anyway).
"""

from __future__ import annotations

import hashlib
import re

import fabric

from mnft.hosts.connection import CommandTimeout, HostKeyRejected, Timeouts, Unreachable, open_connection
from mnft.hosts.hostkeys import known_hosts_files, load_trusted
from mnft.hosts.settings import Host
from mnft.setup.steps.base import CHANGED, FAILED, Context, Outcome, Param, Plan, first_error, standard

TAGS = ("firewall",)
NEEDS_ROOT = True
PARAMS = {
    "ssh_port": Param("port", None, "the port sshd listens on (default: the inventory's port, else 22)"),
    "rendezvous_ports": Param("ports", None, "rendezvous port(s) (default: the inventory's rendezvous_port)"),
    "allow_from": Param("cidrs", (), "networks (besides the nodes) that may reach the rendezvous port(s)"),
    "open_ports": Param("ports", (), "ports open to anyone on the cluster interface (e.g. a dashboard)"),
    "revert_after": Param("number", 30.0, "seconds after which the rules are reverted unless a new SSH connection succeeded"),
    "probe_timeout": Param("number", 10.0, "seconds the SSH probe may take (keep it below revert_after)"),
    "manager": Param("str", "auto", "auto (refuse when ufw/firewalld manage the host) or nftables (use mnft's table regardless)"),
}
MANAGERS = ("auto", "nftables")

TABLE = "mnft"
FAMILY = "inet"
DELETE = f"table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n"  # "create if absent, then delete": never fails
DIGEST = re.compile(r"sha256=([0-9a-f]{16})")


def validate(params: dict) -> str | None:
    """A parameter problem the types cannot express, or None."""
    if params["manager"] not in MANAGERS:
        return f"key 'manager': {params['manager']!r} is not one of {', '.join(MANAGERS)}"
    if params["probe_timeout"] >= params["revert_after"]:
        return "key 'probe_timeout': must be below revert_after (the probe must finish before the revert fires)"
    return None


# ---------------------------------------------------------------------------------------------- pure planning


def _item(item) -> str:
    text = str(item)
    return text[:-3] if text.endswith("/32") else text  # nft lists a /32 network as the address


def _set(items) -> str:
    """An anonymous set as nft lists it: a single element bare, more in braces."""
    items = [_item(i) for i in items]
    return items[0] if len(items) == 1 else "{ " + ", ".join(items) + " }"


def table_body(iface: str, peers: list[str], ssh_port: int, rendezvous_ports: tuple[int, ...], allow_from: tuple[str, ...],
               open_ports: tuple[int, ...]) -> str:
    """The table's sets and chain, as `nft` lists them (tabs), without the table line and comment."""
    rules = [
        f'iifname != "{iface}" accept',
        "ct state established,related accept",
        f"tcp dport {ssh_port} accept",
        "ip saddr @peers accept",
    ]
    if allow_from:
        rules.append(f"ip saddr {_set(allow_from)} tcp dport {_set(rendezvous_ports)} accept")
    if open_ports:
        rules.append(f"tcp dport {_set(sorted(set(open_ports)))} accept")
    rules.append("meta l4proto tcp ct state new drop")
    lines = [
        "\tset peers {",
        "\t\ttype ipv4_addr",
        f"\t\telements = {{ {', '.join(peers)} }}",
        "\t}",
        "",
        "\tchain input {",
        "\t\ttype filter hook input priority filter - 10; policy accept;",
        *(f"\t\t{rule}" for rule in rules),
        "\t}",
    ]
    return "\n".join(lines) + "\n"


def live_body(listing: str | None) -> str | None:
    """The body of `nft list table` output (without the table line, its comment and the closing brace),
    whitespace-normalised (nft wraps long element lists), or None."""
    if not listing:
        return None
    lines = listing.splitlines()
    inner = [ln for ln in lines[1:-1] if not ln.strip().startswith("comment ")]
    return " ".join(" ".join(inner).split())


def same_table(listing: str | None, body: str) -> bool:
    """The live table is exactly the planned one: the digest in its comment and every set and rule as planned
    (a table flushed or edited by hand since differs, and is re-applied)."""
    found = DIGEST.search(listing or "")
    return bool(found) and found.group(1) == digest(body) and live_body(listing) == " ".join(body.split())


def digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def ruleset(body: str) -> str:
    """What `nft -f` gets: one transaction that replaces (or creates) the table."""
    comment = f'\tcomment "mnft setup: peers-only firewall; remove with invoke setup --undo; sha256={digest(body)}"\n'
    return DELETE + f"table {FAMILY} {TABLE} {{\n" + comment + body + "}\n"


def revert_text(current_table: str | None) -> str:
    """Put back the table as it was (or remove it when there was none)."""
    return DELETE + (current_table or "")


def manager_problem(facts: dict, peers: list[str], rendezvous_ports: tuple[int, ...]) -> str | None:
    if facts.get("ufw"):
        fix = "; ".join(f"ufw allow from {p}" for p in peers)
        return f"ufw is active and manages this host's firewall; run: {fix} (or set manager: nftables)"
    if facts.get("firewalld"):
        fix = "; ".join(f"firewall-cmd --permanent --zone=trusted --add-source={p}" for p in peers) + "; firewall-cmd --reload"
        return f"firewalld is running and manages this host's firewall; run: {fix} (or set manager: nftables)"
    return None


def plan_host(facts: dict, *, iface: str | None, peers: list[str], ssh_port: int, params: dict, rendezvous_ports: tuple[int, ...]) -> Plan:
    if facts.get("nft_missing"):
        return Plan(error="nft is not installed (apt-get install nftables)")
    if not iface:
        return Plan(error="cannot tell the cluster interface: set iface in the inventory")
    if params["manager"] == "auto":
        problem = manager_problem(facts, peers, rendezvous_ports)
        if problem:
            return Plan(error=problem)
    body = table_body(iface, peers, ssh_port, rendezvous_ports, params["allow_from"], params["open_ports"])
    current = facts.get("table")
    if same_table(current, body):
        return Plan()
    found = DIGEST.search(current or "")
    what = "add" if not current else "re-apply (edited since mnft applied it)" if found and found.group(1) == digest(body) else "replace"
    change = f"{what} nftables table {FAMILY} {TABLE} on {iface}: peers {', '.join(peers)}, ssh {ssh_port}, drop other new TCP"
    return Plan([change], data={"rules": ruleset(body), "revert": revert_text(current), "body": body})


def plan_undo(facts: dict, staying: tuple[str, ...] = ()) -> Plan:
    """Delete mnft's table. staying: this host's peers (as its table names them) that this undo leaves set up:
    their firewall and the mesh still let this host in, which is said (a setup of theirs without it takes it out)."""
    if facts.get("nft_missing") or not facts.get("table"):
        return Plan()
    plan = Plan([f"delete nftables table {FAMILY} {TABLE}"], [{"op": "run", "argv": ["nft", "-f", "-"], "input": DELETE, "check": True}])
    if staying:
        plan.notes.append(f"{', '.join(staying)} (not in this undo) still let this host through their firewall and trust its mesh "
                          "key: `mnft setup` on them with an inventory without this host takes it out")
    return plan


def table_peers(table: str | None) -> list[str]:
    """The addresses a host's mnft table names as its peers (`set peers { … elements = { a, b } }`)."""
    found = re.search(r"set peers \{[^}]*?elements = \{([^}]*)\}", table or "", re.S)
    return [a.strip() for a in found.group(1).replace("\n", " ").split(",") if a.strip()] if found else []


# ---------------------------------------------------------------------------------------------- remote


def read(ctx: Context, host: Host):
    results, failure = ctx.remote(host, [
        {"op": "run", "argv": ["nft", "list", "table", FAMILY, TABLE]},
        {"op": "run", "argv": ["ufw", "status"]},
        {"op": "run", "argv": ["firewall-cmd", "--state"]},
    ], root=True)
    if failure:
        return None, failure
    error = first_error(results)
    if error:
        return None, Outcome(FAILED, error=error)
    nft, ufw, firewalld = results
    facts = {
        "nft_missing": nft["rc"] == 127,
        "table": nft["stdout"] if nft["rc"] == 0 else None,
        "ufw": ufw["rc"] == 0 and "Status: active" in ufw["stdout"],
        "firewalld": firewalld["rc"] == 0 and firewalld["stdout"].strip() == "running",
    }
    if nft["rc"] not in (0, 127) and "No such file or directory" not in nft["stderr"]:
        return None, Outcome(FAILED, error="nft list failed: " + " ".join(nft["stderr"].split())[:200])
    return facts, None


def probe_ssh(ctx: Context, host: Host, timeout: float) -> str | None:
    """Open a NEW verified SSH connection and run `true`: None when that works, else why not."""
    if host.is_local:
        return None
    try:
        # the same factory, known_hosts and ~/.ssh/config as the fleet's connections, but a brand-new TCP connection
        conn = open_connection(host, load_trusted(known_hosts_files(ctx.inventory.known_hosts)), Timeouts(connect=timeout, command=timeout), fabric.Config())
    except (Unreachable, HostKeyRejected) as exc:
        return str(exc)
    try:
        done = conn.run("true", timeout=timeout)
        return None if done.exit_code == 0 else f"`true` exited {done.exit_code}"
    except (Unreachable, CommandTimeout) as exc:
        return str(exc)
    finally:
        conn.close()


def apply_guarded(ctx: Context, host: Host, plan: Plan, params: dict) -> Outcome:
    delay = params["revert_after"]
    results, failure = ctx.remote(host, [{"op": "nft_guarded", "rules": plan.data["rules"], "revert": plan.data["revert"], "delay": delay}], root=True)
    if failure:
        failure.changes = plan.changes
        return failure
    error = first_error(results)
    if error:
        return Outcome(FAILED, plan.changes, error)
    pid, token = results[0]["pid"], results[0]["token"]
    why = probe_ssh(ctx, host, params["probe_timeout"])
    if why is None:
        results, failure = ctx.remote(host, [{"op": "cancel_revert", "pid": pid, "token": token},
                                             {"op": "run", "argv": ["nft", "list", "table", FAMILY, TABLE]}], root=True)
        if failure:
            return Outcome(FAILED, plan.changes, f"applied, but cancelling the revert failed ({failure.error}): it fires {delay:g}s after applying")
        error = first_error(results)
        if error:
            return Outcome(FAILED, plan.changes, f"applied, but cancelling the revert failed ({error}): it fires {delay:g}s after applying")
        if not results[0].get("cancelled"):
            return Outcome(FAILED, plan.changes, f"the revert fired before the SSH probe finished: reverted; raise revert_after (now {delay:g}s)")
        listing = results[1]["stdout"] if results[1].get("rc") == 0 else None
        if not same_table(listing, plan.data["body"]):
            return Outcome(FAILED, plan.changes, "after cancelling the revert the table is not the one applied (changed meanwhile?): run setup again")
        return Outcome(CHANGED, plan.changes)
    results, failure = ctx.remote(host, [{"op": "wait_gone", "pid": pid, "token": token, "timeout": delay + 15}], root=True, timeout=delay + 30)
    if failure or not results or not results[0].get("gone"):
        return Outcome(FAILED, plan.changes, f"would lock out SSH ({why}); the revert scheduled on the host fires {delay:g}s after applying")
    return Outcome(FAILED, plan.changes, f"reverted: would lock out SSH (a new SSH connection from the controller failed: {why})")


def _settings(ctx: Context, params: dict):
    ports = tuple(params["rendezvous_ports"] or (ctx.inventory.rendezvous_port,))
    # a node not reached whose address is unknown (see mnft.setup.playbook.addresses_of) is not a peer this run
    peers = sorted(set(ctx.addresses[h.name] for h in ctx.inventory.hosts if h.name in ctx.addresses), key=lambda a: tuple(int(x) for x in a.split(".")))
    return ports, peers


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    ports, peers = _settings(ctx, params)

    def planner(facts: dict[str, dict]) -> dict[str, Plan]:
        return {
            name: plan_host(f, iface=ctx.ifaces.get(name), peers=peers, ssh_port=params["ssh_port"] or ctx.inventory.host(name).port or 22,
                            params=params, rendezvous_ports=ports)
            for name, f in facts.items()
        }

    return standard(ctx, read, planner, root=True, applier=lambda c, h, p: apply_guarded(c, h, p, params))


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    undone = set(ctx.addresses.get(h.name) for h in ctx.inventory.hosts) | {h.address for h in ctx.inventory.hosts}

    def staying(facts: dict) -> tuple[str, ...]:
        return tuple(a for a in table_peers(facts.get("table")) if a not in undone)

    return standard(ctx, read, lambda facts: {n: plan_undo(f, staying(f)) for n, f in facts.items()}, root=True)
