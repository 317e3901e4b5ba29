"""Which host holds the gang back: pure rules over what each host's agent samples (mnft.onhost.samples).

A gang runs at its slowest member's pace. In synchronous training every rank's *step* time is the same — the fast
ranks wait in the collectives for the slow one — so the straggler shows in its *compute* time (the step minus
data loading and time blocked in collectives, from the recipes' per-rank timers, mnft/recipes/timing.py): a host
whose ranks compute above `factor` × the median host for a sustained window is named. For any job (a user's own
script has no per-rank timers) a host whose GPU utilisation is far below the others' is named too: it is waiting
for something the others are not (its data, its disk), while the others' GPUs keep busy in NCCL's kernels. CPU
use is sampled and shown, but never names a host: on CPU (gloo) the ranks that wait for a straggler block and use
*less* CPU than it, so a low CPU figure points at the fast hosts, not the slow one.

A sample, per host: {"t": epoch seconds, "cpu": % of the host's CPUs busy, "run_cpu": % of the CPUs the run may
use that its processes used, "gpus": [{"index", "util", "mem_mib"}], "ranks": {rank: {"step", "compute_s",
"step_s", "comm_s", "n"}}} with each rank's median over its last steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

FACTOR = 1.2  # a host whose compute time is above this × the median host's is slow
UTIL_RATIO = 0.5  # a host whose utilisation is below this × the median host's is idle
UTIL_FLOOR = 20.0  # … when the median host is at least this busy (%): below it, nobody is working
SUSTAIN = 2  # samples in a row (a few seconds each) before a host is named


@dataclass(frozen=True)
class Straggler:
    host: str
    kind: str  # "compute" | "utilisation"
    ratio: float  # the host's figure / the median host's
    why: str

    def to_json(self) -> dict:
        return {"host": self.host, "kind": self.kind, "ratio": round(self.ratio, 3), "why": self.why}


def compute_of(sample: dict) -> float | None:
    """A host's compute time per step: its slowest rank's (median over that rank's window)."""
    values = [r.get("compute_s") for r in (sample.get("ranks") or {}).values() if isinstance(r.get("compute_s"), (int, float))]
    return max(values) if values else None


def utilisation_of(sample: dict) -> float | None:
    """A host's mean GPU utilisation (%), None without GPUs."""
    gpus = [g.get("util") for g in sample.get("gpus") or [] if isinstance(g.get("util"), (int, float))]
    return sum(gpus) / len(gpus) if gpus else None


def find(samples: dict[str, dict], factor: float = FACTOR, util_ratio: float = UTIL_RATIO) -> list[Straggler]:
    """The hosts that are slow or idle compared with the median host, in this one set of samples."""
    out: list[Straggler] = []
    compute = {h: c for h, c in ((h, compute_of(s)) for h, s in samples.items()) if c is not None}
    if len(compute) >= 2:
        median = statistics.median(compute.values())
        for host, value in compute.items():
            if median > 0 and value > factor * median:
                out.append(Straggler(host, "compute", value / median,
                                     f"compute {value / median:.1f}× the median host ({value * 1000:.0f} ms vs {median * 1000:.0f} ms per step)"))
    util = {h: u for h, u in ((h, utilisation_of(s)) for h, s in samples.items()) if u is not None}
    if len(util) >= 2:
        median = statistics.median(util.values())
        named = {s.host for s in out}
        for host, value in util.items():
            if host not in named and median >= UTIL_FLOOR and value < util_ratio * median:
                out.append(Straggler(host, "utilisation", value / median, f"GPU utilisation {value:.0f}% vs {median:.0f}% on the median host"))
    return sorted(out, key=lambda s: (-abs(s.ratio - 1), s.host))


class Watch:
    """Names a host only when it is found in `sustain` sets of samples in a row (one noisy reading is not a
    straggler), and clears it only when it is not found in `sustain` sets in a row (a host near the threshold
    does not flap in and out). Feed it each host's newest sample as it comes; `current` is what to show now."""

    def __init__(self, sustain: int = SUSTAIN, factor: float = FACTOR) -> None:
        self.sustain, self.factor = sustain, factor
        self.latest: dict[str, dict] = {}
        self.streak: dict[str, int] = {}  # host -> sets of samples in a row it was found slow
        self.clear: dict[str, int] = {}  # named host -> sets in a row it was not
        self.named: dict[str, Straggler] = {}
        self.seen: dict[str, dict] = {}  # host -> the first time it was named, for the run record

    @property
    def current(self) -> list[Straggler]:
        return sorted(self.named.values(), key=lambda s: (-abs(s.ratio - 1), s.host))

    def update(self, host: str, sample: dict) -> list[Straggler]:
        self.latest[host] = sample
        found = {s.host: s for s in find(self.latest, self.factor)}
        for name in set(self.streak) | set(self.named):
            if name in found:
                self.clear.pop(name, None)
            else:
                self.streak.pop(name, None)
                self.clear[name] = self.clear.get(name, 0) + 1
                if name in self.named and self.clear[name] >= self.sustain:
                    del self.named[name], self.clear[name]
        for name, straggler in found.items():
            self.streak[name] = self.streak.get(name, 0) + 1
            if self.streak[name] >= self.sustain or name in self.named:
                self.named[name] = straggler
                self.seen.setdefault(name, {**straggler.to_json(), "first_seen": sample.get("t")})
        return self.current


def text(stragglers: list[Straggler]) -> str:
    return "; ".join(f"straggler {s.host}: {s.why}" for s in stragglers)
