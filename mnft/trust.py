"""`invoke trust-hosts`: the explicit, recorded act of trusting hosts' SSH keys.

Read each host's presented key (without authenticating), judge it against every trusted known_hosts file,
record new keys in mnft's own known_hosts file and print their fingerprints. A changed key is never recorded:
that needs a person to remove the old key first.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import fabric

from mnft.connection import Timeouts, fabric_connection, ssh_target
from mnft.hostkeys import (
    TrustResult,
    fetch_host_key,
    fingerprint,
    judge,
    known_hosts_files,
    known_name,
    load_trusted,
    mnft_known_hosts,
    record,
)
from mnft.inventory import Host, Inventory


def trust_hosts(inventory: Inventory, timeouts: Timeouts = Timeouts(), dry_run: bool = False) -> list[TrustResult]:
    trusted = load_trusted(known_hosts_files(inventory.known_hosts))
    config = fabric.Config()
    remote = [h for h in inventory.hosts if not h.is_local]

    def read(host: Host) -> tuple[TrustResult, object]:
        hostname, port, _ = ssh_target(fabric_connection(host, timeouts, config))
        name = known_name(hostname, port)
        try:
            key = fetch_host_key(hostname, port, timeouts.connect)
        except Exception as exc:  # noqa: BLE001 - any failure to read the key leaves the host untrusted
            return TrustResult(host.name, name, "-", "-", "unreachable", str(exc) or exc.__class__.__name__), None
        state = judge(name, key, trusted)
        detail = ""
        if state == "changed":
            detail = f"a different key is already trusted for {name}: possible man-in-the-middle; if the host was reinstalled run ssh-keygen -R '{name}' (and remove it from {mnft_known_hosts()}) first"
        return TrustResult(host.name, name, key.get_name(), fingerprint(key), state, detail), key

    with ThreadPoolExecutor(max_workers=max(1, min(64, len(remote)))) as pool:
        read_results = list(pool.map(read, remote))
    results = []
    for result, key in read_results:
        if result.state == "new":
            if not dry_run:
                record(mnft_known_hosts(), result.known_as, key)
                trusted.add(result.known_as, key.get_name(), key)
            result = TrustResult(result.name, result.known_as, result.key_type, result.fingerprint, "recorded" if not dry_run else "new")
        results.append(result)
    return results
