"""`invoke trust-hosts`: the explicit, recorded act of trusting hosts' SSH keys.

Read each host's presented key (without authenticating), judge it against every trusted known_hosts file,
record new keys in mnft's own known_hosts file and print their fingerprints. A changed key is never recorded:
that needs a person to remove the old key first.
"""

from __future__ import annotations

import fabric
import paramiko

from mnft.core.output import command
from mnft.core.threads import DaemonPool
from mnft.hosts.connection import Timeouts, fabric_connection, gateway_hops, ssh_target
from mnft.hosts.hostkeys import (
    TrustResult,
    UnknownHostKey,
    fetch_host_key,
    fingerprint,
    judge,
    known_hosts_files,
    known_name,
    load_trusted,
    mnft_known_hosts,
    record,
    recorded_types,
)
from mnft.hosts.settings import Host, Inventory


def trust_hosts(inventory: Inventory, timeouts: Timeouts = Timeouts(), dry_run: bool = False) -> list[TrustResult]:
    files = known_hosts_files(inventory.known_hosts)
    trusted = load_trusted(files)
    config = fabric.Config()
    remote = [h for h in inventory.hosts if not h.is_local]

    def read(host: Host) -> tuple[TrustResult, object]:
        conn = fabric_connection(host, timeouts, config, trusted)
        hostname, port, _ = ssh_target(conn)
        name = known_name(hostname, port)
        recorded = recorded_types(name, trusted)
        try:
            key = fetch_host_key(hostname, port, timeouts.connect, _gateway_socket(conn, timeouts), recorded)
        except Exception as exc:  # noqa: BLE001 - any failure to read the key leaves the host untrusted
            return TrustResult(host.name, name, "-", "-", "unreachable", _reason(exc)), None
        finally:
            _close_hops(conn)
        state = judge(name, key, trusted)
        detail = ""
        if state == "changed":
            detail = f"a different key is already trusted for {name}: possible man-in-the-middle; if the host was reinstalled run ssh-keygen -R '{name}' (and remove it from {mnft_known_hosts()}) first"
        elif state == "revoked":
            detail = f"{name} presents a key marked @revoked in known_hosts: never trusted (a stolen or retired key); give the host a new key, then trust it"
        elif state == "other-type":
            detail = f"{name} is trusted with {', '.join(recorded)} but did not present it (offered {key.get_name()}): possible man-in-the-middle; if the host's keys were regenerated run ssh-keygen -R '{name}' (and remove it from {mnft_known_hosts()}) first"
        return TrustResult(host.name, name, key.get_name(), fingerprint(key), state, detail), key

    pool = DaemonPool(max_workers=max(1, min(64, len(remote))), thread_name_prefix="mnft-trust")  # Ctrl-C: a host that hangs is left
    try:
        read_results = [future.result() for future in [pool.submit(read, host) for host in remote]]
    finally:
        pool.shutdown()
    results = []
    for result, key in read_results:
        if result.state == "new":
            if not dry_run:
                record(mnft_known_hosts(), result.known_as, key)
                trusted.add(result.known_as, key.get_name(), key)
            result = TrustResult(result.name, result.known_as, result.key_type, result.fingerprint, "recorded" if not dry_run else "new", result.detail)
        results.append(result)
    return results


def _gateway_socket(conn: fabric.Connection, timeouts: Timeouts):
    """How to reach the host when ~/.ssh/config names a gateway: a channel through the ProxyJump hops (each
    verified against the trusted keys: a hop must be trusted before the hosts behind it) or the ProxyCommand.
    None: dial directly."""
    if not conn.gateway:
        return None
    return conn.open_gateway()


def _close_hops(conn: fabric.Connection) -> None:
    for hop in gateway_hops(conn):
        hop.close()


def _reason(exc: Exception) -> str:
    if isinstance(exc, UnknownHostKey):
        return f"ProxyJump hop {exc.hostname} has an unknown host key {fingerprint(exc.key)}: trust the hop first (list it in an inventory and run {command('trust-hosts')})"
    if isinstance(exc, paramiko.BadHostKeyException):
        return f"HOST KEY CHANGED for ProxyJump hop {exc.hostname}: possible man-in-the-middle"
    return str(exc) or exc.__class__.__name__
