"""What a run's (or session's) keeper watches on its GPUs (mnft.onhost.agent): how long they have been idle (IdleWatch,
the run's --idle-stop and the lab's idle_stop) and who else computes on them (CollisionWatch). Standard library only.
"""

import os
import time

from .rungpus import _user_of, gpu_processes, gpu_util
from .procs import foreign, process_facts
from .runfiles import _duration
from .leasefiles import update_in_place
from .labpolicy import lab_policy


IDLE_UTIL = 5.0  # % utilisation at or under which a GPU is idle (when its memory use does not change either)
IDLE_MEMORY_MIB = 1.0  # MiB its memory use may move between two samples and still count as not changing
IDLE_SAMPLE = 10.0  # seconds between two samples (shorter for a short --idle-stop: a sixth of it, at least 1 s)


def idle_sample(devices, before, gpus):
    """Whether this sample finds the devices idle: every one at or under IDLE_UTIL and its memory use within
    IDLE_MEMORY_MIB of the previous sample's (gpus: gpu_util()'s answer; before: the previous one). A device not
    answered for, or no previous sample, is not idle: what cannot be told is never idle."""
    if not devices or before is None:
        return False
    now = dict((g["index"], g) for g in gpus)
    then = dict((g["index"], g) for g in before)
    for index in devices:
        if index not in now or index not in then:
            return False
        if now[index]["util"] > IDLE_UTIL or abs(now[index]["mem_mib"] - then[index]["mem_mib"]) > IDLE_MEMORY_MIB:
            return False
    return True


# The lab's rules (idle_stop among them): mnft.onhost.labpolicy.


def idle_limit(asked, lab):
    """(seconds or None, how the limit is named in the reason, a note for the run's output or None): the run's
    own --idle-stop, lowered to the lab's idle_stop (which applies alone when it asked none)."""
    lab_s = lab.get("idle_stop")
    if lab_s and (not asked or lab_s < asked):
        said = "the lab's idle_stop %s, %s" % (_duration(lab_s), lab["path"])
        note = ("--idle-stop %s is more than this host allows: " % _duration(asked) if asked else "") + \
            "ended once its GPUs have all been idle for %s (%s)" % (_duration(lab_s), said)
        return lab_s, said, note
    if asked:
        return float(asked), "--idle-stop %s" % _duration(asked), None
    return None, None, None


def devices_of(spec):
    """The GPUs a run holds on this host: the spec's, else those its device leases name (mnft-dev-gpu<N>.json)."""
    import re

    named = [d for d in spec.get("devices") or [] if isinstance(d, int)]
    if named:
        return named
    found = []
    for path in spec.get("leases") or []:
        match = re.fullmatch(r"mnft-dev-gpu(\d+)\.json", os.path.basename(path))
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


class IdleWatch:
    """How long a run's (or session's) GPUs have been idle, sampled by its keeper; with the spec's `idle_stop`
    (seconds), the reason to end it once they have all been idle that long. Each change is written into the
    run's device leases (`idle_since`, `idle_s`: the idle seconds before it), which `mnft lab` shows and the
    usage log counts."""

    def __init__(self, spec, sample=gpu_util, clock=time.time):
        self.devices = [d for d in spec.get("devices") or [] if isinstance(d, int)]
        self.stop_after = float(spec.get("idle_stop") or 0)
        self.said = spec.get("idle_said") or "--idle-stop %s" % _duration(self.stop_after)
        self.every = max(1.0, min(IDLE_SAMPLE, self.stop_after / 6.0)) if self.stop_after else IDLE_SAMPLE
        self.leases = [p for p in spec.get("leases") or [] if "mnft-dev-gpu" in os.path.basename(p)]
        self.sample, self.clock = sample, clock
        self.before, self.sampled, self.next = None, None, 0.0
        self.since, self.total = None, 0.0

    def idle_for(self):
        return 0.0 if self.since is None else self.clock() - self.since

    def idle_seconds(self):
        return self.total + self.idle_for()

    def check(self):
        """Sample when due; the reason to end the run when its GPUs have been idle for idle_stop, else None."""
        now = self.clock()
        if now < self.next or not self.devices:
            return None
        self.next = now + self.every
        gpus = self.sample()
        idle = idle_sample(self.devices, self.before, gpus)
        then = self.sampled
        self.before, self.sampled = gpus or None, now
        if idle and self.since is None:
            self.since = then  # idle from the sample it is compared with
            self.mark()
        elif not idle and self.since is not None:
            self.total += now - self.since
            self.since = None
            self.mark()
        if self.stop_after and self.since is not None and now - self.since >= self.stop_after:
            return ("its GPUs were idle for %s (%s: utilisation at or under %g%% and memory use unchanged)"
                    % (_duration(now - self.since), self.said, IDLE_UTIL))
        return None

    def mark(self):
        """The idle state into each device lease the run holds (written in place, never truncated first: a reader
        never finds it empty)."""
        for path in self.leases:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError:
                continue
            try:
                update_in_place(fd, {"idle_since": self.since, "idle_s": round(self.total, 1)})
            finally:
                os.close(fd)


def _idle_watch(spec, say):
    """The keeper's IdleWatch when the run (or session) has an idle limit: its own, lowered to the lab's."""
    lab = lab_policy()
    if lab.get("problem"):
        say("note: %s" % lab["problem"])
    limit, said, note = idle_limit(spec.get("idle_stop"), lab)
    if not limit:
        return None
    if note:
        say(note)
    return IdleWatch(dict(spec, devices=devices_of(spec), idle_stop=limit, idle_said=said))


# ------------------------------------------------------------------------------------------------ collisions
# A compute process on one of the run's GPUs that is not of the run (someone ignored CUDA_VISIBLE_DEVICES): the
# keeper says so once in the run's output. `foreign` and `process_facts` are mnft.onhost.procs', the same judgment
# as the lease script's (mnft lab's collisions).

COLLISION_EVERY = 5.0  # seconds between two looks at who computes on the run's GPUs


class CollisionWatch:
    """The keeper's look at its GPUs for a process that is not of its run: each such process said once."""

    def __init__(self, spec, say, keeper=None, processes=gpu_processes, facts=process_facts, user_of=_user_of, clock=time.time):
        self.devices = set(d for d in spec.get("devices") or [] if isinstance(d, int))
        self.run_id = spec.get("run_id")
        self.what = "session" if spec.get("kind") == "session" else "run"
        self.say = say
        self.in_image = bool(spec.get("container"))
        self.keeper = os.getpid() if keeper is None else keeper
        self.processes, self.facts, self.user_of, self.clock = processes, facts, user_of, clock
        self.said, self.next = set(), 0.0

    def check(self):
        """Look when due; say each process on the run's GPUs that is not of the run, once; return what was said."""
        now = self.clock()
        if now < self.next or not self.devices:
            return []
        self.next = now + COLLISION_EVERY
        lines = []
        for index, pid in self.processes():
            if index not in self.devices or (index, pid) in self.said:
                continue
            if foreign(self.facts(pid), self.run_id, [self.keeper], self.in_image):
                self.said.add((index, pid))
                lines.append("GPU %d of this %s is also used by %s pid %d, a process not of this %s (it ignored "
                             "CUDA_VISIBLE_DEVICES): both compete for its memory and time; `mnft lab` names it"
                             % (index, self.what, self.user_of(pid) or "?", pid, self.what))
        for line in lines:
            self.say(line)
        return lines


def _collision_watch(spec, say):
    """The keeper's CollisionWatch when the run (or session) holds GPUs here, else None."""
    devices = devices_of(spec)
    if not devices:
        return None
    return CollisionWatch(dict(spec, devices=devices), say)
