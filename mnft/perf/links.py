"""The link matrix: TCP throughput and RTT between every pair of hosts, on the interface the job will use.

One link agent (mnft.onhost.linkagent, stdlib only, shipped over SSH stdin) runs on every host for the whole
matrix, listening on an ephemeral port of the host's cluster address. The controller walks the round-robin
schedule: in each round it tells one host of every pair to measure its link to the other (both directions, one
after the other), and waits for every pair of the round before starting the next, so no host ever does two
transfers at once.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from mnft.check.findings import CheckReport
from mnft.check.rules import ipv4_of
from mnft.hosts import pyrun
from mnft.hosts.connection import Process
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host
from mnft.perf.schedule import round_robin

PINGS = 10


@dataclass
class Link:
    """One direction of one pair: src sends, dst receives and counts."""

    src: str
    dst: str
    gbps: float | None = None  # Gbit/s, counted by the receiver
    rtt_ms: float | None = None  # median TCP round trip of the pair (the same both ways)
    rtt_min_ms: float | None = None  # the fastest of the round trips: the path, without scheduling noise
    error: str | None = None


@dataclass
class LinkMatrix:
    hosts: list[str]
    addresses: dict[str, str]  # host -> the address its agent listened on (its cluster interface)
    ifaces: dict[str, str | None]
    seconds: float  # transfer time per direction and pair
    rounds: list[list[tuple[str, str]]]
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # host -> why it took no part
    retested: list[list[str]] = field(default_factory=list)  # pairs measured twice (they looked slow)
    elapsed: float = 0.0

    def gbps(self, src: str, dst: str) -> float | None:
        link = self.links.get((src, dst))
        return link.gbps if link else None

    def to_json(self) -> dict:
        return {
            "hosts": self.hosts,
            "addresses": self.addresses,
            "ifaces": self.ifaces,
            "seconds_per_direction": self.seconds,
            "rounds": [[list(p) for p in r] for r in self.rounds],
            "gbps": {s: {d: self.gbps(s, d) for d in self.hosts if d != s} for s in self.hosts},
            "rtt_ms": {s: {d: (self.links[(s, d)].rtt_ms if (s, d) in self.links else None) for d in self.hosts if d != s} for s in self.hosts},
            "links": [asdict(link) for link in self.links.values()],
            "errors": self.errors,
            "retested": self.retested,
            "elapsed_s": round(self.elapsed, 3),
        }


def cluster_address(host: Host, report: CheckReport) -> tuple[str | None, str | None, str | None]:
    """(address, iface, why not): the IPv4 address of the interface the job uses on this host: the inventory's
    `iface`, else the one that reached the master in the check, else the host's only non-loopback address."""
    facts = report.facts.get(host.name)
    if facts is None:
        return None, None, "no facts (unreachable)"
    iface = host.iface or (report.reach[host.name].iface if host.name in report.reach else None)
    if iface:
        addrs = ipv4_of(facts, iface)
        return (addrs[0], iface, None) if addrs else (None, iface, f"interface {iface} has no IPv4 address")
    candidates = [
        (a.split("/")[0], entry.get("name"))
        for entry in facts.get("interfaces") or []
        if entry.get("up") and entry.get("name") != "lo"
        for a in entry.get("ipv4") or []
        if not a.startswith("127.")
    ]
    if len(candidates) == 1:
        return candidates[0][0], candidates[0][1], None
    return None, None, "several interfaces and no 'iface' in the inventory" if candidates else "no IPv4 address"


def _json_line(process: Process, timeout: float) -> dict | None:
    """The next JSON object on the process's stdout, or None (timeout, or the stream ended)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        item = process.readline(timeout=left)
        if item is None:
            return None
        stream, line = item
        if stream != "stdout":
            continue
        if line is None:
            return None
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data


def disjoint_rounds(pairs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Pairs (in order) packed greedily into rounds in which no host appears twice."""
    rounds: list[list[tuple[str, str]]] = []
    for pair in pairs:
        for r in rounds:
            if not any(set(pair) & set(other) for other in r):
                r.append(pair)
                break
        else:
            rounds.append([pair])
    return rounds


def measure_links(fleet: Fleet, report: CheckReport, hosts: list[Host], seconds: float, progress=None, suspects=None) -> LinkMatrix:
    """Start an agent on every host, play the round-robin schedule, stop the agents.

    `suspects(matrix)` -> pairs: links that look slow are measured once more (in rounds of disjoint pairs) and
    keep their better figure, so a burst of someone else's traffic or CPU load does not blame a host."""
    started = time.monotonic()
    addresses, ifaces, errors = {}, {}, {}
    for host in hosts:
        addr, iface, why = cluster_address(host, report)
        ifaces[host.name] = iface
        if addr is None:
            errors[host.name] = why
        else:
            addresses[host.name] = addr
    # one round's transfers, plus connection setup and python start, plus slack
    per_round = 2 * seconds + 10.0
    lifetime = (len(hosts) + 1) * per_round + 60
    agents: dict[str, Process] = {}
    ports: dict[str, int] = {}
    payload = pyrun.payload("linkagent")

    def start(host: Host):
        process = fleet.start(host, pyrun.command(host, "serve", "--bind", addresses[host.name], "--lifetime", str(int(lifetime))))
        process.write(payload)
        return process

    try:
        for host in hosts:  # starting is asynchronous: all agents start at once
            if host.name in addresses:
                try:
                    agents[host.name] = start(host)
                except Exception as exc:  # noqa: BLE001 - unreachable now: that host's links fail, not the check
                    errors[host.name] = f"could not start the link agent: {exc}"
        for name, process in list(agents.items()):
            hello = _json_line(process, fleet.timeouts.command)
            if hello and hello.get("ok"):
                ports[name] = int(hello["port"])
            else:
                errors[name] = (hello or {}).get("error") or "the link agent did not start"
        names = [h.name for h in hosts]
        rounds = round_robin(names)
        matrix = LinkMatrix(names, addresses, ifaces, seconds, rounds, errors=errors)
        _play(matrix, rounds, agents, ports, per_round, progress, "round")
        again = [p for p in (suspects(matrix) if suspects else []) if p[0] in ports and p[1] in ports]
        if again:
            first = dict(matrix.links)
            matrix.retested = [list(p) for p in again]
            _play(matrix, disjoint_rounds(again), agents, ports, per_round, progress, "re-test")
            for key, old in first.items():  # the better of the two figures: slowness must be confirmed
                new = matrix.links.get(key)
                if new is not None and old.gbps is not None and (new.gbps is None or old.gbps > new.gbps):
                    matrix.links[key] = old
    finally:
        for process in agents.values():
            try:
                process.close_stdin()
            except Exception:  # noqa: BLE001 - the agent also stops by itself after its lifetime
                pass
        for process in agents.values():
            try:
                process.wait(timeout=5)
            except Exception:  # noqa: BLE001
                process.terminate()
    matrix.elapsed = time.monotonic() - started
    return matrix


def _play(matrix: LinkMatrix, rounds, agents: dict[str, Process], ports: dict[str, int], per_round: float, progress, what: str) -> None:
    """Each round: tell the first host of every pair to measure its link to the second; wait for all of them."""
    errors, addresses, seconds = matrix.errors, matrix.addresses, matrix.seconds
    for number, pairs in enumerate(rounds, 1):
        if progress:
            progress(f"links: {what} {number}/{len(rounds)}")
        asked = []
        for a, b in pairs:
            if a in ports and b in ports:
                command = {"op": "measure", "id": f"{a}>{b}", "peer": addresses[b], "port": ports[b], "seconds": seconds, "pings": PINGS}
                try:
                    agents[a].write((json.dumps(command) + "\n").encode())
                    asked.append((a, b))
                except Exception as exc:  # noqa: BLE001
                    _fail(matrix, a, b, f"{a}: {exc}")
            else:
                _fail(matrix, a, b, "; ".join(f"{h}: {errors.get(h, 'no agent')}" for h in (a, b) if h not in ports))
        for a, b in asked:
            answer = _json_line(agents[a], per_round)
            if answer is None:
                _fail(matrix, a, b, f"{a}'s link agent did not answer within {per_round:g}s")
                continue
            error = answer.get("error")
            rtt = answer.get("rtt_ms"), answer.get("rtt_min_ms")
            matrix.links[(a, b)] = Link(a, b, answer.get("tx_gbps"), *rtt, error)
            matrix.links[(b, a)] = Link(b, a, answer.get("rx_gbps"), *rtt, error)


def _fail(matrix: LinkMatrix, a: str, b: str, error: str) -> None:
    matrix.links[(a, b)] = Link(a, b, error=error)
    matrix.links[(b, a)] = Link(b, a, error=error)
