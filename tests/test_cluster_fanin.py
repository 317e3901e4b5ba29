"""Fan-in on hosts whose sshd keeps OpenSSH's stock limits (MaxStartups 10:30:100, MaxSessions 10, as Debian and
Ubuntu ship them): setup on 16 hosts (its mesh verification used to send every node's first hop to one sshd at
once), and the controller's connection to an sshd that is dropping connections before the banner."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import load

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
TRUST = "- authorized_keys: {}\n- mesh: {}\n"


def setup_json(tmp_path: Path, inventory: Path, book: str) -> tuple[int, dict, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    (tmp_path / "book.yaml").write_text(book)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "setup", "--hosts", str(inventory),
                           "--playbook", str(tmp_path / "book.yaml"), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except ValueError:
        pytest.fail(f"setup printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


def sshd_log(host) -> str:
    return (host.root / "run" / "sshd.log").read_text(errors="replace")


def throttled(host) -> bool:
    """sshd logs 'beginning MaxStartups throttling' when it holds 10 unauthenticated connections (and then drops
    new ones at random, logging 'drop connection #N … past MaxStartups')."""
    return "beginning MaxStartups throttling" in sshd_log(host)


@pytest.mark.timeout(300)
def test_setup_on_16_hosts_with_stock_sshd_completes_and_every_node_reaches_its_peers(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(16, stock_sshd=True)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    code, report, stderr = setup_json(tmp_path, inventory, TRUST)
    failed = {h: {s: o["error"] for s, o in steps.items() if o["status"] not in ("ok", "changed")} for h, steps in report["hosts"].items()}
    assert code == 0 and not any(failed.values()), (failed, stderr[-2000:])
    assert all(steps["2. mesh"]["status"] == "changed" for steps in report["hosts"].values())
    # the verification was a ring: a real hop out of and into every node, so each sshd saw its peers one at a time
    assert [h.name for h in cluster.hosts if throttled(h)] == []
    # and the mesh is real for pairs the ring did not try: the last node to the first's neighbour, and back
    first, last = cluster.hosts[0], cluster.hosts[-1]
    for a, b in ((last, cluster.hosts[1]), (cluster.hosts[5], first)):
        done = cluster.run(a, ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", b.name, "hostname"], check=False)
        assert (done.returncode, done.stdout.strip()) == (0, b.name), done.stderr


@pytest.mark.timeout(120)
def test_the_controller_retries_a_connection_sshd_drops_past_maxstartups(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(1, stock_sshd=True)
    host = cluster.hosts[0]
    inventory = load(cluster.write_inventory(tmp_path / "inventory.yaml"))
    # 100 connections that never authenticate: sshd (MaxStartups 10:30:100) drops every new one while they stay
    held = hold_unauthenticated(host.address, 100)
    assert not answers(host.address)  # sshd is full: the controller's first attempt will be dropped
    release = threading.Timer(1.0, lambda: [s.close() for s in held])
    release.start()
    try:
        with Fleet(inventory) as fleet:
            result = fleet.run_one(inventory.hosts[0], _hostname())
    finally:
        release.cancel()
        for s in held:
            s.close()
    assert result.ok and result.stdout.strip() == host.name, result.error
    assert "past MaxStartups" in sshd_log(host)  # the first attempt really was dropped by sshd


def answers(address: str) -> bool:
    """Whether a new connection gets sshd's banner (False: closed before it, as past MaxStartups)."""
    with socket.create_connection((address, 22), timeout=5) as sock:
        sock.settimeout(5)
        try:
            return sock.recv(4) == b"SSH-"
        except ConnectionResetError:
            return False


def hold_unauthenticated(address: str, count: int) -> list[socket.socket]:
    """`count` connections sshd accepted (its banner came) and that never authenticate; those it dropped are
    replaced until `count` are held."""
    held: list[socket.socket] = []
    for _ in range(count * 20):
        if len(held) == count:
            return held
        sock = socket.create_connection((address, 22), timeout=5)
        sock.settimeout(5)
        try:
            banner = sock.recv(4)
        except ConnectionResetError:
            banner = b""
        (held.append(sock) if banner == b"SSH-" else sock.close())
    raise AssertionError(f"sshd on {address} kept only {len(held)} of the connections")


def _hostname():
    from mnft.hosts.command import Command

    return Command.of("hostname")
