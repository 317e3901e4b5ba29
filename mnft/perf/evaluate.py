"""Pure rules of the perf check: measurements in, a row per host and the problems (with a fix to try) out.

Thresholds are relative to the cluster's own median (a link below `link_ratio` × the median link, a host's
compute below `compute_ratio` × the median host), plus absolute floors an inventory may set (`perf:` in mnft
YAML, `mnft_perf` in Ansible's `all: vars:`), because a cluster that is uniformly slow has a healthy median.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields

from mnft.check.findings import Problem
from mnft.core.errors import InputError
from mnft.core.output import command


@dataclass(frozen=True)
class Thresholds:
    link_ratio: float = 0.5  # a link below this × the median link fails
    compute_ratio: float = 0.5  # a host below this × the median host's TFLOP/s fails
    rtt_ratio: float = 5.0  # a pair's RTT above this × the median (and 1 ms above it) is a warning
    busbw_ratio: float = 0.25  # all_reduce busbw below this × the slowest link (GB/s) is a warning
    min_link_gbps: float | None = None  # absolute floors (None: none)
    min_busbw_gbps: float | None = None  # GB/s at the largest size measured, nccl-tests' busbw
    min_tflops: float | None = None  # per device
    max_rtt_ms: float | None = None

    @classmethod
    def from_inventory(cls, values: dict | None, where: str = "inventory") -> "Thresholds":
        """The inventory's `perf:` mapping; an unknown key or a bad number is bad input naming the key."""
        values = values or {}
        known = {f.name for f in fields(cls)}
        for key, value in values.items():
            if key not in known:
                raise InputError(f"{where}: perf: unknown key {key!r} (known: {', '.join(sorted(known))})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
                raise InputError(f"{where}: perf: key {key!r}: {value!r} must be a number > 0")
        return cls(**{k: float(v) for k, v in values.items()})


@dataclass
class HostRow:
    host: str
    iface: str | None = None
    address: str | None = None
    slowest: tuple[str, str, float] | None = None  # (src, dst, Gbit/s) of this host's slowest link
    worst_rtt_ms: float | None = None
    tflops: float | None = None  # its slowest device
    device: str | None = None
    verdict: str = "ok"  # ok | slow | failed | skipped

    def to_json(self) -> dict:
        return {"host": self.host, "iface": self.iface, "address": self.address,
                "slowest_link": {"src": self.slowest[0], "dst": self.slowest[1], "gbps": self.slowest[2]} if self.slowest else None,
                "worst_rtt_ms": self.worst_rtt_ms, "tflops": self.tflops, "device": self.device, "verdict": self.verdict}


@dataclass
class Evaluation:
    rows: dict[str, HostRow]
    problems: list[Problem] = field(default_factory=list)
    link_median_gbps: float | None = None
    rtt_median_ms: float | None = None
    compute_median_tflops: float | None = None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(gbps: float) -> str:
    return f"{gbps:.3g} Gbit/s"


def link_cut(median: float | None, thresholds: Thresholds) -> float | None:
    """The Gbit/s below which a link is slow: link_ratio × the median, or the inventory's floor if higher."""
    if median is None:
        return thresholds.min_link_gbps
    cut = thresholds.link_ratio * median
    return max(cut, thresholds.min_link_gbps) if thresholds.min_link_gbps is not None else cut


def slow_links(links: dict[tuple[str, str], dict], thresholds: Thresholds) -> set[tuple[str, str]]:
    """The directed links below the cut (links: (src, dst) -> {"gbps": …})."""
    measured = {k: v["gbps"] for k, v in links.items() if v.get("gbps") is not None}
    cut = link_cut(_median(list(measured.values())), thresholds)
    return {k for k, gbps in measured.items() if cut is not None and gbps < cut}


def evaluate(hosts: list[str], links: dict[tuple[str, str], dict], ranks: list[dict], allreduce: list[dict],
             thresholds: Thresholds, skipped: dict[str, str] | None = None) -> Evaluation:
    """links: (src, dst) -> {"gbps", "rtt_ms", "error"}; ranks: rank 0's per-rank records (host, compute, threads,
    cpus, device…); allreduce: per size {"bytes", "busbw_gbps", …}; skipped: host -> why it was not measured."""
    rows = {h: HostRow(h) for h in hosts}
    problems: list[Problem] = []
    ev = Evaluation(rows, problems)
    for name, why in (skipped or {}).items():
        if name in rows:
            rows[name].verdict = "skipped"
            problems.append(Problem(name, "perf", f"not measured: {why}", "fix what the check reports for this host first"))

    # ------------------------------------------------------------ links
    measured = {k: v for k, v in links.items() if v.get("gbps") is not None}
    ev.link_median_gbps = _median([v["gbps"] for v in measured.values()])
    floor = thresholds.min_link_gbps
    cut = link_cut(ev.link_median_gbps, thresholds)
    slow = slow_links(links, thresholds)
    for (src, dst), v in links.items():
        for name in (src, dst):
            row = rows.get(name)
            if row is None:
                continue
            if v.get("gbps") is not None and (row.slowest is None or v["gbps"] < row.slowest[2]):
                row.slowest = (src, dst, v["gbps"])
            if v.get("rtt_ms") is not None and (row.worst_rtt_ms is None or v["rtt_ms"] > row.worst_rtt_ms):
                row.worst_rtt_ms = v["rtt_ms"]
    failed_pairs = sorted({tuple(sorted(k)) for k, v in links.items() if v.get("gbps") is None and v.get("error")})
    for a, b in failed_pairs:
        error = links.get((a, b), {}).get("error") or links.get((b, a), {}).get("error")
        for name in (a, b):
            problems.append(Problem(name, "link", f"the link test between {a} and {b} failed: {error}",
                                    "check that the hosts reach each other on the cluster interface (ping, nft list ruleset)"))
    ev_culprits = _culprits(hosts, slow, measured)
    why_cut = ""
    if cut is not None:
        why_cut = (f"below the inventory's floor min_link_gbps {floor:g}" if floor is not None and cut == floor
                   else f"below {thresholds.link_ratio:.0%} of the median {_fmt(ev.link_median_gbps)}")
    for name in ev_culprits:
        mine = sorted((k for k in slow if name in k), key=lambda k: measured[k]["gbps"])
        shown = ", ".join(f"{s}→{d} {_fmt(measured[(s, d)]['gbps'])}" for s, d in mine[:4]) + (" …" if len(mine) > 4 else "")
        directions = {"in" if d == name else "out" for _, d in mine}
        which = {"in": "into", "out": "out of"}.get(directions.pop(), "into and out of") if len(directions) == 1 else "into and out of"
        problems.append(Problem(name, "link", f"slow links {which} {name} ({why_cut}): {shown}",
                                "check this host's NIC and cable (ethtool: speed, errors), a traffic shaper (tc qdisc show), "
                                "and that 'iface' is the fast cluster network, not the management one"))
    for a, b in sorted({tuple(sorted(k)) for k in slow if not set(k) & set(ev_culprits)}):
        shown = ", ".join(f"{s}→{d} {_fmt(measured[(s, d)]['gbps'])}" for s, d in ((a, b), (b, a)) if (s, d) in slow)
        for name in (a, b):
            problems.append(Problem(name, "link", f"slow link between {a} and {b} ({why_cut}): {shown}",
                                    "check the cable/switch port between these two hosts (ethtool -S, switch counters) and their routes (ip route get)"))
    # RTT: the fastest of a pair's round trips (the path, not a busy scheduler's noise) against the median pair;
    # a warning, since latency matters for small collectives more than for bandwidth-bound training
    pair_rtts = {tuple(sorted(k)): v.get("rtt_min_ms", v.get("rtt_ms")) for k, v in links.items() if v.get("rtt_min_ms", v.get("rtt_ms")) is not None}
    ev.rtt_median_ms = _median(list(pair_rtts.values()))
    for (a, b), rtt in sorted(pair_rtts.items()):
        high = ev.rtt_median_ms is not None and len(pair_rtts) > 2 and rtt > thresholds.rtt_ratio * ev.rtt_median_ms and rtt > ev.rtt_median_ms + 1.0
        over = thresholds.max_rtt_ms is not None and rtt > thresholds.max_rtt_ms
        if high or over:
            why = f"above the inventory's max_rtt_ms {thresholds.max_rtt_ms:g}" if over else f"the median pair's is {ev.rtt_median_ms:.3f} ms"
            for name in (a, b):
                problems.append(Problem(name, "rtt", f"round trip {a}↔{b} at least {rtt:.3f} ms ({why})",
                                        "look for a congested or routed path between them (traceroute, switch counters)",
                                        "error" if over else "warning"))

    # ------------------------------------------------------------ compute
    per_host: dict[str, tuple[float, str]] = {}
    for r in ranks:
        name, compute = r.get("host_name") or r.get("host"), r.get("compute") or {}
        if name in rows and isinstance(compute.get("tflops"), (int, float)):
            device = r.get("device_name") if r.get("device_name") not in (None, "cpu") else r.get("device", "cpu")
            label = f"{r.get('device')} {device}".strip() if device != r.get("device") else str(device)
            if name not in per_host or compute["tflops"] < per_host[name][0]:
                per_host[name] = (compute["tflops"], label)
    for name, (tflops, label) in per_host.items():
        rows[name].tflops, rows[name].device = tflops, label
    ev.compute_median_tflops = _median([t for t, _ in per_host.values()])
    for name, (tflops, label) in per_host.items():
        low = len(per_host) > 2 and ev.compute_median_tflops and tflops < thresholds.compute_ratio * ev.compute_median_tflops
        under = thresholds.min_tflops is not None and tflops < thresholds.min_tflops
        if low or under:
            why = (f"below the inventory's floor min_tflops {thresholds.min_tflops:g}" if under
                   else f"{tflops / ev.compute_median_tflops:.0%} of the median host's {ev.compute_median_tflops:.3g}")
            problems.append(Problem(name, "compute", f"{label}: {tflops:.3g} TFLOP/s matmul, far below the others ({why})",
                                    "look for other processes on this host (top, nvidia-smi), a throttled device "
                                    "(nvidia-smi -q -d PERFORMANCE,CLOCK: thermal/power cap), or a CPU governor in powersave"))
    # oversubscribed CPUs: ranks × intra-op threads above the host's cores (the testbed's 10× case, docs/perf.md)
    by_host: dict[str, list[dict]] = {}
    for r in ranks:
        if r.get("device") == "cpu" and (r.get("host_name") or r.get("host")) in rows:
            by_host.setdefault(r.get("host_name") or r.get("host"), []).append(r)
    for name, rs in by_host.items():
        threads = sum(int(r.get("threads") or 0) for r in rs)
        cpus = rs[0].get("cpus")
        if isinstance(cpus, int) and threads > cpus:
            problems.append(Problem(name, "threads", f"{len(rs)} rank(s) × {rs[0].get('threads')} intra-op threads = {threads} > {cpus} CPUs: "
                                    "threads wait for each other on oversubscribed cores",
                                    f"set OMP_NUM_THREADS={max(1, cpus // len(rs))} for the run ({command('train --env OMP_NUM_THREADS=…')})", "warning"))

    # ------------------------------------------------------------ collectives
    if allreduce:
        largest = allreduce[-1]
        busbw = largest.get("busbw_gbps")
        if thresholds.min_busbw_gbps is not None and isinstance(busbw, (int, float)) and busbw < thresholds.min_busbw_gbps:
            problems.append(Problem("*", "busbw", f"all_reduce busbw {busbw:.3g} GB/s at {largest['bytes'] >> 20} MiB is below the inventory's floor min_busbw_gbps {thresholds.min_busbw_gbps:g}",
                                    "run with NCCL_DEBUG=INFO and check the transport it picks (IB/RoCE vs socket), NCCL_SOCKET_IFNAME / NCCL_IB_HCA"))
        slowest = min((v["gbps"] for v in measured.values()), default=None)
        if isinstance(busbw, (int, float)) and slowest and busbw < thresholds.busbw_ratio * slowest / 8 and len(hosts) > 1:
            problems.append(Problem("*", "busbw", f"all_reduce busbw {busbw:.3g} GB/s is far below what the slowest link carries ({slowest / 8:.3g} GB/s)",
                                    "the collectives may use another interface than the link test: check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME "
                                    "(mnft sets them from 'iface'), NCCL_DEBUG=INFO", "warning"))

    for p in problems:
        row = rows.get(p.host)
        if row is not None and row.verdict != "skipped":
            if p.severity == "error":
                row.verdict = "failed" if p.field in ("link",) and "failed" in p.message else "slow"
    return ev


def _culprits(hosts: list[str], slow: set[tuple[str, str]], measured: dict) -> list[str]:
    """Hosts to blame for slow links: a host with slow links to more than half of its (not yet blamed) peers,
    worst first; a slow pair not explained by a blamed host is reported as that pair. With two hosts nobody is
    blamed alone (one pair cannot say which end is slow)."""
    blamed: list[str] = []
    while True:
        best, best_key = None, None
        for name in hosts:
            if name in blamed:
                continue
            peers = {d if s == name else s for s, d in measured if name in (s, d)} - set(blamed)
            bad = {d if s == name else s for s, d in slow if name in (s, d)} - set(blamed)
            if len(peers) < 2 or not bad or len(bad) * 2 <= len(peers):
                continue
            key = (len(bad) / len(peers), len(bad))
            if best_key is None or key > best_key:
                best, best_key = name, key
        if best is None:
            return blamed
        blamed.append(best)
