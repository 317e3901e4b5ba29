"""`check --perf`: after the ordinary check, the link matrix, then compute and collectives with torch.distributed.

The collectives' ranks start held before the rendezvous and are released together once every host's are ready
(a host whose ranks cannot start fails alone). Importing torch is most of a rank's start-up: where every host has
cores to spare (`overlap_fits`) the ranks start with the link matrix and import torch while the links are measured;
elsewhere (hosts sharing cores, like the simulated cluster) after it, so the imports never slow a transfer. Compute
and the all_reduce sweep always run after the links, on an otherwise idle cluster.

Costs scale with the host count: each link direction gets `schedule.link_seconds(n)` (0.5 s for 2 hosts, 0.21 s
for 8, 0.1 s for 64: 63 rounds ≈ 13 s), the all_reduce sweep a fixed time budget (sizes stop early when it is
spent), compute `compute_seconds` per rank (CPU ranks take turns, GPUs measure at once).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mnft.check.findings import CheckReport
from mnft.core.errors import InputError
from mnft.core.output import command
from mnft.hosts.fleet import Fleet
from mnft.perf import schedule
from mnft.perf.collectives import CollectiveRun, Pending, start_allreduce
from mnft.perf.evaluate import Evaluation, Thresholds, evaluate, slow_links
from mnft.perf.links import LinkMatrix, cluster_address, measure_links


@dataclass(frozen=True)
class PerfOptions:
    link_budget: float = 3.0  # seconds of transfers for the whole matrix (spread over rounds and directions)
    link_seconds: float | None = None  # per direction and pair; default from link_budget and the host count
    collective_budget: float = 2.0  # seconds for the all_reduce sweep
    # up to every_size_hosts hosts every size (1 MiB .. 256 MiB) is measured even past the budget, within
    # every_size_limit seconds (a slow link must not make the check take minutes)
    every_size_hosts: int = 4
    every_size_limit: float = 12.0
    smallest: int = schedule.MiB
    largest: int = 256 * schedule.MiB
    compute_seconds: float = 0.3
    torchrun_timeout: float = 120.0  # the whole collectives phase from its start; past it every host's ranks are killed
    collectives: bool = True
    # "direct": the ranks with the environment torchrun gives them, without its agent (one torch start per rank,
    # not two; the figures are the same); "torchrun": through torchrun, as training starts them
    launcher: str = "direct"
    # "on": the ranks start (import torch) while the links are measured, held before the rendezvous; "off": they
    # start after the links; "auto": on when every host has cores to spare for it (overlap_fits)
    overlap: str = "auto"

    def __post_init__(self) -> None:
        for name in ("link_budget", "collective_budget", "every_size_limit", "compute_seconds", "torchrun_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"perf option {name}: {value!r} must be a number > 0")
        if self.launcher not in ("torchrun", "direct"):
            raise InputError(f"--perf-launcher {self.launcher!r}: use torchrun or direct")
        if self.overlap not in ("auto", "on", "off"):
            raise InputError(f"perf option overlap: {self.overlap!r}: use auto, on or off")
        if self.link_seconds is not None and not (isinstance(self.link_seconds, (int, float)) and 0 < self.link_seconds <= 60):
            raise InputError(f"perf option link_seconds: {self.link_seconds!r} must be within (0, 60]")


@dataclass
class PerfReport:
    hosts: list[str]
    thresholds: Thresholds
    links: LinkMatrix | None = None
    collectives: CollectiveRun | None = None
    skipped_collectives: str | None = None
    overlap: bool = False  # the ranks started with the link matrix
    evaluation: Evaluation | None = None
    elapsed: float = 0.0
    artifacts: dict[str, str] = field(default_factory=dict)  # e.g. {"heatmap": path}

    @property
    def problems(self):
        return self.evaluation.problems if self.evaluation else []

    def failed(self) -> bool:
        return any(p.severity == "error" for p in self.problems)

    def ranks(self) -> list[dict]:
        return list((self.collectives.figures or {}).get("ranks") or []) if self.collectives else []

    def allreduce(self) -> list[dict]:
        return list((self.collectives.figures or {}).get("allreduce") or []) if self.collectives else []

    def to_json(self) -> dict:
        ev = self.evaluation
        c = self.collectives
        return {
            "elapsed_s": round(self.elapsed, 3),
            "thresholds": self.thresholds.__dict__,
            "medians": {"link_gbps": ev.link_median_gbps, "rtt_ms": ev.rtt_median_ms, "tflops": ev.compute_median_tflops} if ev else None,
            "hosts": {name: row.to_json() for name, row in ev.rows.items()} if ev else {},
            "links": self.links.to_json() if self.links else None,
            "collectives": None if c is None else {
                "backend": (c.figures or {}).get("backend"),
                "world_size": (c.figures or {}).get("world_size"),
                "allreduce": self.allreduce(),  # per size: bytes, iters, time_us, algbw_gbps, busbw_gbps (GB/s)
                "dropped_sizes": c.dropped(),  # asked for, not reached within the sweep's time (budget, or limit up to every_size_hosts)
                "ranks": self.ranks(),
                "error": c.error,
                "outcomes": {n: {"status": r.status.value, "exit_code": r.exit_code, "error": r.error or None} for n, r in c.outcomes.items()},
                "elapsed_s": round(c.elapsed, 3),  # from the ranks' start, which overlaps the link matrix
                "launcher": c.launcher,
                "ready_wait_s": c.ready_wait,  # how long the links' end waited for the ranks' start-up
                "not_started": c.not_started,
            },
            "collectives_skipped": self.skipped_collectives,
            "overlap": self.overlap,
            "problems": [p.__dict__ for p in self.problems],
            "artifacts": self.artifacts,
        }


def collectives_blocker(report: CheckReport) -> str | None:
    """Why torchrun cannot run across the cluster now, or None."""
    inventory = report.inventory
    missing = [h.name for h in inventory.hosts if h.name not in report.facts]
    if missing:
        return f"hosts without facts (unreachable): {', '.join(missing)}"
    no_torch = [h.name for h in inventory.hosts if not (report.facts[h.name].get("torch") or {}).get("version")]
    if no_torch:
        return f"torch is not installed on {', '.join(no_torch)}"
    if report.master_addr is None:
        return "the master has no address the peers can use"
    if report.port_free is False:
        return f"the rendezvous port {report.port} is not free on the master"
    unreached = [name for name, reach in report.reach.items() if not reach.ok]
    if unreached:
        return f"hosts that cannot reach the master's rendezvous port: {', '.join(unreached)}"
    return None


SPARE_CPUS = 2  # what a host's link agent needs beside its ranks: one measuring thread and the kernel's network work


def overlap_fits(report: CheckReport, hosts: list) -> bool:
    """Whether the ranks may import torch while the links are measured without slowing the link agents: every
    host has SPARE_CPUS more CPUs than it runs ranks. Otherwise the imports would take CPU from the transfers
    (the simulated cluster: every host on the same two cores) and the link figures would measure the import."""
    for host in hosts:
        cpus = (report.facts.get(host.name) or {}).get("cpu_count")
        if not isinstance(cpus, int) or cpus < host.slots + SPARE_CPUS:
            return False
    return bool(hosts)


def measure(fleet: Fleet, report: CheckReport, options: PerfOptions = PerfOptions(),
            progress: Callable[[str], None] | None = None, side_work: Callable[[], None] | None = None) -> PerfReport:
    """The link matrix, then compute and collectives. `side_work` (the controller's own, e.g. importing the
    plotting library) runs in a thread after the links while the ranks start, and ends before they are released:
    it never runs while something is measured."""
    started = time.monotonic()
    inventory = fleet.inventory
    thresholds = Thresholds.from_inventory(getattr(inventory, "perf", None), str(inventory.path or "inventory"))
    names = [h.name for h in inventory.hosts]
    perf = PerfReport(names, thresholds)
    reachable = [h for h in inventory.hosts if h.name in report.facts]
    skipped = {h.name: report.outcomes[h.name].error or report.outcomes[h.name].status.value for h in inventory.hosts if h.name not in report.facts}
    seconds = options.link_seconds or schedule.link_seconds(len(reachable), options.link_budget)
    def suspects(matrix: LinkMatrix) -> list[tuple[str, str]]:
        links = {k: {"gbps": v.gbps} for k, v in matrix.links.items()}
        return sorted({tuple(sorted(k)) for k in slow_links(links, thresholds)})

    pending: Pending | None = None

    def start() -> Pending:
        if progress:
            progress(f"collectives: starting torch on every host ({options.launcher})" + (", held until the links are done" if overlap else ""))
        # the interface each host's link agent uses (as measure_links picks it); none for a single host
        ifaces = {h.name: cluster_address(h, report)[1] for h in reachable} if len(reachable) > 1 else {}
        sizes = schedule.message_sizes(options.smallest, options.largest)
        return start_allreduce(fleet, report.master_addr, report.port, ifaces, sizes, options.collective_budget,
                               options.compute_seconds, options.torchrun_timeout, options.launcher,
                               options.every_size_limit if len(inventory.hosts) <= options.every_size_hosts else None)

    perf.skipped_collectives = collectives_blocker(report) if options.collectives else "--no-collectives"
    overlap = perf.skipped_collectives is None and (options.overlap == "on" or options.overlap == "auto" and overlap_fits(report, reachable))
    perf.overlap = overlap
    if overlap:
        pending = start()
    try:
        if progress:
            progress(f"links: {len(reachable)} hosts, {seconds:g}s per direction")
        perf.links = measure_links(fleet, report, reachable, seconds, progress, suspects) if len(reachable) > 1 else None
        if perf.skipped_collectives is None and not overlap:
            pending = start()
        side = threading.Thread(target=side_work, name="mnft-perf-side", daemon=True) if side_work else None
        if side:
            side.start()
        if pending is not None:
            perf.collectives = pending.release(progress, before_release=side.join if side else None)
            pending = None
        if side:
            side.join()
    finally:
        if pending is not None:  # the links raised: nothing may stay behind on the hosts
            pending.cancel("the link matrix failed")
    if perf.collectives is not None:
        for rank in perf.ranks():  # the inventory's name for the host a rank ran on (node_rank order)
            node = rank.get("node_rank")
            if isinstance(node, int) and 0 <= node < len(inventory.hosts):
                rank["host_name"] = inventory.hosts[node].name
    links = {}
    if perf.links:
        links = {k: {"gbps": v.gbps, "rtt_ms": v.rtt_ms, "rtt_min_ms": v.rtt_min_ms, "error": v.error} for k, v in perf.links.links.items()}
        skipped.update({n: why for n, why in perf.links.errors.items() if n not in skipped})
    perf.evaluation = evaluate(names, links, perf.ranks(), perf.allreduce(), thresholds, skipped)
    if perf.links:
        for name, row in perf.evaluation.rows.items():
            row.iface, row.address = perf.links.ifaces.get(name), perf.links.addresses.get(name)
    if perf.collectives is not None and perf.collectives.figures is None:
        from mnft.check.findings import Problem

        for name, why in perf.collectives.not_started.items():  # these hosts, by name: the others only waited for them
            perf.evaluation.problems.append(Problem(name, "collectives", f"the torch worker did not start: {why}",
                                                    f"run `{inventory.host(name).python} -c 'import torch.distributed'` on {name}; "
                                                    f"{command('check')} shows its torch and Python"))
            perf.evaluation.rows[name].verdict = "failed"
        if not perf.collectives.not_started:
            perf.evaluation.problems.append(Problem("*", "collectives", f"the all_reduce job failed: {perf.collectives.error}",
                                                    f"run {command('train')} with a few steps to see the full error; check GLOO/NCCL_SOCKET_IFNAME and the firewall"))
    perf.elapsed = time.monotonic() - started
    return perf


def default_output_dir() -> Path:
    from mnft.run.records import runs_root

    return runs_root() / ("perf-" + time.strftime("%Y%m%d-%H%M%S"))
