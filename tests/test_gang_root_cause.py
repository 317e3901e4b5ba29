"""Which host failed first: a rank that crashes closes its connections, and the other hosts' ranks then fail on them.
The host named in the failure, and judged by recovery, is the one that failed on its own, whichever exited first."""

from __future__ import annotations

from pathlib import Path

import pytest

from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse
from mnft.run.gang import Gang, HostRun, collateral
from mnft.run.launch import HostLaunch, LaunchOptions

VICTIM = ["Traceback (most recent call last):", '  File "/root/mnft/flaky.py", line 17, in <module>',
          "    dist.all_reduce(torch.ones(1))",
          "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.135.12]:25761"]
CRASH = ["Traceback (most recent call last):", '  File "/root/mnft/flaky.py", line 15, in <module>',
         "    raise RuntimeError('planned failure at step 6')", "RuntimeError: planned failure at step 6"]


def launch(host: str, rank: int, tmp_path) -> HostLaunch:
    return HostLaunch(host=host, node_rank=rank, rank_offset=rank, slots=1, argv=("true",), env={}, secret_names=(),
                      cwd=str(tmp_path), run_dir=str(tmp_path / host / "run"), output_dir=str(tmp_path / "out"), metrics=None)


def exited(lines: list[str], rank: int = 0) -> HostRun:
    run = HostRun(launch("a", rank, Path("/tmp")), state="exited", exit_code=1)
    run.tail.extend((rank, text) for text in lines)
    return run


def test_a_rank_failing_on_a_closed_connection_is_collateral_and_one_raising_on_its_own_is_not():
    assert collateral(exited(VICTIM))
    assert not collateral(exited(CRASH))
    nccl = ["Traceback (most recent call last):", "  File \"t.py\", line 3", "torch.distributed.DistBackendError: NCCL error "
            "in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"]
    assert collateral(exited(nccl))
    assert collateral(exited(["  traceback : Signal 15 (SIGTERM) received by PID 4242"]))
    assert not collateral(exited(["Killed"]))
    lost = exited(VICTIM)
    lost.state = "lost"
    assert not collateral(lost)  # a host that is gone is a cause, never a victim


TWO_HOSTS = parse("hosts:\n  h1: {connection: local}\n  h2: {connection: local}\n")


def gang_of(tmp_path, fleet) -> Gang:
    return Gang(fleet, [launch("h1", 0, tmp_path), launch("h2", 1, tmp_path)], "R", LaunchOptions(grace=0.5), {})


def first_failure(gang: Gang) -> tuple[str, str]:
    """Hand the gang its events until one is a failure: the host it came from and what the gang made of it."""
    host, event = gang.events.get()
    while (why := gang._handle(host, event)) is None:
        host, event = gang.events.get()
    return host, why


def feed(gang: Gang, host: str, rank: int, lines: list[str], code: int) -> None:
    for text in lines:
        gang.events.put((host, {"event": "line", "text": f"[rank{rank}]:{text}"}))
    gang.events.put((host, {"event": "exit", "code": code}))


@pytest.mark.timeout(30)
def test_the_host_that_crashed_is_named_though_its_victim_exited_first(tmp_path):
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        feed(gang, "h1", 0, VICTIM, 1)
        feed(gang, "h2", 1, CRASH, 1)
        host, why = first_failure(gang)
        assert host == "h1"
        assert gang._root_cause(host, why, lambda: None) == ("h2: torchrun exited with code 1", "h2")


@pytest.mark.timeout(30)
def test_a_victim_stays_the_named_host_when_nobody_else_fails_within_the_settle_time(tmp_path, monkeypatch):
    monkeypatch.setattr("mnft.run.gang.SETTLE", 0.3)
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        feed(gang, "h1", 0, VICTIM, 1)
        host, why = first_failure(gang)
        assert gang._root_cause(host, why, lambda: None) == ("h1: torchrun exited with code 1", "h1")


@pytest.mark.timeout(30)
def test_a_first_failure_of_its_own_is_decided_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr("mnft.run.gang.SETTLE", 60.0)
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        feed(gang, "h2", 1, CRASH, 1)
        feed(gang, "h1", 0, VICTIM, 1)
        host, why = first_failure(gang)
        assert gang._root_cause(host, why, lambda: None) == ("h2: torchrun exited with code 1", "h2")
        assert not gang.events.empty()  # h1's events were not waited for


@pytest.mark.timeout(30)
def test_a_host_whose_lines_wait_in_the_queue_behind_others_is_not_taken_for_silent(tmp_path, monkeypatch):
    """At 64 hosts the master's torchrun says a line per peer that connects, and on a loaded controller its lines
    (heartbeats among them) waited in the gang's queue past LOST_AFTER: the master was called lost at every launch.
    A host is silent when nothing came from its agent, judged when its lines arrive, not when they are handled."""
    import time

    monkeypatch.setattr("mnft.run.gang.LOST_AFTER", 0.5)
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        for run in gang.runs.values():
            run.state, run.last_seen = "running", time.monotonic() - 5  # handled last 5 s ago
        gang.heard["h1"] = gang.heard["h2"] = time.monotonic()  # …but their readers got lines just now
        for host in ("h2", "h1"):
            gang.events.put((host, {"event": "exit", "code": 0}))
        result = gang.wait()
    assert result.ok, result.reason


def test_a_run_its_agent_stopped_by_itself_fails_the_gang_and_one_mnft_stopped_does_not(tmp_path):
    """An agent that stops hearing the controller tears its run down (dead-man switch) and says so: the others would
    wait for it at the next rendezvous or collective until a timeout, so the gang fails at once, naming why."""
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        gang.runs["h2"].state = "running"
        why = gang._handle("h2", {"event": "stopped", "reason": "no heartbeat from the controller for 15s"})
        assert why == "h2: its agent stopped the run (no heartbeat from the controller for 15s)"
        gang.runs["h1"].state, gang.runs["h1"].stopping = "running", True
        assert gang._handle("h1", {"event": "stopped", "reason": "stopped by the controller"}) is None


@pytest.mark.timeout(30)
def test_the_heartbeat_reaches_the_first_hosts_started_while_the_last_ones_still_start(tmp_path, monkeypatch):
    """Starting 64 hosts on a loaded test bed took longer than an agent's dead-man time (15 s): the heartbeat began
    only once every host had started, and the first ones had torn their runs down by then."""
    import threading

    beating = threading.Event()
    monkeypatch.setattr(Gang, "_heartbeat", lambda self: beating.set())
    heard_while_starting = []

    def start_one(self, name):
        heard_while_starting.append(beating.wait(timeout=5))
        self.runs[name].state = "running"
        return self.runs[name]

    monkeypatch.setattr(Gang, "_start_one", start_one)
    with Fleet(TWO_HOSTS) as fleet:
        gang_of(tmp_path, fleet).start()
    assert heard_while_starting == [True, True]


def test_a_host_is_silent_when_the_others_are_heard_and_when_nobody_is_only_after_longer(tmp_path, monkeypatch):
    """At a 64-host launch on the loaded test bed the controller itself read nothing for more than LOST_AFTER, and
    blamed the first host it looked at. A host is lost after LOST_AFTER when the others were heard since; when
    nobody was (the controller starved, or its own network gone), only after ALONE_AFTER."""
    from mnft.run import gang as gang_mod

    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        for run in gang.runs.values():
            run.state, run.last_seen = "running", 0.0
        gang.heard.update(h1=100.0, h2=100.0 - gang_mod.LOST_AFTER - 1)  # h1 talks, h2 went quiet
        assert [r.launch.host for r in gang._silent(100.5)] == ["h2"]
        gang.heard.update(h1=100.0, h2=100.0)  # both quiet since 100: the controller heard nobody
        assert gang._silent(100.0 + gang_mod.LOST_AFTER + 1) == []
        assert [r.launch.host for r in gang._silent(100.0 + gang_mod.ALONE_AFTER + 1)] == ["h1", "h2"]
