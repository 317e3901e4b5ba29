"""Send one directory to many hosts so that the controller uploads it about once: hosts relay it to each other.

With the node-to-node SSH mesh of `invoke setup` (each node has a mesh key, its peers' host keys in known_hosts
and a `Host <name>` stanza in ~/.ssh/config), the controller rsyncs the directory to one host (the seed); then
every host that holds a complete copy sends it to one that does not, so the number of holders doubles each
round (1 → 2 → 4 → 8: log2(N) rounds after the seed). Host-to-host copies are `rsync -s` over `ssh -o
BatchMode=yes -o StrictHostKeyChecking=yes <peer>`: the mesh's verified host keys, never a prompt or an
unverified key. Without the mesh (or for a host a relay failed to reach) the controller sends directly.

Fan-in is one connection per host per round: a round's receivers are distinct hosts (`rounds()`), so no sshd
sees more than one relay hop (plus the controller's own connection) at once, far below stock MaxStartups; a hop
the receiver's sshd dropped before the banner anyway is tried again with backoff (`mnft.hosts.fanin`), then sent
by the controller. The controller's own rsyncs retry such a drop too (`mnft.sync.rsync.run_rsync`).

`rounds()` is pure (who sends to whom), tested with data; `distribute()` runs it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from mnft.hosts import fanin
from mnft.hosts.command import Command
from mnft.hosts.fleet import Fleet, Status
from mnft.hosts.settings import Host, Inventory
from mnft.sync.rsync import SshSettings, classify, remote_spec, run_rsync, ssh_command
from mnft.sync.targets import normalize_target

CONTROLLER = "controller"
RELAY_SSH = "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4"


@dataclass
class Delivery:
    """How one host got the directory."""

    host: str
    status: str = "pending"  # ok | failed | unreachable | host-key-rejected
    via: str = ""  # "controller" or the peer that sent it
    error: str = ""
    controller_bytes: int = 0  # bytes the controller itself sent for this host (rsync --stats)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def rounds(hosts: Sequence[str], relay: bool) -> list[list[tuple[str, str]]]:
    """(sender, receiver) pairs per round. Without relay: one round, the controller to every host. With relay:
    the controller to the first host, then every holder to one new host per round."""
    if not hosts:
        return []
    if not relay:
        return [[(CONTROLLER, h) for h in hosts]]
    plan = [[(CONTROLLER, hosts[0])]]
    holders, pending = [hosts[0]], list(hosts[1:])
    while pending:
        step = [(sender, pending.pop(0)) for sender in holders if pending]
        holders += [receiver for _, receiver in step]
        plan.append(step)
    return plan


def mesh_ready(hosts: Sequence[Host], mesh: Mapping[str, Sequence[str]]) -> bool:
    """Every host's ~/.ssh/config has mnft's mesh stanza for every other host (facts: host -> names)."""
    names = [h.name for h in hosts]
    return len(hosts) > 1 and all(set(names) - {h.name} <= set(mesh.get(h.name) or ()) for h in hosts)


def _remote_path(target: str) -> str:
    """A path for the receiving rsync (-s: no shell), which starts in the home: `~/x` is `x`."""
    norm = normalize_target(target)
    return norm[2:] if norm.startswith("~/") else norm


def relay_command(peer: Host, src: str, dst: str) -> Command:
    """On the sending host: rsync its copy to the peer, by the peer's mesh name (its ~/.ssh/config stanza)."""
    return Command.of("rsync", "-a", "-s", "--delete", "--timeout=120", "--stats", "-e", RELAY_SSH,
                      normalize_target(src).rstrip("/") + "/", f"{peer.name}:{_remote_path(dst).rstrip('/')}/")


def controller_argv(host: Host, src: Path, dst: str, ssh: SshSettings) -> list[str]:
    """From the controller: rsync the staging directory (its symlinks followed: -L) to the host."""
    argv = ["rsync", "-a", "-L", "-s", "--delete", "--timeout=120", "--stats"]
    if not host.is_local:
        argv += ["-e", ssh_command(host, ssh)]
    return argv + [str(src).rstrip("/") + "/", remote_spec(host, dst)]


def distribute(fleet: Fleet, inventory: Inventory, src: Path | None, targets: Mapping[str, str], hosts: Sequence[Host], *, relay: bool,
               timeout: float = 3600.0, on_done: Callable[[Delivery], None] | None = None, seeds: Sequence[Host] = ()) -> dict[str, Delivery]:
    """Bring `src` (a local directory) to targets[host] on every host; one Delivery per host.

    seeds: hosts that already hold the directory at targets[seed] (`sync --image` from an image one host has): with
    relay they are the first holders and the controller sends nothing. src None: there is no local copy, so a hop
    that fails is that host's failure (the caller may send it from a copy of its own later)."""
    by_name = {h.name: h for h in [*seeds, *hosts]}
    ssh = SshSettings.for_inventory(inventory)
    deliveries = {h.name: Delivery(h.name) for h in hosts}
    lock = threading.Lock()

    def from_controller(name: str) -> None:
        started = time.monotonic()
        outcome = run_rsync(controller_argv(by_name[name], src, targets[name], ssh), timeout=timeout)
        status, error = classify(outcome.exit_code, outcome.stderr)
        d = deliveries[name]
        d.controller_bytes += outcome.bytes_sent
        d.seconds += round(time.monotonic() - started, 3)
        d.status = status.value
        d.via, d.error = CONTROLLER, error

    def from_peer(sender: str, name: str) -> None:
        started = time.monotonic()
        command = relay_command(by_name[name], targets[sender], targets[name])
        # the receiver's sshd may drop the hop before the banner (MaxStartups): try again, with backoff
        result, _ = fanin.retry_drops(lambda: fleet.run_one(by_name[sender], command, timeout=timeout),
                                      lambda r: r.status is Status.FAILED and r.exit_code == 255 and fanin.is_drop(r.stderr))
        d = deliveries[name]
        d.seconds += round(time.monotonic() - started, 3)
        if result.ok:
            d.status, d.via = "ok", sender
            return
        why = result.error if result.status is not Status.OK else "failed"
        if src is None:
            d.status, d.via, d.error = "failed", sender, f"relay from {sender} failed: {why}"
            return
        d.notes.append(f"relay from {sender} failed ({why}); sent by the controller instead")
        from_controller(name)

    def one(pair: tuple[str, str]) -> None:
        sender, name = pair
        try:
            if sender == CONTROLLER:
                from_controller(name)
            else:
                from_peer(sender, name)
        except Exception as exc:  # noqa: BLE001 - one host's fault never hides the others
            deliveries[name].status, deliveries[name].error = "failed", f"{exc.__class__.__name__}: {exc}"
        if on_done is not None:
            with lock:
                on_done(deliveries[name])

    pending = [h.name for h in hosts]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(pending))), thread_name_prefix="mnft-relay") as pool:
        if not relay:
            list(pool.map(one, [(CONTROLLER, name) for name in pending]))
            return deliveries
        holders: list[str] = [seed.name for seed in seeds]
        while pending and not holders:  # the seed: if the first host fails, the next one is tried
            name = pending.pop(0)
            one((CONTROLLER, name))
            if deliveries[name].ok:
                holders.append(name)
        while pending:  # as in rounds(): every holder sends to one new host per round
            pairs = [(sender, pending.pop(0)) for sender in list(holders) if pending]
            list(pool.map(one, pairs))
            holders += [name for _, name in pairs if deliveries[name].ok]
    return deliveries
