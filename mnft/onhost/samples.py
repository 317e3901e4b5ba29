"""A run's samples (mnft.onhost.agent): what straggler detection needs from this host, sent while attached and shown
by `status`. Standard library only.
"""

import glob
import json
import os
import time

from .follow import _Tail
from .rungpus import gpu_util
from .runfiles import _path
from .runprocs import run_pids


SAMPLE_EVERY = 5.0  # seconds between an attached run's samples
WINDOW = 20  # steps per rank a sample's medians are taken over


def _cpu_times():
    """(all jiffies, idle jiffies) of the host from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return sum(values), values[3] + (values[4] if len(values) > 4 else 0)


def _process_ticks(pids):
    """CPU clock ticks (user + system) the processes used so far."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total


def _median(values):
    values = sorted(values)
    n = len(values)
    return (values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2) if n else None


def rank_window(lines_by_rank):
    """Per rank, the medians of its last steps' timings (the recipes' timings-rank<R>.jsonl lines)."""
    out = {}
    for rank, records in lines_by_rank.items():
        records = list(records)[-WINDOW:]
        if not records:
            continue
        out[str(rank)] = {"step": records[-1].get("step"), "n": len(records),
                          **{k: _median([r[k] for r in records if isinstance(r.get(k), (int, float))]) for k in ("step_s", "compute_s", "comm_s")}}
    return out


def _timing_record(line):
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "step" in data and "compute_s" in data and "rank" in data else None


class Sampler:
    """What straggler detection needs from this host: CPU use (the host's, and the run's share of the CPUs it may
    use), GPU use (nvidia-smi), and each local rank's recent step timings (the recipes' timing files)."""

    def __init__(self, tag, timings=None):
        import collections

        self.tag = tag
        self.pattern = _path(timings) if timings else None
        self.tails = {p: _Tail(p, from_end=True) for p in glob.glob(self.pattern)} if self.pattern else {}
        self.window = collections.defaultdict(lambda: collections.deque(maxlen=WINDOW))
        self.prev = None
        try:
            self.cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = os.cpu_count() or 1

    def _timings(self):
        if self.pattern:
            for path in glob.glob(self.pattern):
                if path not in self.tails:
                    self.tails[path] = _Tail(path)  # a file that appeared after the start: all of it is this run's
            for tail in self.tails.values():
                for line in tail.lines():
                    record = _timing_record(line)
                    if record is not None:
                        self.window[record["rank"]].append(record)
        return rank_window(self.window)

    def sample(self):
        now = time.time()
        out = {"t": now, "cpu": None, "run_cpu": None}
        try:
            total, idle = _cpu_times()
        except (OSError, ValueError, IndexError):
            total = idle = None
        ticks = _process_ticks(run_pids(self.tag)) if self.tag else 0
        if self.prev is not None and total is not None and self.prev[1] is not None:
            then, prev_total, prev_idle, prev_ticks = self.prev
            if total > prev_total:
                out["cpu"] = round(100.0 * (1 - (idle - prev_idle) / float(total - prev_total)), 1)
            if now > then:
                out["run_cpu"] = round(100.0 * (ticks - prev_ticks) / os.sysconf("SC_CLK_TCK") / ((now - then) * self.cpus), 1)
        self.prev = (now, total, idle, ticks)
        out["gpus"] = gpu_util()
        out["ranks"] = self._timings()
        return out
