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
