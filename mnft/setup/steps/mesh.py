"""Step `mesh`: every node can `ssh <peer>` to every node, non-interactively, with verified host keys.

On each node (as the login user, never through sudo):

* its own ed25519 key in a dedicated file (default ~/.ssh/mnft_mesh_ed25519, comment `mnft-mesh@<name>`),
  generated only if absent and recorded in `<key_file>.mnft-generated` (a private key someone else made gets only
  its missing .pub, recorded as such): undo deletes what that record names, never a key mnft did not make;
* ~/.ssh/authorized_keys: one line per node's mesh key, `from="<cluster addresses>" <key> mnft:mesh:<name>`,
  so a stolen mesh key is useless from outside the cluster; lines mnft did not write are never touched;
* ~/.ssh/known_hosts: a marked block with every node's host key under its inventory name and cluster address.
  The keys are the ones the controller read over its already-verified connections (never ssh-keyscan, which
  trusts whatever answers first);
* ~/.ssh/config: a marked block `Host <name> <address>` → HostName, Port, User, IdentityFile (the mesh key),
  appended at the end so it never captures the user's own options.

Nodes whose key cannot be read in this run (unreachable) keep the lines they had. A `connection: local` node's
host keys are read from this machine's /etc/ssh/ssh_host_*_key.pub; without them it is left out of known_hosts,
and the plan's notes say so.

Afterwards (`verify`, docs/setup.md "Verification at 64 hosts" says why this is enough): every node's files are
read back and checked against every peer (its authorized mesh line, host key and config stanza, and the source
address the node's routes give towards the peer against the `from=` list), and real `ssh -o BatchMode=yes -o
StrictHostKeyChecking=yes <peer> true` hops prove each node's client and sshd: a ring (each node to the next: O(N)
connections, one received per node) by default, every ordered pair with `verify: all`. Hops run in batches from
`mnft.hosts.fanin.pace`, so no node's sshd receives more than fanin.PER_HOST connections at once (below stock
MaxStartups), and a hop sshd dropped before the banner is tried again with backoff.
"""

from __future__ import annotations

import glob
import os
import shlex
from dataclasses import dataclass

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.hosts import fanin
from mnft.hosts.settings import Host
from mnft.setup.steps import blocks
from mnft.setup.steps.base import (
    CHANGED,
    FAILED,
    OK,
    Context,
    Outcome,
    Param,
    Plan,
    apply_plans,
    first_error,
    read_all,
    write_op,
)

TAGS = ("trust",)
NEEDS_ROOT = False
PARAMS = {
    "key_file": Param("str", "~/.ssh/mnft_mesh_ed25519", "each node's mesh key (private; .pub beside it)"),
    "restrict_from": Param("bool", True, "authorize mesh keys only from the nodes' cluster addresses (from=)"),
    "verify": Param("bool_or_str", True, "after applying, prove node-to-node SSH: true or ring (every node's files, and a ring "
                    "of real ssh hops: O(N)), all (a real hop for every ordered pair, paced: O(N²)), false (none)"),
}
VERIFY_MODES = (True, False, "ring", "all")

AUTHORIZED_KEYS = "~/.ssh/authorized_keys"
KNOWN_HOSTS = "~/.ssh/known_hosts"
SSH_CONFIG = "~/.ssh/config"
KNOWN_BLOCK = blocks.Block("# BEGIN mnft mesh host keys (managed by mnft setup; remove with: invoke setup --undo)", "# END mnft mesh host keys")
CONFIG_BLOCK = blocks.Block("# BEGIN mnft mesh (managed by mnft setup; remove with: invoke setup --undo)", "# END mnft mesh")
KEY_COMMENT = "mnft-mesh@"
KEY_RECORD = ".mnft-generated"  # next to the key: what mnft generated (remote.KEY_RECORD_SUFFIX)
VERIFY_TIMEOUT = 10


@dataclass(frozen=True)
class Node:
    name: str
    address: str | None  # cluster address (None: not reached this run and unknown)
    port: int = 22
    user: str | None = None
    aliases: tuple[str, ...] = ()  # other names the node is dialled by (inventory address when not the cluster one)
    mesh_key: str | None = None  # "ssh-ed25519 AAAA…" (None: unknown in this run)
    host_key: str | None = None  # "ssh-ed25519 AAAA…" as read by the controller, one per line (None: unknown)


def validate(params: dict) -> str | None:
    """A parameter problem the types cannot express, or None."""
    if params["verify"] not in VERIFY_MODES:
        return f"key 'verify': {params['verify']!r} is not one of true, false, ring, all"
    return None


def node_of(host: Host, address: str | None, mesh_key: str | None, host_key: str | None) -> Node:
    aliases = (host.address,) if host.address not in (host.name, address) else ()
    return Node(host.name, address, host.port or 22, host.user, aliases, mesh_key, host_key)


# ---------------------------------------------------------------------------------------------- pure planning


def _known_name(name: str, port: int) -> str:
    return name if port == 22 else f"[{name}]:{port}"


def known_hosts_lines(nodes: list[Node], old_body: list[str] | None) -> list[str]:
    """One line per node with a known host key; nodes without one keep their old line (if any)."""
    old = {}
    for line in old_body or []:
        first = line.split(",", 1)[0].split(" ", 1)[0]
        old.setdefault(first.strip("[").split("]")[0], []).append(line)
    lines = []
    for node in nodes:
        if node.host_key and node.address:
            names = ",".join(_known_name(n, node.port) for n in (node.name, node.address, *node.aliases))
            lines += [f"{names} {key}" for key in node.host_key.splitlines()]
        elif node.name in old:
            lines += old[node.name]
    return lines


def authorized_lines(nodes: list[Node], restrict_from: bool) -> dict[str, str]:
    """role -> authorized_keys line for every node whose mesh key is known."""
    sources = ",".join(n.address for n in nodes if n.address)
    prefix = f'from="{sources}" ' if restrict_from else ""
    out = {}
    for node in nodes:
        if node.mesh_key and node.address:
            key_type, blob = node.mesh_key.split()[:2]
            out[f"mesh:{node.name}"] = f"{prefix}{key_type} {blob} {blocks.MARK}mesh:{node.name}"
    return out


def _stanzas(body: list[str] | None) -> dict[str, list[str]]:
    """First name of each `Host` stanza of an old config block -> its lines."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in body or []:
        words = line.split()
        if words and words[0] == "Host" and len(words) > 1:
            current = out.setdefault(words[1], [])
        if current is not None:
            current.append(line)
    return out


def config_lines(nodes: list[Node], key_file: str, old_body: list[str] | None = None) -> list[str]:
    """A stanza per node; a node whose address is unknown this run keeps its old stanza, if it had one."""
    old = _stanzas(old_body)
    lines = []
    for node in nodes:
        if not node.address:
            lines += old.get(node.name, [])
            continue
        lines.append("Host " + " ".join(dict.fromkeys((node.name, node.address, *node.aliases))))
        lines.append(f"    HostName {node.address}")
        if node.port != 22:
            lines.append(f"    Port {node.port}")
        if node.user:
            lines.append(f"    User {node.user}")
        lines.append(f"    IdentityFile {key_file}")
    return lines


def _text(f: dict) -> str:
    return f.get("text", "") if f.get("exists") else ""


def _expect(f: dict):
    return f.get("sha256") if f.get("exists") else None


def plan_node(files: dict, nodes: list[Node], key_file: str, restrict_from: bool, pending: frozenset[str] = frozenset()) -> Plan:
    """One node's plan from its files (authorized_keys, known_hosts, config: read results) and all nodes.
    `pending`: nodes whose mesh key is generated on apply (--check), so not known yet."""
    plan = Plan()
    unknown = {n.name for n in nodes if not n.mesh_key}
    wanted = authorized_lines(nodes, restrict_from)
    owned = lambda role: role.startswith("mesh:") and role[len("mesh:"):] not in unknown  # noqa: E731
    ak = files["authorized_keys"]
    new_ak = blocks.set_marked_lines(_text(ak), wanted, owned)
    if new_ak != _text(ak):
        plan.changes.append(f"authorize {len(wanted)} mesh keys in ~/.ssh/authorized_keys")
        plan.ops.append(write_op(AUTHORIZED_KEYS, new_ak, mode=0o600, dir_mode=0o700, expect=_expect(ak)))
    kh = files["known_hosts"]
    try:
        old_body = KNOWN_BLOCK.body(_text(kh))
        new_kh = blocks.set_block(_text(kh), KNOWN_BLOCK, known_hosts_lines(nodes, old_body))
    except ValueError as exc:
        return Plan(error=f"~/.ssh/known_hosts: {exc}")
    if new_kh != _text(kh):
        plan.changes.append("record the nodes' host keys in ~/.ssh/known_hosts")
        plan.ops.append(write_op(KNOWN_HOSTS, new_kh, mode=None if kh.get("exists") else 0o600, dir_mode=0o700, expect=_expect(kh)))
    cfg = files["config"]
    try:
        new_cfg = blocks.set_block(_text(cfg), CONFIG_BLOCK, config_lines(nodes, key_file, CONFIG_BLOCK.body(_text(cfg))))
    except ValueError as exc:
        return Plan(error=f"~/.ssh/config: {exc}")
    if new_cfg != _text(cfg):
        plan.changes.append("add the nodes (mesh key, address) to ~/.ssh/config")
        plan.ops.append(write_op(SSH_CONFIG, new_cfg, mode=None if cfg.get("exists") else 0o600, dir_mode=0o700, expect=_expect(cfg)))
    missing_host_keys = [n.name for n in nodes if not n.host_key]
    if missing_host_keys:
        plan.notes.append("host key unknown (not reached this run, or a local host without readable /etc/ssh/ssh_host_*_key.pub): "
                          + ", ".join(missing_host_keys) + "; not part of the mesh's known_hosts this run")
    if unknown - pending:
        plan.notes.append("mesh key unknown (not reached this run): " + ", ".join(sorted(unknown - pending)))
    if pending:
        plan.notes.append("mesh keys of " + ", ".join(sorted(pending)) + " do not exist yet: they are authorized once generated")
    return plan


def generated_record(text: str | None) -> tuple[str, str] | None:
    """(kind, key blob) from mnft's record next to the key ("key": mnft generated the pair; "pub": only the .pub
    from someone else's private key), or None."""
    kind, blob = None, None
    for line in (text or "").splitlines():
        if line.startswith("generated:"):
            kind = line.split(":", 1)[1].strip()
        elif line.strip() and not line.startswith("#"):
            blob = blocks.key_blob(line)
    return (kind, blob) if kind in ("key", "pub") and blob else None


def plan_node_undo(files: dict, key_file: str) -> Plan:
    """Remove mnft's lines and blocks, and the key files mnft generated (by its record, and only while the .pub
    still holds the key it generated): never a key someone else made."""
    plan = Plan()
    ak = files["authorized_keys"]
    new_ak = blocks.set_marked_lines(_text(ak), {}, lambda role: role.startswith("mesh:"))
    if new_ak != _text(ak):
        plan.changes.append("remove mnft's mesh keys from ~/.ssh/authorized_keys")
        plan.ops.append(blocks.rewrite_or_remove(AUTHORIZED_KEYS, new_ak, _expect(ak)))
    for label, path, block in (("known_hosts", KNOWN_HOSTS, KNOWN_BLOCK), ("config", SSH_CONFIG, CONFIG_BLOCK)):
        f = files[label]
        try:
            new = blocks.remove_block(_text(f), block)
        except ValueError as exc:
            return Plan(error=f"~/.ssh/{label}: {exc}")
        if new != _text(f):
            plan.changes.append(f"remove mnft's block from ~/.ssh/{label}" + (" (nothing else in it: file deleted)" if not new else ""))
            plan.ops.append(blocks.rewrite_or_remove(path, new, _expect(f)))
    record_file = files.get("record") or {}
    if record_file.get("exists"):
        record = generated_record(_text(record_file))
        pub = files.get("pub") or {}
        same = record is not None and pub.get("exists") and blocks.key_blob(_text(pub)) == record[1]
        if same and record[0] == "key":
            plan.changes.append(f"delete the mesh key {key_file} (generated by mnft)")
            plan.ops += [{"op": "remove", "path": key_file}, {"op": "remove", "path": key_file + ".pub", "expect_sha256": pub["sha256"]}]
        elif same:
            plan.changes.append(f"delete {key_file}.pub (written by mnft from your private key, which stays)")
            plan.ops.append({"op": "remove", "path": key_file + ".pub", "expect_sha256": pub["sha256"]})
        else:
            plan.changes.append(f"forget mnft's record {key_file}{KEY_RECORD}")
            plan.notes.append(f"{key_file}: the key is not the one mnft generated (replaced since?): kept")
        plan.ops.append({"op": "remove", "path": key_file + KEY_RECORD})
    return plan


def hop_argv(peer: str) -> list[str]:
    """On one node: a real, non-interactive `ssh <peer> true` with strict host keys."""
    return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"ConnectTimeout={VERIFY_TIMEOUT}", peer, "true"]


def verify_pairs(names: list[str], mode) -> list[tuple[str, str]]:
    """(sender, receiver) hops: a ring (each node to the next) by default, every ordered pair with "all"."""
    return fanin.all_pairs(names) if mode == "all" else fanin.ring(names)


def verify_batches(names: list[str], mode, k: int = fanin.PER_HOST) -> list[list[tuple[str, str]]]:
    """The hops in batches in which no node receives (or sends) more than k: the controller waits between batches."""
    return fanin.pace(verify_pairs(names, mode), k, sends=k)


def route_sources(text: str) -> dict[str, str]:
    """destination -> source address, from `ip -o route get` lines ("10.0.0.12 dev eth0 src 10.0.0.11 uid 0 …")."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "multicast"):
            words = words[1:]
        if len(words) > 2 and "src" in words[:-1]:
            out[words[0]] = words[words.index("src") + 1]
    return out


def check_files(me: str, files: dict, nodes: list[Node], key_file: str, restrict_from: bool, sources: dict[str, str] | None,
                peers: set[str] | None = None) -> list[str]:
    """What a node's own files (read back after apply) say it lacks for each peer taking part (`peers`, default
    every node; `nodes` are all of them, as the plan wrote the lines from them): the peer's
    mesh line in authorized_keys (the peer could not log in here), its host key in known_hosts and its stanza in
    ~/.ssh/config (this node could not verify or dial it), and, with `from=`, a source address this node's routes
    would use towards the peer that the peers' from= lists do not hold (the peer's sshd would refuse the key)."""
    problems = []
    checked = [n for n in nodes if n.name != me and (peers is None or n.name in peers)]
    ak_lines = set(_text(files["authorized_keys"]).splitlines())
    wanted = authorized_lines(nodes, restrict_from)
    missing = [n.name for n in checked if wanted.get(f"mesh:{n.name}") not in ak_lines]
    if missing:
        problems.append("~/.ssh/authorized_keys lacks the mesh key of " + ", ".join(missing))
    kh_lines = set(_text(files["known_hosts"]).splitlines())
    missing = [n.name for n in checked if not set(known_hosts_lines([n], None)) <= kh_lines]
    if missing:
        problems.append("~/.ssh/known_hosts lacks the host key of " + ", ".join(missing))
    try:
        body = CONFIG_BLOCK.body(_text(files["config"])) or []
    except ValueError as exc:
        body = []
        problems.append(f"~/.ssh/config: {exc}")
    stanzas = _stanzas(body)
    missing = [n.name for n in checked if stanzas.get(n.name) != config_lines([n], key_file)]
    if missing:
        problems.append("~/.ssh/config lacks mnft's stanza for " + ", ".join(missing))
    if restrict_from and sources is not None:
        allowed = {n.address for n in nodes if n.address}
        wrong = [f"{n.name} from {sources[n.address]}" for n in checked if n.address in sources and sources[n.address] not in allowed]
        if wrong:
            problems.append("its routes reach " + ", ".join(wrong) + ", an address the mesh's from= does not list "
                            "(set 'iface' to the cluster interface in the inventory)")
    return problems


# ---------------------------------------------------------------------------------------------- remote


def _reader(key_file: str):
    def read(ctx: Context, host: Host):
        results, failure = ctx.remote(host, [
            {"op": "read", "path": key_file + ".pub"},
            {"op": "read", "path": AUTHORIZED_KEYS},
            {"op": "read", "path": KNOWN_HOSTS},
            {"op": "read", "path": SSH_CONFIG},
            {"op": "read", "path": key_file + KEY_RECORD},
            {"op": "stat", "paths": [key_file]},
        ])
        if failure:
            return None, failure
        error = first_error(results)
        if error:
            return None, Outcome(FAILED, error=error)
        return {"pub": results[0], "authorized_keys": results[1], "known_hosts": results[2], "config": results[3], "record": results[4],
                "private": results[5][key_file]}, None

    return read


LOCAL_HOST_KEYS = "/etc/ssh"


def local_host_keys(directory: str = LOCAL_HOST_KEYS) -> str | None:
    """The host keys of this machine ("type base64", one per line) from <directory>/ssh_host_*_key.pub, or None."""
    keys = []
    for path in sorted(glob.glob(os.path.join(directory, "ssh_host_*_key.pub"))):
        try:  # a public key is one line (limits.PUBLIC_KEY_BYTES); a larger file is not a host key of this machine's
            words = limits.read_file(path, limits.PUBLIC_KEY_BYTES, "host key", "PUBLIC_KEY_BYTES").decode("utf-8", "replace").split()
        except limits.TooLarge:
            raise
        except InputError:
            continue
        if len(words) >= 2:
            keys.append(" ".join(words[:2]))
    return "\n".join(keys) or None


def host_key_of(ctx: Context, host: Host) -> str | None:
    """The host key the controller's verified connection negotiated ("type base64"); for a `connection: local`
    node (no SSH connection to read it from), this machine's own host keys; None when unknown."""
    if host.is_local:
        return local_host_keys()
    try:
        conn = ctx.fleet.connection(host)
    except Exception:  # noqa: BLE001 - unreachable: the key stays unknown this run
        return None
    client = getattr(getattr(conn, "fabric", None), "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is None:
        return None
    key = transport.get_remote_server_key()
    return f"{key.get_name()} {key.get_base64()}"


def run(ctx: Context, params: dict) -> dict[str, Outcome]:
    key_file = params["key_file"]
    facts, failed = read_all(ctx, _reader(key_file))
    generated: dict[str, str] = {}

    def ensure_key(host: Host):
        pub = facts[host.name]["pub"]
        if pub.get("exists"):
            words = pub["text"].split()
            return (" ".join(words[:2]) if len(words) >= 2 else None), None
        if ctx.check:
            return None, None
        results, failure = ctx.remote(host, [{"op": "keygen", "path": key_file, "comment": KEY_COMMENT + host.name}])
        if failure:
            return None, failure
        error = first_error(results)
        if error:
            return None, Outcome(FAILED, [f"generate {key_file}" if not facts[host.name]["private"].get("exists") else f"write {key_file}.pub"], error)
        generated[host.name] = results[0]["public"]
        return " ".join(results[0]["public"].split()[:2]), None

    keys = ctx.map(ensure_key, [h for h in ctx.hosts if h.name in facts])
    for name, (_, failure) in keys.items():
        if failure:
            failed[name] = failure
    nodes = [node_of(h, ctx.addresses.get(h.name), (keys.get(h.name) or (None, None))[0],
                     host_key_of(ctx, h) if h.name in facts else None) for h in ctx.inventory.hosts]
    pending = frozenset(n for n, f in facts.items() if not f["pub"].get("exists") and ctx.check)
    plans = {}
    for name, f in facts.items():
        if name in failed:
            continue
        plan = plan_node(f, nodes, key_file, params["restrict_from"], pending)
        if not f["pub"].get("exists"):
            if f["private"].get("exists"):
                plan.changes.insert(0, f"write {key_file}.pub from the existing private key (kept on undo)")
            else:
                plan.changes.insert(0, f"generate {key_file} (ed25519)")
        plans[name] = plan
    outcomes = apply_plans(ctx, plans, root=False)
    if not ctx.check and params["verify"]:
        outcomes = _verify(ctx, nodes, outcomes, params)
    return {h.name: failed.get(h.name) or outcomes.get(h.name) or Outcome(FAILED, error="not planned") for h in ctx.hosts}


def _verify(ctx: Context, nodes: list[Node], outcomes: dict[str, Outcome], params: dict, sleep=None) -> dict[str, Outcome]:
    """Files read back on every node, then real hops in paced batches; a dropped hop is retried with backoff."""
    import time

    sleep = sleep or time.sleep
    ok = {h.name for h in ctx.hosts if h.name in outcomes and outcomes[h.name].status in (OK, CHANGED)}
    taking_part = [n for n in nodes if n.host_key and n.address and n.name in ok]  # unreachable peers are reported as such
    names = [n.name for n in taking_part]
    by_name = {h.name: h for h in ctx.hosts}
    problems: dict[str, list[str]] = {name: [] for name in names}  # from the node's files
    failed_hops: dict[str, list[str]] = {name: [] for name in names}  # "peer (why)"
    failures: dict[str, str] = {}  # the verification itself could not run there

    def read_back(host: Host):
        peers = [n.address for n in taking_part if n.name != host.name]
        results, failure = ctx.remote(host, [
            {"op": "read", "path": AUTHORIZED_KEYS},
            {"op": "read", "path": KNOWN_HOSTS},
            {"op": "read", "path": SSH_CONFIG},
            {"op": "run", "argv": ["ip", "-o", "-batch", "-"], "input": "".join(f"route get {a}\n" for a in peers), "timeout": 20},
        ])
        if failure:
            return failure.error
        error = first_error(results)
        if error:
            return error
        sources = route_sources(results[3].get("stdout", "")) if results[3].get("rc") == 0 else None
        files = {"authorized_keys": results[0], "known_hosts": results[1], "config": results[2]}
        return check_files(host.name, files, nodes, params["key_file"], params["restrict_from"], sources, set(names))

    for name, found in ctx.map(read_back, [by_name[n] for n in names]).items():
        if isinstance(found, str):
            failures[name] = found
        else:
            problems[name] += found

    def hop_batch(batch: list[tuple[str, str]]) -> dict[tuple[str, str], str | None]:
        """(sender, receiver) -> None (ok) or its error, for one batch."""
        senders: dict[str, list[str]] = {}
        for sender, receiver in batch:
            senders.setdefault(sender, []).append(receiver)

        def one(host: Host):
            peers = senders[host.name]
            results, failure = ctx.remote(host, [{"op": "run_all", "argvs": [hop_argv(p) for p in peers], "timeout": VERIFY_TIMEOUT + 5}],
                                          timeout=VERIFY_TIMEOUT + 5 + 60)
            if failure:
                return {(host.name, p): "verify: " + failure.error for p in peers}
            error = first_error(results)
            if error:
                return {(host.name, p): error for p in peers}
            return {(host.name, p): None if r.get("rc") == 0 else (_last_line(r.get("stderr")) or f"exit {r.get('rc')}")
                    for p, r in zip(peers, results[0]["results"])}

        out: dict[tuple[str, str], str | None] = {}
        for found in ctx.map(one, [by_name[s] for s in senders if s not in failures]).values():
            out.update(found)
        return out

    hop_errors: dict[tuple[str, str], str] = {}
    for batch in verify_batches(names, params["verify"]):
        batch = [pair for pair in batch if pair[0] not in failures]
        attempt = 1
        while batch:
            done = hop_batch(batch)
            dropped = [pair for pair, error in done.items() if error and fanin.is_drop(error)]
            for pair, error in done.items():
                if error and pair not in dropped:
                    hop_errors[pair] = error
            if dropped and attempt == fanin.ATTEMPTS:
                for pair in dropped:
                    hop_errors[pair] = fanin.refusal(pair[1])
                break
            batch = [pair for pair in batch if pair in dropped]
            if batch:
                sleep(fanin.backoff(attempt))
                attempt += 1
    for (sender, receiver), error in hop_errors.items():
        failed_hops[sender].append(f"{receiver} ({error})")

    checked = {}
    for name in names:
        outcome = outcomes[name]
        if name in failures:
            checked[name] = Outcome(FAILED, outcome.changes, "verify: " + failures[name], outcome.notes)
            continue
        errors = problems[name] + (["ssh to peers failed: " + "; ".join(failed_hops[name])] if failed_hops[name] else [])
        checked[name] = Outcome(FAILED, outcome.changes, "; ".join(errors), outcome.notes) if errors else outcome
    return {**outcomes, **checked}


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


def undo(ctx: Context, params: dict) -> dict[str, Outcome]:
    key_file = params["key_file"]
    facts, failed = read_all(ctx, _reader(key_file))
    plans = {name: plan_node_undo(f, key_file) for name, f in facts.items()}
    outcomes = apply_plans(ctx, plans, root=False)
    return {h.name: failed.get(h.name) or outcomes.get(h.name) for h in ctx.hosts}


def ssh_check_argv(peer: str) -> list[str]:
    """The check the issue asks for, as a shell-ready argv (used by docs and tests)."""
    return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", peer, "true"]


def quoted_check(peer: str) -> str:
    return shlex.join(ssh_check_argv(peer))
