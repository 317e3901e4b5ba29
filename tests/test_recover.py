"""Recovery rules (mnft.run.recover), pure: what was seen of a failed attempt in, a cause and a decision out."""

from __future__ import annotations

import pytest

from mnft.run.recover import (
    Attempt,
    Cause,
    GpuXid,
    Policy,
    Seen,
    classify,
    killed_pids,
    new_xids,
    next_gang,
    oom_killed,
    should_restart,
    worker_exits,
)

SUMMARY = ["Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-23_07:51:04", "  host      : h2",
           "  rank      : 3 (local_rank: 1)", "  exitcode  : -9 (pid: 8081)", "  error_file: <N/A>"]


def test_torchruns_summary_gives_each_failed_workers_rank_and_exit_code_or_signal():
    (worker,) = worker_exits(SUMMARY)
    assert (worker.rank, worker.code, worker.signal) == (3, -9, "SIGKILL")
    assert worker_exits(["  rank      : 1 (local_rank: 1)", "  exitcode  : 124 (pid: 7)"])[0].signal is None


def test_with_two_failed_workers_the_root_cause_decides_not_the_peer_torchrun_lists_first():
    # torchrun's summary: the other failures under "Failures:", the first observed one last, under "Root Cause"
    tail = ("Failures:", "[1]:", "  rank      : 1 (local_rank: 1)", "  exitcode  : -15 (pid: 9)",
            "Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)", "  exitcode  : 124 (pid: 8)")
    cause = classify(Seen("h2", "exited", 1, tail=tail, resume_codes=(124,), first_step=True))
    assert (cause.kind, cause.code) == ("resume-exit", 124) and "h2 rank 0" in cause.detail


def test_causes_in_order_lost_host_resume_code_non_finite_startup_signal_failed():
    assert classify(Seen("h2", "lost", None, first_step=True, last_step=40)).kind == "host-lost"
    resume = classify(Seen("h2", "exited", 1, tail=("  rank      : 1", "  exitcode  : 124 (pid: 7)"), resume_codes=(124,), first_step=True))
    assert resume.kind == "resume-exit" and not resume.counted
    assert classify(Seen("h1", "exited", 1, first_step=True, last_step=12, last_loss=float("nan"))).kind == "non-finite"
    startup = classify(Seen("h1", "exited", 1, traceback=("Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'")))
    assert startup.kind == "startup" and not startup.retried
    killed = classify(Seen("h2", "exited", 1, tail=tuple(SUMMARY), first_step=True, last_step=30, oom=True))
    assert killed.kind == "signal" and killed.detail == "h2 rank 3 was killed by SIGKILL (the kernel's OOM killer: out of memory)"
    failed = classify(Seen("h2", "exited", 1, traceback=("RuntimeError: boom",), first_step=True, last_step=7))
    assert (failed.kind, failed.detail, failed.step) == ("failed", "h2 exited with code 1: RuntimeError: boom", 7)


def test_an_import_error_after_steps_were_seen_is_a_failure_not_a_startup_one():
    cause = classify(Seen("h1", "exited", 1, traceback=("ImportError: lazy plugin",), first_step=True, last_step=100))
    assert cause.kind == "failed" and cause.retried


def cause(kind="failed", step=10, code=1, detail="h2 exited with code 1: RuntimeError: boom", host="h2") -> Cause:
    return Cause(kind, host, detail, step, code)


def test_restarts_are_counted_except_resume_codes_and_stop_when_used_up():
    policy = Policy(max_restarts=1)
    assert should_restart(Policy(max_restarts=0), [], cause()).restart is False
    assert should_restart(policy, [], cause()).restart is True
    used = [Attempt(1, ("h1", "h2"), cause(step=5), counted=True)]
    assert should_restart(policy, used, cause(step=9)).why == "--max-restarts 1 used up"
    resume = cause("resume-exit", step=20, code=124)
    decision = should_restart(policy, used, resume)
    assert decision.restart and not decision.counted


def test_the_same_failure_at_the_same_step_twice_is_deterministic():
    history = [Attempt(1, ("h1",), cause(step=10), counted=True)]
    assert should_restart(Policy(max_restarts=5), history, cause(step=10)).restart is False
    assert should_restart(Policy(max_restarts=5), history, cause(step=11)).restart is True
    assert should_restart(Policy(max_restarts=5), history, cause(step=10, detail="h2 exited with code 1: OSError: disk")).restart is True
    stuck = [Attempt(1, ("h1",), cause("resume-exit", step=20, code=124), counted=False)]
    assert should_restart(Policy(max_restarts=5), stuck, cause("resume-exit", step=20, code=124)).restart is False  # no progress


def test_startup_and_non_finite_failures_are_never_retried():
    assert "would fail again" in should_restart(Policy(max_restarts=5), [], cause("startup", step=None)).why
    assert "diverged" in should_restart(Policy(max_restarts=5), [], cause("non-finite")).why


def test_backoff_doubles_up_to_its_cap():
    assert [Policy(backoff_s=5, backoff_max_s=30).backoff(n) for n in (1, 2, 3, 4, 5)] == [5, 10, 20, 30, 30]


def test_a_lost_host_that_answers_again_keeps_its_place_else_a_spare_takes_it():
    assert next_gang(("h1", "h2", "h3"), ["h2"], {"h2"}, ["h4"], None, True).hosts == ("h1", "h2", "h3")
    gang = next_gang(("h1", "h2", "h3"), ["h2"], set(), ["h4"], None, False)
    assert gang.hosts == ("h1", "h4", "h3") and gang.replaced == {"h2": "h4"} and gang.why == "h2 replaced by the spare h4"


def test_without_a_spare_the_gang_shrinks_only_when_allowed():
    shrunk = next_gang(("h1", "h2", "h3"), ["h2"], set(), [], 2, True)
    assert shrunk.hosts == ("h1", "h3") and shrunk.dropped == ("h2",)
    assert next_gang(("h1", "h2", "h3"), ["h2"], set(), [], None, True).hosts is None  # --min-nodes not set
    assert "fewer than --min-nodes 3" in next_gang(("h1", "h2", "h3"), ["h2"], set(), [], 3, True).why
    assert "not elastic" in next_gang(("h1", "h2", "h3"), ["h2"], set(), [], 2, False).why


def test_a_sigkill_is_the_oom_killers_when_the_kernel_log_names_the_workers_pid():
    assert killed_pids(SUMMARY) == [8081]
    log = "[ 812.1] Out of memory: Killed process 8081 (python) total-vm:912kB\n"
    assert oom_killed(log, [8081]) and not oom_killed(log, [808]) and not oom_killed("", [8081])
    assert oom_killed("oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=8081,uid=0", [8081])


# ------------------------------------------------------------------------------------------------ a GPU's Xid


def view(*devices: tuple[int, list[tuple[int, float]]]) -> dict:
    """A host's lab view: each device's index and its health's Xids (code, wall time), as leasehost.read_devices reads them."""
    return {"devices": [{"index": i, "state": "held", "health": {"xids": [{"xid": c, "at": at, "text": "pid=7, name=python3, GPU has fallen off the bus."}
                                                                         for c, at in xids]}} for i, xids in devices]}


def test_only_xids_logged_since_the_attempt_started_on_the_runs_own_gpus_are_its():
    views = {"h1": view((0, [(79, 1000.0)]), (1, [(79, 990.0), (13, 1005.0)]), (2, [(48, 1010.0)])),
             "h2": view((0, [(31, 1002.0)]))}
    # --gpus: h1's GPUs 1 and 2 were the run's; h2 not named (every GPU of it). GPU 1's Xid 79 was there before
    found = new_xids(views, {"h1": (1, 2)}, since=1000.0)
    assert [(x.host, x.gpu, x.xid) for x in found] == [("h2", 0, 31), ("h1", 1, 13), ("h1", 2, 48)]
    assert new_xids(views, {"h1": (3,)}, since=1000.0)[0].host == "h2"  # h1's other GPUs were another run's
    assert new_xids({"h1": {"error": "unreachable"}}, {}, 0.0) == ()
    assert [x.xid for x in new_xids({"h1": view((0, [(79, 999.5)]))}, {}, since=1000.0)] == [79]  # within the clocks' slack


def _gpu(index, uuid, bus, xids=(), **health):
    return {"index": index, "uuid": uuid, "bus_id": f"00000000:{bus}:00.0", "state": "held",
            "health": dict(health, xids=[{"xid": c, "at": at, "text": "GPU has fallen off the bus."} for c, at in xids])}


@pytest.mark.parametrize("fallen", ["listed", "lost", "gone"])
def test_the_runs_gpu_is_told_by_its_uuid_and_bus_however_far_it_had_fallen_when_the_supervisor_looked(fallen):
    """An Xid 79 logged for the run's GPU 2 (bus 3A), its rank killed half a second later: the look after the failure
    finds the GPU still listed, lost at its place, or gone with the GPUs after it renumbered (GPU 3 is GPU 2 now).
    Each way the Xid is the run's, named with the index the run had it under; never another run's GPU's."""
    taken = {"h1": ({"index": 2, "uuid": "GPU-c", "bus_id": "00000000:3A:00.0"},)}
    xid = [(79, 1001.0)]
    devices = {"listed": [_gpu(0, "GPU-a", "18"), _gpu(1, "GPU-b", "2A"), _gpu(2, "GPU-c", "3A", xid), _gpu(3, "GPU-d", "5D", [(13, 1002.0)])],
               "lost": [_gpu(0, "GPU-a", "18"), _gpu(1, "GPU-b", "2A"), _gpu(2, None, "3A", xid, lost="Unable to determine …"),
                        _gpu(3, "GPU-d", "5D", [(13, 1002.0)])],
               "gone": [_gpu(0, "GPU-a", "18"), _gpu(1, "GPU-b", "2A"), _gpu(2, "GPU-d", "5D", [(13, 1002.0)]),
                        dict(_gpu(None, "GPU-c", "3A", xid, gone=True), gone_index=2)]}[fallen]
    found = new_xids({"h1": {"devices": devices}}, {"h1": (2,)}, since=1000.0, taken=taken)
    assert [(x.host, x.gpu, x.xid) for x in found] == [("h1", 2, 79)]
    cause = classify(Seen("h1", "exited", 1, tail=("  rank      : 0 (local_rank: 0)", "  exitcode  : -9 (pid: 81)"), first_step=True, xids=found))
    assert cause.kind == "gpu-xid" and cause.unfit == {"h1": "Xid 79 on its GPU 2"}


def test_a_failure_with_a_new_xid_is_named_with_it_and_keeps_what_the_workers_said():
    xid = GpuXid("h1", 0, 79, 1000.0, "pid=7, name=python3, GPU has fallen off the bus.")
    found = classify(Seen("h1", "exited", 1, tail=tuple(SUMMARY), first_step=True, last_step=30, xids=(xid,)))
    assert found.kind == "gpu-xid" and found.retried and found.counted and found.xids == (xid,)
    assert found.detail.startswith("h1 rank 3 was killed by SIGKILL; Xid 79 (fallen off the bus) on h1 GPU 0 at ")
    assert found.unfit == {"h1": "Xid 79 on its GPU 0"} and found.to_json()["xids"][0]["gpu"] == 0
    # an import error with an Xid is the GPU's, retried (the same import without one: never retried)
    startup = classify(Seen("h1", "exited", 1, traceback=("RuntimeError: CUDA error: unknown error",), xids=(xid,)))
    assert startup.kind == "gpu-xid" and startup.retried
    # a host lost stays host-lost (its kernel log is not read: it does not answer)
    assert classify(Seen("h1", "lost", None, xids=(xid,))).kind == "host-lost"


def test_the_same_application_xid_at_the_same_step_on_another_host_is_deterministic():
    first = classify(Seen("h1", "exited", 1, first_step=True, last_step=8, xids=(GpuXid("h1", 0, 13, 1.0),)))
    again = classify(Seen("h3", "exited", 1, first_step=True, last_step=8, xids=(GpuXid("h3", 0, 13, 2.0),)))
    history = [Attempt(1, ("h1", "h2"), first, counted=True)]
    assert should_restart(Policy(max_restarts=3), history, again).restart is False
    other = classify(Seen("h3", "exited", 1, first_step=True, last_step=8, xids=(GpuXid("h3", 0, 79, 2.0),)))
    assert should_restart(Policy(max_restarts=3), history, other).restart is True


def test_a_host_whose_gpu_logged_an_xid_is_never_reused_a_spare_takes_its_place_or_the_gang_shrinks():
    unfit = {"h2": "Xid 79 on its GPU 1"}
    gang = next_gang(("h1", "h2", "h3"), [], set(), ["h4"], None, False, unfit)
    assert gang.hosts == ("h1", "h4", "h3") and gang.why == "h2 replaced by the spare h4 (Xid 79 on its GPU 1: not used again in this run)"
    # it answers (it is not lost): still not reused
    assert next_gang(("h1", "h2", "h3"), ["h2"], {"h2"}, ["h4"], None, False, unfit).hosts == ("h1", "h4", "h3")
    shrunk = next_gang(("h1", "h2", "h3"), [], set(), [], 2, True, unfit)
    assert shrunk.hosts == ("h1", "h3") and "h2 (Xid 79 on its GPU 1: not used again in this run) dropped: continuing on 2 hosts" in shrunk.why
    none = next_gang(("h1", "h2"), [], set(), [], None, False, unfit)
    assert none.hosts is None and none.why.startswith("h2 (Xid 79 on its GPU 1: not used again in this run) lost and no spare left")
    assert next_gang(("h1", "h3"), [], set(), ["h4"], None, False, unfit).hosts == ("h1", "h3")  # not in the gang: nothing to do
