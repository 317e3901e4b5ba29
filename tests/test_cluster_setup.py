"""`invoke setup` on the simulated cluster: real sshd, real nftables (per network namespace), real /etc/hosts.

Each destructive test builds its own cluster (`fresh_cluster_factory`); the one test on the shared session
cluster only proves that nothing is applied. The CLI runs as a subprocess with a private controller home.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mnft.setup.steps import blocks, hosts_file

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
OTHER_KEY = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDxOTHERxKEY someone@else"
OTHER_HOSTS_LINE = "192.168.77.7\tprinter   # written by hand"
RDZV = 29500
# Someone else's nftables table, with a rule: undo and revert must leave it exactly as it was.
FOREIGN_TABLE = "table inet other {\n chain c {\n  type filter hook input priority 10; policy accept;\n  tcp dport 9999 accept\n }\n}\n"
USER_KEY = "/root/.ssh/mnft_mesh_ed25519"  # a private key of the user's own at the mesh key's path, without .pub


def invoke(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def setup_json(tmp_path: Path, inventory: Path, book: Path, *extra: str) -> tuple[int, dict]:
    done = invoke(tmp_path, "setup", "--hosts", str(inventory), "--playbook", str(book), "--json", *extra)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"setup printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


def statuses(report: dict) -> dict[str, dict[str, str]]:
    return {host: {step: o["status"] for step, o in steps.items()} for host, steps in report["hosts"].items()}


def playbook(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "book.yaml"
    path.write_text(text)
    return path


TEST_BOOK = """
- name: controller key
  authorized_keys: {}
- name: mesh
  mesh: {}
- name: names
  hosts_file: {}
- name: firewall
  firewall:
    revert_after: 25
    probe_timeout: 8
- name: ports
  reserved_ports:
    persist: false          # /etc/sysctl.d is the real machine's in the testbed
"""


def read(cluster, host, path: str) -> str:
    return cluster.run(host, ["cat", path]).stdout


def state(cluster, host) -> dict[str, str]:
    """Everything setup may touch on a host, as text."""
    return {
        "ruleset": cluster.run(host, ["nft", "list", "ruleset"]).stdout,
        "authorized_keys": read(cluster, host, "/root/.ssh/authorized_keys"),
        "hosts": read(cluster, host, "/etc/hosts"),
        "ssh_dir": cluster.run(host, ["ls", "-a", "/root/.ssh"]).stdout,
        "ports": read(cluster, host, "/proc/sys/net/ipv4/ip_local_reserved_ports"),
        "run_mnft": cluster.run(host, ["sh", "-c", "ls -a /run/mnft 2>/dev/null || true"]).stdout,
    }


def add_foreign_table(cluster, host) -> None:
    cluster.run(host, ["nft", "-f", "-"], input=FOREIGN_TABLE)


def debian_hosts_file(host, cluster) -> None:
    """Replace the testbed's cluster names in the host's /etc/hosts by Debian's `127.0.1.1 <own name>`: before
    setup no node resolves a peer, and its own name resolves to loopback (what gloo/NCCL trip over)."""
    path = host.root / "etc" / "hosts"  # bind-mounted on the host's /etc/hosts: rewrite the same inode
    names = {h.name for h in cluster.hosts}
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() != "# mnft testbed: cluster hosts" and not (line.split()[1:2] and line.split()[1] in names)]
    with open(path, "r+") as f:
        f.write("".join(kept) + f"127.0.1.1\t{host.name}\n")
        f.truncate()


def resolves_to(cluster, src, name: str) -> str | None:
    done = cluster.run(src, ["getent", "hosts", name], check=False)
    return done.stdout.split()[0] if done.returncode == 0 else None


def tcp_reachable(cluster, src, address: str, port: int) -> bool:
    code = f"import socket\ntry:\n socket.create_connection(({address!r}, {port}), timeout=3).close(); print('open')\nexcept OSError as e: print('closed', e)"
    return cluster.run(src, [cluster.python, "-c", code], timeout=20).stdout.startswith("open")


def ssh_from(cluster, src, peer_name: str) -> subprocess.CompletedProcess:
    return cluster.run(src, ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", peer_name, "true"], check=False, timeout=30)


def controller_ssh_ok(cluster, host) -> bool:
    return subprocess.run(cluster.ssh_argv(host, ["true"]), capture_output=True, timeout=30).returncode == 0


# ---------------------------------------------------------------------------------------------- the whole playbook


def test_setup_mesh_names_firewall_idempotent_check_and_undo(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(3, outsider=True)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", rendezvous_port=RDZV)
    book = playbook(tmp_path, TEST_BOOK)
    master, *peers = cluster.hosts
    for host in cluster.hosts:  # lines written by others, one without a final newline; someone else's nft table
        cluster.run(host, ["sh", "-c", f"printf '%s' '{OTHER_KEY}' >> ~/.ssh/authorized_keys; printf '%s\\n' '{OTHER_HOSTS_LINE}' >> /etc/hosts"])
        debian_hosts_file(host, cluster)
        add_foreign_table(cluster, host)
    user_key_host = peers[0]
    cluster.run(user_key_host, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "alice@lab", "-f", USER_KEY])
    cluster.run(user_key_host, ["rm", USER_KEY + ".pub"])
    user_key = read(cluster, user_key_host, USER_KEY)
    before = {h.name: state(cluster, h) for h in cluster.hosts}
    assert "table inet other" in before[master.name]["ruleset"] and "9999" in before[master.name]["ruleset"]
    assert resolves_to(cluster, master, master.name) == "127.0.1.1" and resolves_to(cluster, master, peers[0].name) is None
    assert str(RDZV) not in before[master.name]["ports"]

    # --check: the plan, nothing changed
    code, report = setup_json(tmp_path, inventory, book, "--check")
    assert code == 0, report
    assert report["mode"] == "check" and report["changed"] > 0
    assert {h.name: state(cluster, h) for h in cluster.hosts} == before

    # --only trust runs the trust steps and nothing else; a second run changes nothing
    code, report = setup_json(tmp_path, inventory, book, "--only", "trust")
    assert code == 0, json.dumps(report, indent=1)
    assert [s["step"] for s in report["steps"]] == ["authorized_keys", "mesh"]
    assert all(set(per) == {"1. authorized_keys", "2. mesh"} for per in statuses(report).values())
    assert all(per["2. mesh"] == "changed" for per in statuses(report).values())
    for host in cluster.hosts:
        now = state(cluster, host)
        assert {k: now[k] for k in ("ruleset", "hosts", "ports", "run_mnft")} == {k: before[host.name][k] for k in ("ruleset", "hosts", "ports", "run_mnft")}
    code, report = setup_json(tmp_path, inventory, book, "--only", "trust")
    assert code == 0 and report["changed"] == 0, json.dumps(report, indent=1)

    # apply
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 0, json.dumps(report, indent=1)
    assert all(s in ("ok", "changed") for per in statuses(report).values() for s in per.values())
    assert all(per["4. firewall"] == "changed" for per in statuses(report).values())
    for host in cluster.hosts:  # the SSH probe succeeded, so each host's armed revert was cancelled
        assert not any("mnft-firewall-revert" in cmd for _, cmd in cluster.processes(host))

    # node-to-node SSH, strict host keys, no prompt, every pair
    for src in cluster.hosts:
        for dst in cluster.hosts:
            if src is not dst:
                done = ssh_from(cluster, src, dst.name)
                assert done.returncode == 0, f"{src.name} -> {dst.name}: {done.stderr}"
    # names resolve to cluster addresses on every node, its own name too (no longer 127.0.1.1)
    for src in cluster.hosts:
        for dst in cluster.hosts:
            assert resolves_to(cluster, src, dst.name) == dst.address, f"{dst.name} on {src.name}"
    # the rendezvous port is out of the ephemeral range on every node
    for host in cluster.hosts:
        assert RDZV in _ports(read(cluster, host, "/proc/sys/net/ipv4/ip_local_reserved_ports")), host.name

    # firewall: the master's rendezvous port is open to peers, closed to the outsider; SSH still works
    listener = cluster.popen(master, [cluster.python, "-c",
                                      "import socket,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                                      f"s.bind(('0.0.0.0',{RDZV}))\ns.listen(16)\nprint('ready',flush=True)\n"
                                      "while True:\n c,_=s.accept(); c.close()"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        for peer in peers:
            assert tcp_reachable(cluster, peer, master.address, RDZV), peer.name
        assert not tcp_reachable(cluster, cluster.outsider, master.address, RDZV)
    finally:
        listener.kill()
        listener.wait()
    assert all(controller_ssh_ok(cluster, h) for h in cluster.hosts)

    # lines written by others survive byte for byte; the user's private key is used as it is
    for host in cluster.hosts:
        now = read(cluster, host, "/root/.ssh/authorized_keys")
        assert now.startswith(before[host.name]["authorized_keys"])
        assert blocks.remove_block(read(cluster, host, "/etc/hosts"), hosts_file.BLOCK) == before[host.name]["hosts"]
        assert FOREIGN_TABLE.split("{")[0].strip() in cluster.run(host, ["nft", "list", "ruleset"]).stdout
    assert read(cluster, user_key_host, USER_KEY) == user_key
    applied = {h.name: state(cluster, h) for h in cluster.hosts}

    # a second run changes nothing: 0 changed, identical rulesets and files
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 0 and report["changed"] == 0, json.dumps(report, indent=1)
    assert {h.name: state(cluster, h) for h in cluster.hosts} == applied

    # a hand-flushed mnft chain is noticed and re-applied (digest in the comment unchanged, rules gone)
    cluster.run(peers[1], ["nft", "flush", "chain", "inet", "mnft", "input"])
    code, report = setup_json(tmp_path, inventory, book, "--only", "firewall")
    assert code == 0 and [s["step"] for s in report["steps"]] == ["firewall"], json.dumps(report, indent=1)
    assert {h: per["4. firewall"] for h, per in statuses(report).items()} == {
        h.name: "changed" if h is peers[1] else "ok" for h in cluster.hosts}
    assert {h.name: state(cluster, h) for h in cluster.hosts} == applied

    # --undo puts back exactly what was there, byte for byte
    code, report = setup_json(tmp_path, inventory, book, "--undo")
    assert code == 0, json.dumps(report, indent=1)
    for host in cluster.hosts:
        after = state(cluster, host)
        assert after["ruleset"] == before[host.name]["ruleset"]  # the foreign table and its rule included
        assert after["hosts"] == before[host.name]["hosts"]
        assert after["authorized_keys"] == before[host.name]["authorized_keys"]  # no final newline, as before
        assert after["ssh_dir"] == before[host.name]["ssh_dir"]
        assert after["ports"] == before[host.name]["ports"]
    assert read(cluster, user_key_host, USER_KEY) == user_key  # mnft did not generate it: undo keeps it
    assert all(controller_ssh_ok(cluster, h) for h in cluster.hosts)


def _ports(text: str) -> set[int]:
    from mnft.setup.steps.reserved_ports import parse_ports

    return parse_ports(text)


# ---------------------------------------------------------------------------------------------- lock-out


def test_a_firewall_that_would_lock_out_ssh_is_reverted(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(2)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    # sshd listens on 22: accepting 2222 instead drops the controller's new connections
    book = playbook(tmp_path, "- firewall:\n    ssh_port: 2222\n    revert_after: 6\n    probe_timeout: 2\n")
    for host in cluster.hosts:
        add_foreign_table(cluster, host)
    before = {h.name: cluster.run(h, ["nft", "list", "ruleset"]).stdout for h in cluster.hosts}
    assert all("tcp dport 9999 accept" in text for text in before.values())
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 1, report
    for host in cluster.hosts:
        outcome = report["hosts"][host.name]["1. firewall"]
        assert outcome["status"] == "failed" and outcome["error"].startswith("reverted: would lock out SSH"), outcome
        assert cluster.run(host, ["nft", "list", "ruleset"]).stdout == before[host.name]
        assert controller_ssh_ok(cluster, host)
        assert not any("mnft-firewall-revert" in cmd for _, cmd in cluster.processes(host))


def test_a_home_sshd_would_refuse_is_reported_not_changed(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(1)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    host = cluster.hosts[0]
    cluster.run(host, ["chmod", "0775", "/root"])
    try:
        code, report = setup_json(tmp_path, inventory, playbook(tmp_path, "- authorized_keys: {}\n"))
        outcome = report["hosts"][host.name]["1. authorized_keys"]
        assert code == 1 and outcome["status"] == "failed" and "StrictModes" in outcome["error"] and "chmod go-w /root" in outcome["error"]
        assert cluster.run(host, ["stat", "-c", "%a", "/root"]).stdout.strip() == "775"
    finally:
        cluster.run(host, ["chmod", "0700", "/root"])


# ---------------------------------------------------------------------------------------------- bad playbook


@pytest.mark.parametrize("text,expected", [
    ("- authorized_keys: {}\n- name: fw\n  firewal: {}\n", "step 2 (fw): unknown step 'firewal' (did you mean 'firewall'?)"),
    ("- mesh: {}\n- firewall:\n    revert_afer: 5\n", "step 2 (firewall): key 'revert_afer': unknown parameter (did you mean 'revert_after'?)"),
    ("- firewall:\n    ssh_port: twenty-two\n", "step 1 (firewall): key 'ssh_port': expected a whole number, got 'twenty-two'"),
])
def test_a_bad_playbook_exits_2_with_one_line_and_applies_nothing(cluster, tmp_path, text, expected):
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    book = playbook(tmp_path, text)
    before = [state(cluster, h) for h in cluster.hosts]
    done = invoke(tmp_path, "setup", "--hosts", str(inventory), "--playbook", str(book))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"mnft: {book}: {expected}"], done.stderr
    assert [state(cluster, h) for h in cluster.hosts] == before


# ---------------------------------------------------------------------------------------------- unreachable host


def test_an_unreachable_host_is_reported_and_joins_the_mesh_on_the_next_run(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(3)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    book = playbook(tmp_path, TEST_BOOK)
    h1, h2, h3 = cluster.hosts
    cluster.link_down(h3)
    code, report = setup_json(tmp_path, inventory, book, "--connect-timeout", "5")
    assert code == 4, json.dumps(report, indent=1)
    assert set(statuses(report)[h3.name].values()) == {"unreachable"}
    assert all(s in ("ok", "changed") for name in (h1.name, h2.name) for s in statuses(report)[name].values())
    assert ssh_from(cluster, h1, h2.name).returncode == 0
    # h3's address on eth0 is unknown (never reached, no previous entry): left out, said so, not guessed
    assert any(note.startswith(f"{h3.name} was not reached and its address on eth0 is unknown") for note in report["notes"]), report["notes"]
    assert h3.address not in cluster.run(h1, ["nft", "list", "set", "inet", "mnft", "peers"]).stdout
    assert resolves_to(cluster, h1, h3.name) == h3.address  # the testbed's own line; mnft's block has no h3
    assert h3.name not in hosts_file.BLOCK.body(read(cluster, h1, "/etc/hosts")) and len(hosts_file.BLOCK.body(read(cluster, h1, "/etc/hosts"))) == 2

    cluster.link_up(h3)
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 0, json.dumps(report, indent=1)
    assert statuses(report)[h1.name]["2. mesh"] == "changed"  # h3's mesh key and host key added
    for src, dst in ((h1, h3), (h3, h2)):
        assert ssh_from(cluster, src, dst.name).returncode == 0, f"{src.name} -> {dst.name}"
    applied = read(cluster, h1, "/etc/hosts"), read(cluster, h1, "/root/.ssh/config"), cluster.run(h1, ["nft", "list", "ruleset"]).stdout

    # down again: its previous entries stay (names, peers, mesh), nothing is rewritten with a guessed address
    cluster.link_down(h3)
    code, report = setup_json(tmp_path, inventory, book, "--connect-timeout", "5")
    assert code == 4, json.dumps(report, indent=1)
    assert any(note.startswith(f"{h3.name} was not reached: its address on eth0 is taken from the previous setup ({h3.address})")
               for note in report["notes"]), report["notes"]
    assert statuses(report)[h1.name] == {"1. authorized_keys": "ok", "2. mesh": "ok", "3. hosts_file": "ok", "4. firewall": "ok", "5. reserved_ports": "ok"}
    assert (read(cluster, h1, "/etc/hosts"), read(cluster, h1, "/root/.ssh/config"), cluster.run(h1, ["nft", "list", "ruleset"]).stdout) == applied


def test_a_new_controller_key_is_appended_accepted_by_sshd_and_undone(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(1)
    host = cluster.hosts[0]
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    key = tmp_path / "second_controller"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "second@controller", "-f", str(key)], check=True)
    book = playbook(tmp_path, f"- authorized_keys:\n    key: {key}.pub\n")
    cluster.run(host, ["chmod", "0644", "/root/.ssh/authorized_keys"])  # loose: mnft makes it 0600
    before = read(cluster, host, "/root/.ssh/authorized_keys")
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 0 and report["hosts"][host.name]["1. authorized_keys"]["status"] == "changed", report
    assert cluster.run(host, ["stat", "-c", "%a", "/root/.ssh", "/root/.ssh/authorized_keys"]).stdout.split() == ["700", "600"]
    argv = cluster.ssh_argv(host, ["true"])
    argv[argv.index(str(cluster.controller_key))] = str(key)
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0  # sshd accepts the new line
    code, report = setup_json(tmp_path, inventory, book)
    assert code == 0 and report["changed"] == 0
    code, report = setup_json(tmp_path, inventory, book, "--undo")
    assert code == 0 and read(cluster, host, "/root/.ssh/authorized_keys") == before


# ---------------------------------------------------------------------------------------------- sudo with a password


SUDO_PASSWORD = "c0rrect horse; $(id) `x` 'q'"  # shell metacharacters: it must reach sudo's stdin, nothing else


def test_setup_as_a_non_root_user_through_sudo_with_a_password_that_is_never_shown(fresh_cluster_factory, tmp_path):
    import shutil

    if shutil.which("sudo") is None:
        pytest.skip("sudo is not installed on this machine (apt-get install sudo)")
    cluster = fresh_cluster_factory(2)
    cluster.add_user("lab", password=SUDO_PASSWORD, sudo=True)
    # the user cannot reach root's interpreter (/root is 0700): the system python runs mnft's host-side script
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", user="lab", become=True, python="/usr/bin/python3", rendezvous_port=RDZV)
    book = playbook(tmp_path, TEST_BOOK)
    h1, h2 = cluster.hosts
    for host in cluster.hosts:
        add_foreign_table(cluster, host)
        debian_hosts_file(host, cluster)
    before = {h.name: cluster.run(h, ["nft", "list", "ruleset"]).stdout for h in cluster.hosts}

    def setup(*extra: str) -> tuple[subprocess.CompletedProcess, dict]:
        home = tmp_path / "controller-home"
        home.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), PYTHONUNBUFFERED="1")
        # a new session: no controlling terminal, so the password prompt reads it from stdin
        done = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "setup", "--hosts", str(inventory), "--playbook", str(book),
                               "--json", *extra], cwd=REPO, env=env, input=SUDO_PASSWORD + "\n", capture_output=True, text=True,
                              timeout=240, start_new_session=True)
        assert SUDO_PASSWORD not in done.stdout and SUDO_PASSWORD not in done.stderr
        assert "horse" not in done.stdout + done.stderr
        try:
            return done, json.loads(done.stdout)
        except ValueError:
            pytest.fail(f"setup printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")

    done, report = setup()
    assert done.returncode == 0, json.dumps(report, indent=1) + done.stderr
    assert done.stderr.count("sudo password") == 1  # asked once, for every host
    assert all(s in ("ok", "changed") for per in statuses(report).values() for s in per.values())
    assert all(per["4. firewall"] == "changed" and per["3. hosts_file"] == "changed" for per in statuses(report).values())
    for src, dst in ((h1, h2), (h2, h1)):
        assert resolves_to(cluster, src, dst.name) == dst.address
        done_ssh = cluster.run(src, ["su", "lab", "-c", f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes {dst.name} true"], check=False, timeout=30)
        assert done_ssh.returncode == 0, done_ssh.stderr  # the mesh, in lab's own ~/.ssh
    for host in cluster.hosts:
        assert "table inet mnft" in cluster.run(host, ["nft", "list", "ruleset"]).stdout
        assert cluster.run(host, ["stat", "-c", "%U", "/tmp/home-lab/.ssh/authorized_keys"]).stdout.strip() == "lab"

    done, report = setup("--undo")
    assert done.returncode == 0, json.dumps(report, indent=1) + done.stderr
    assert {h.name: cluster.run(h, ["nft", "list", "ruleset"]).stdout for h in cluster.hosts} == before
