"""Starting a gang: a host whose start raises is a failed start (the run is refused), never a host left 'starting'."""

from __future__ import annotations

import paramiko
import pytest

from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse
from mnft.run.gang import Gang, GangError
from mnft.run.launch import HostLaunch, LaunchOptions


def launch(host: str, rank: int, tmp_path) -> HostLaunch:
    return HostLaunch(host=host, node_rank=rank, rank_offset=rank, slots=1, argv=("true",), env={}, secret_names=(),
                      cwd=str(tmp_path), run_dir=str(tmp_path / host / "run"), output_dir=str(tmp_path / "out"), metrics=None)


@pytest.mark.timeout(60)
def test_an_exception_while_starting_a_host_fails_the_start_and_names_the_host(tmp_path, monkeypatch):
    inv = parse("hosts:\n  a: {connection: local}\n  b: {connection: local}\n")
    faults = {"a": paramiko.SSHException("Channel closed."), "b": PermissionError(13, "Permission denied")}

    def broken_start(host, command):
        raise faults[host.name]

    with Fleet(inv) as fleet:
        monkeypatch.setattr(fleet, "start", broken_start)
        gang = Gang(fleet, [launch("a", 0, tmp_path), launch("b", 1, tmp_path)], "R-start", LaunchOptions(grace=0.5), {})
        with pytest.raises(GangError, match="did not start on every host") as raised:
            gang.start()
    assert "a: SSH error: SSHException: Channel closed." in str(raised.value)
    assert "b: internal error" in str(raised.value) and "PermissionError" in str(raised.value)
    assert {r.state for r in gang.runs.values()} == {"failed-to-start"}
