"""Fan-out, connections, host keys and trust: one outcome per host, timeouts everywhere, keys never auto-accepted.

Most tests use `connection: local` hosts (a local shell per "host") or plain sockets on 127.0.0.1; the ones
marked `cluster` use the simulated cluster's real sshd. The controller's HOME and MNFT_HOME always point at a
temporary directory: the developer's ~/.ssh and ~/.mnft are never read or written.
"""

from __future__ import annotations

import errno
import socket
import stat
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.hosts import hostkeys
from mnft.hosts.command import Command
from mnft.hosts.connection import Timeouts, Unreachable, bounded, open_connection
from mnft.hosts.fleet import Fleet, HostResult, Results, Status
from mnft.hosts.inventory import parse


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))
    return home


def local_inventory(*names: str):
    text = "hosts:\n" + "".join(f"  {n}: {{connection: local}}\n" for n in names)
    return parse(text)


def ssh_inventory(port: int, address: str = "127.0.0.1"):
    return parse(f"hosts:\n  remote: {{address: {address}, port: {port}, user: nobody}}\n  here: {{connection: local}}\n")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ fan-out


def test_results_come_back_in_inventory_order_whatever_order_hosts_finish():
    inv = local_inventory("a", "b", "c")
    delays = {"a": "0.6", "b": "0.3", "c": "0"}
    with Fleet(inv, Timeouts(command=30)) as fleet:
        results = fleet.run(lambda host: Command.of("sh", "-c", "sleep $1; echo $2", "sh", delays[host.name], host.name))
    assert [r.host for r in results] == ["a", "b", "c"]
    assert [r.stdout for r in results] == ["a\n", "b\n", "c\n"]
    assert results.exit_code() is ExitCode.OK


def test_a_failing_host_never_hides_the_others():
    inv = local_inventory("a", "b", "c")
    commands = {
        "a": Command.of("true"),
        "b": Command.of("sh", "-c", "echo first >&2; echo boom >&2; exit 3"),
        "c": Command.of("echo", "fine"),
    }
    with Fleet(inv) as fleet:
        results = fleet.run(commands)
    assert [r.status for r in results] == [Status.OK, Status.FAILED, Status.OK]
    assert results["b"].exit_code == 3
    assert results["b"].error == "exit code 3: boom"
    assert results["b"].tail() == "first\nboom"
    assert results["c"].stdout == "fine\n"
    assert results.exit_code() is ExitCode.FAILED


def test_a_command_over_its_timeout_fails_that_host_only_and_is_killed(tmp_path):
    inv = local_inventory("slow", "quick")
    pidfile = tmp_path / "pid"
    commands = {
        "slow": Command.of("sh", "-c", 'echo $$ > "$1"; exec sleep 60', "sh", str(pidfile)),
        "quick": Command.of("true"),
    }
    with Fleet(inv) as fleet:
        results = fleet.run(commands, timeout=3)  # ample for `true` on a loaded machine, far below the sleep
    assert results["slow"].status is Status.FAILED and "timed out after 3s" in results["slow"].error
    assert results["quick"].ok
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", "the timed-out command is still running"


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_stdin_may_differ_per_host():
    inv = local_inventory("a", "b")
    with Fleet(inv) as fleet:
        results = fleet.run(Command.of("cat"), stdin={"a": b"to a", "b": b"to b"})
    assert [r.stdout for r in results] == ["to a", "to b"]


def test_a_command_that_exits_before_reading_its_input_is_a_failed_host_not_a_crash():
    inv = local_inventory("a", "b")
    commands = {"a": Command.of("/nonexistent/python3", "-c", "pass"), "b": Command.of("cat")}
    with Fleet(inv) as fleet:
        results = fleet.run(commands, stdin=b"x" * 1_000_000)
    assert results["a"].status is Status.FAILED and results["a"].exit_code == 127
    assert results["b"].ok and len(results["b"].stdout) == 1_000_000


class _FaultyConnection:
    """A fake connection whose run() raises what a broken SSH session or a bug raises."""

    def __init__(self, host, exc):
        self.host, self.exc = host, exc

    def run(self, command, stdin=None, timeout=None):
        if self.exc is None:
            from mnft.hosts.connection import Completed

            return Completed(0, "fine\n", "")
        raise self.exc

    def close(self):
        pass


def test_one_hosts_ssh_fault_or_mnft_bug_never_hides_the_others(monkeypatch, capsys):
    import mnft.hosts.fleet

    faults = {
        "a": None,
        "b": paramiko.SSHException("Channel closed."),
        "c": EOFError(),
        "d": RuntimeError("a bug"),
        "e": None,
    }
    opened = {"f": paramiko.ssh_exception.SSHException("Error reading SSH protocol banner")}

    def fake_open(host, known_hosts, timeouts, config=None):
        if host.name in opened:
            raise opened[host.name]
        return _FaultyConnection(host, faults[host.name])

    monkeypatch.setattr(mnft.hosts.fleet, "open_connection", fake_open)
    with Fleet(local_inventory("a", "b", "c", "d", "e", "f")) as fleet:
        results = fleet.run(Command.of("true"))
        assert [r.status for r in results] == [Status.OK, Status.UNREACHABLE, Status.UNREACHABLE, Status.FAILED, Status.OK, Status.UNREACHABLE]
        assert results["b"].error == "SSH error: SSHException: Channel closed."
        assert results["d"].error == "internal error (a bug in mnft): RuntimeError: a bug"
        assert results["f"].error == "SSH error: SSHException: Error reading SSH protocol banner"
        assert results.exit_code() == ExitCode.UNREACHABLE
        assert "RuntimeError: a bug" in capsys.readouterr().err  # a bug keeps its traceback
        again = fleet.run(Command.of("true"), hosts=[fleet.inventory.host("b"), fleet.inventory.host("f")])
        assert [r.status for r in again] == [Status.UNREACHABLE, Status.UNREACHABLE]  # stays so for later phases


def test_a_raising_per_host_function_is_that_hosts_outcome_only():
    def fn(host):
        if host.name == "b":
            raise OSError(113, "No route to host")
        return HostResult(host.name, Status.OK)

    with Fleet(local_inventory("a", "b", "c")) as fleet:
        results = fleet.map(fn)
    assert [r.status for r in results] == [Status.OK, Status.UNREACHABLE, Status.OK]
    assert "No route to host" in results["b"].error


def test_a_local_os_error_in_a_per_host_function_is_a_failure_not_an_unreachable_host(capsys):
    def fn(host):
        if host.name == "b":
            raise PermissionError(13, "Permission denied", "/root/.mnft/runs")
        return HostResult(host.name, Status.OK)

    with Fleet(local_inventory("a", "b")) as fleet:
        results = fleet.map(fn)
        assert [r.status for r in results] == [Status.OK, Status.FAILED]
        assert fleet.map(fn, [fleet.inventory.host("a")])["a"].status is Status.OK
    assert "PermissionError" in capsys.readouterr().err  # a bug or local fault keeps its traceback


def test_exit_code_unreachable_outranks_failed_outranks_ok():
    def results(*statuses: Status) -> Results:
        return Results({f"h{i}": HostResult(f"h{i}", s) for i, s in enumerate(statuses)})

    assert results(Status.OK, Status.OK).exit_code() is ExitCode.OK
    assert results(Status.OK, Status.FAILED).exit_code() is ExitCode.FAILED
    assert results(Status.FAILED, Status.UNREACHABLE).exit_code() is ExitCode.UNREACHABLE
    assert results(Status.OK, Status.HOST_KEY_REJECTED).exit_code() is ExitCode.UNREACHABLE


# ------------------------------------------------------------------------------------------------ connections


def test_refused_host_is_unreachable_and_stays_so_for_later_phases():
    inv = ssh_inventory(closed_port())
    with Fleet(inv, Timeouts(connect=5, command=10)) as fleet:
        connected = fleet.connect_all()
        assert connected["remote"].status is Status.UNREACHABLE
        assert "refused" in connected["remote"].error
        assert connected["here"].ok
        results = fleet.run(Command.of("echo", "hi"))
    assert results["remote"].status is Status.UNREACHABLE and results["remote"].error == connected["remote"].error
    assert results["here"].stdout == "hi\n"
    assert results.exit_code() is ExitCode.UNREACHABLE


def test_a_server_that_never_speaks_ssh_is_unreachable_after_the_connect_timeout():
    with socket.socket() as silent:  # the kernel accepts the TCP connection; nothing ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        inv = ssh_inventory(silent.getsockname()[1])
        with Fleet(inv, Timeouts(connect=1, command=10)) as fleet:
            result = fleet.connect_all()["remote"]
    assert result.status is Status.UNREACHABLE
    assert "127.0.0.1" in result.error


def test_a_port_that_accepts_and_never_speaks_ssh_is_tried_once_and_said_so():
    """A wedged sshd, or a firewall answering the SYN: paramiko gives up on the banner after the connect timeout. That
    is not a MaxStartups drop (a connection closed before the banner): asking again only waits as long again (the
    board showed such a host "asking" for two connect timeouts)."""
    import threading

    accepted = []
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        threading.Thread(target=lambda: [accepted.append(silent.accept()[0]) for _ in range(4)], daemon=True).start()
        inv = ssh_inventory(silent.getsockname()[1])
        with Fleet(inv, Timeouts(connect=1, command=10)) as fleet:
            result = fleet.connect_all()["remote"]
        for conn in accepted:
            conn.close()
    assert result.status is Status.UNREACHABLE
    assert result.error.startswith("no SSH answer from [127.0.0.1]:") and "within 1s: its port accepts connections but nothing speaks SSH" in result.error
    assert len(accepted) == 1


def test_no_route_to_host_is_not_reported_as_refused(monkeypatch):
    import fabric

    def no_route(self, *args, **kwargs):
        raise paramiko.ssh_exception.NoValidConnectionsError({("10.9.9.9", 22): OSError(errno.EHOSTUNREACH, "No route to host")})

    monkeypatch.setattr(fabric.Connection, "open", no_route)
    inv = parse("hosts:\n  far: {address: 10.9.9.9}\n")
    with pytest.raises(Unreachable) as caught:
        open_connection(inv.hosts[0], hostkeys.TrustedKeys(), Timeouts(connect=1))
    assert "no route to 10.9.9.9" in str(caught.value) and "refused" not in str(caught.value)


# ------------------------------------------------------------------------------------------------ host keys


@pytest.fixture
def keypair(tmp_path):
    path = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return paramiko.Ed25519Key.from_private_key_file(str(path)), path.with_suffix(".pub")


def test_fingerprint_is_what_ssh_keygen_prints(keypair):
    key, pub = keypair
    printed = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]
    assert hostkeys.fingerprint(key) == printed


def test_known_name_brackets_a_non_default_port():
    assert hostkeys.known_name("10.0.0.1", 22) == "10.0.0.1"
    assert hostkeys.known_name("10.0.0.1", 2222) == "[10.0.0.1]:2222"


def test_judge_tells_new_trusted_and_changed_keys_apart(keypair, tmp_path):
    key, _ = keypair
    other_path = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_path)], check=True)
    other = paramiko.Ed25519Key.from_private_key_file(str(other_path))
    trusted = hostkeys.TrustedKeys()
    assert hostkeys.judge("h", key, trusted) == "new"
    trusted.add("h", key.get_name(), key)
    assert hostkeys.judge("h", key, trusted) == "already-trusted"
    assert hostkeys.judge("h", other, trusted) == "changed"
    assert hostkeys.judge("[h]:2222", other, trusted) == "new"


def test_a_host_that_presents_only_a_type_not_recorded_is_refused_not_recorded(keypair, tmp_path):
    key, _ = keypair  # ed25519
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(tmp_path / "ecdsa")], check=True)
    ecdsa = paramiko.ECDSAKey.from_private_key_file(str(tmp_path / "ecdsa"))
    trusted = hostkeys.TrustedKeys()
    trusted.add("h", ecdsa.get_name(), ecdsa)
    # trust-hosts asked for ecdsa first (see below): a host that still shows ed25519 lacks its recorded key
    assert hostkeys.judge("h", key, trusted) == "other-type"
    assert hostkeys.recorded_types("h", trusted) == ["ecdsa-sha2-nistp256"]


def test_record_appends_to_a_private_file_that_reads_back(keypair, tmp_path):
    key, _ = keypair
    path = tmp_path / "mnft" / "known_hosts"
    hostkeys.record(path, "[10.0.0.1]:2222", key)
    hostkeys.record(path, "10.0.0.2", key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text().splitlines()[0] == f"[10.0.0.1]:2222 ssh-ed25519 {key.get_base64()}"
    loaded = hostkeys.load_trusted([path, tmp_path / "missing"])
    assert hostkeys.judge("10.0.0.2", key, loaded) == "already-trusted"


def test_trusted_files_come_from_home_and_mnft_home_only(tmp_path, private_home):
    files = hostkeys.known_hosts_files(tmp_path / "inventory_known_hosts")
    assert files == [
        hostkeys.SYSTEM_KNOWN_HOSTS,
        private_home / ".ssh" / "known_hosts",
        tmp_path / "inventory_known_hosts",
        tmp_path / "mnft-home" / "known_hosts",
    ]


def test_an_unknown_key_is_refused_by_the_policy(keypair):
    key, _ = keypair
    with pytest.raises(hostkeys.UnknownHostKey):
        hostkeys.RejectUnknownHostKey().missing_host_key(None, "h", key)


def test_a_corrupt_known_hosts_file_is_one_clear_error_naming_it(tmp_path):
    bad = tmp_path / "known_hosts"
    bad.write_text("10.0.0.1 ssh-ed25519 not-base64!!\n")
    with pytest.raises(MnftError, match="known_hosts:1: cannot read known_hosts: the key is not base64"):
        hostkeys.load_trusted([bad])
    inv = parse(f"known_hosts: {bad}\nhosts:\n  remote: {{address: 127.0.0.1, port: {closed_port()}}}\n")
    with pytest.raises(InputError, match=str(bad)) as err:
        Fleet(inv, Timeouts(connect=2))  # refused before any host is dialled
    assert err.value.exit_code == ExitCode.BAD_INPUT


def test_trusted_keys_match_plain_and_hashed_names_and_never_a_revoked_or_negated_one(keypair, tmp_path):
    key, _ = keypair
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(tmp_path / "ecdsa")], check=True)
    ecdsa = paramiko.ECDSAKey.from_private_key_file(str(tmp_path / "ecdsa"))
    line = f"{key.get_name()} {key.get_base64()}"
    path = tmp_path / "known_hosts"
    path.write_text("\n".join([
        "# a comment", "",
        f"{paramiko.HostKeys.hash_host('hashed.lab')} {line}",  # as `ssh-keygen -H` writes it
        f"a.lab,10.0.0.1 {line}",
        f"[a.lab]:2222 {ecdsa.get_name()} {ecdsa.get_base64()}",
        f"!neg.lab {line}",
        f"@cert-authority *.lab {line}",
        f"gone.lab {ecdsa.get_name()} {ecdsa.get_base64()}",
        f"@revoked * {ecdsa.get_name()} {ecdsa.get_base64()}",
        "short.lab ssh-ed25519",  # too few fields: skipped, as OpenSSH does
        "x.lab ssh-unknown-type AAAA",  # a type paramiko cannot use: skipped, as paramiko does
    ]) + "\n")
    trusted = hostkeys.load_trusted([path])
    assert trusted.lookup("hashed.lab") == {key.get_name(): key}
    assert trusted.lookup("a.lab") == trusted.lookup("10.0.0.1") == {key.get_name(): key}
    assert trusted.lookup("[a.lab]:2222") is None  # ecdsa is revoked wherever it is listed
    assert trusted.lookup("gone.lab") is None and trusted.lookup("neg.lab") is None and trusted.lookup("any.lab") is None
    assert trusted.lookup("x.lab") is None


def test_a_revoked_key_is_judged_revoked_never_new_so_trust_hosts_does_not_record_it(keypair, tmp_path):
    key, _ = keypair
    path = tmp_path / "known_hosts"
    path.write_text(f"@revoked * {key.get_name()} {key.get_base64()}\n")
    trusted = hostkeys.load_trusted([path])
    assert trusted.revoked(key) and hostkeys.judge("h", key, trusted) == "revoked"
    trusted.add("h", key.get_name(), key)  # even recorded by hand elsewhere, it stays revoked
    assert trusted.lookup("h") is None and hostkeys.judge("h", key, trusted) == "revoked"


def test_known_hosts_lines_are_indexed_not_decoded_until_a_host_is_looked_up(keypair, tmp_path, monkeypatch):
    """paramiko's HostKeys.load checks every line against all before it (quadratic) and decodes every key, for
    each connection; mnft reads the files once per command and decodes only the keys of the hosts it dials."""
    key, _ = keypair
    path = tmp_path / "known_hosts"
    path.write_text("".join(f"node{i}.lab {key.get_name()} {key.get_base64()}\n" for i in range(20_000)))
    decoded = []
    original = paramiko.PKey.from_type_string
    monkeypatch.setattr(paramiko.PKey, "from_type_string", classmethod(lambda cls, *a: decoded.append(a[0]) or original(*a)))
    trusted = hostkeys.load_trusted([path])
    assert decoded == []
    assert trusted.lookup("node19999.lab") == {key.get_name(): key} and decoded == [key.get_name()]


def test_a_known_hosts_file_past_its_limit_is_refused_without_reading_it(tmp_path):
    from mnft.core import limits

    huge = tmp_path / "known_hosts"
    with open(huge, "wb") as f:
        f.truncate(limits.KNOWN_HOSTS_BYTES + 1)  # sparse: nothing to read, just a size
    with pytest.raises(InputError, match=f"^{huge}: the known_hosts file is larger than 16 MiB"):
        hostkeys.load_trusted([huge])


def test_an_unreadable_known_hosts_file_is_bad_input_naming_it(tmp_path):
    unreadable = tmp_path / "known_hosts"
    unreadable.mkdir()  # a directory where the file should be: unreadable even for root
    inv = parse(f"known_hosts: {unreadable}\nhosts:\n  remote: {{address: 127.0.0.1, port: {closed_port()}}}\n")
    with pytest.raises(InputError, match=f"^{unreadable}: cannot read the known_hosts file"):
        Fleet(inv, Timeouts(connect=2))


def test_every_proxyjump_hop_rejects_unknown_keys_and_trusts_the_same_files(private_home, keypair, tmp_path):
    import fabric

    from mnft.hosts.connection import fabric_connection, gateway_hops
    from mnft.hosts.settings import Host

    key, _ = keypair
    (private_home / ".ssh").mkdir()
    (private_home / ".ssh" / "config").write_text(
        "Host target\n  HostName 10.9.0.5\n  ProxyJump jumper@bastion:2200,inner\n"
    )
    trusted = tmp_path / "trusted"
    trusted.write_text(f"[bastion]:2200 {key.get_name()} {key.get_base64()}\ninner {key.get_name()} {key.get_base64()}\n")
    conn = fabric_connection(Host("target", 0, "target"), Timeouts(connect=3), fabric.Config(), hostkeys.load_trusted([trusted]))
    hops = gateway_hops(conn)
    assert sorted((h.host, h.port) for h in hops) == [("bastion", 2200), ("inner", 22)]
    for hop in [conn, *hops]:
        assert isinstance(hop.client._policy, hostkeys.RejectUnknownHostKey)  # never Fabric's AutoAddPolicy
    # each hop holds the keys trusted for the name it dials, and nothing else: the target's own key is unknown
    assert [(h.host, dict(h.client.get_host_keys().lookup(hostkeys.known_name(h.host, h.port)) or {})) for h in [conn, *hops]] == [
        ("10.9.0.5", {}), ("bastion", {key.get_name(): key}), ("inner", {key.get_name(): key})]
    assert all(h.connect_timeout == 3 and h.connect_kwargs["banner_timeout"] == 3 for h in hops)


def test_key_types_already_trusted_for_a_host_are_asked_for_first():
    available = ("ssh-ed25519", "ecdsa-sha2-nistp256", "rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
    assert hostkeys.preferred_key_types([], available) == list(available)
    assert hostkeys.preferred_key_types(["ecdsa-sha2-nistp256"], available)[0] == "ecdsa-sha2-nistp256"
    assert hostkeys.preferred_key_types(["ssh-rsa"], available)[:3] == ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"]
    assert sorted(hostkeys.preferred_key_types(["ssh-rsa", "ssh-ed25519"], available)) == sorted(available)


# ------------------------------------------------------------------------------------------------ real sshd


@pytest.mark.cluster
def test_one_connection_per_host_serves_every_phase(cluster, tmp_path):
    from mnft.hosts import inventory

    inv = inventory.load(cluster.write_inventory(tmp_path / "inventory.yaml"))
    with Fleet(inv, Timeouts(connect=10, command=30)) as fleet:
        first = fleet.run(Command.of("sh", "-c", 'echo "$SSH_CONNECTION"'))
        second = fleet.run(Command.of("sh", "-c", 'echo "$SSH_CONNECTION"'))
    assert all(r.ok for r in (*first, *second))
    for host in cluster.hosts:
        assert first[host.name].stdout == second[host.name].stdout  # same client port: the same TCP connection
        assert host.address in first[host.name].stdout


@pytest.mark.cluster
def test_a_host_key_missing_from_every_file_is_rejected_not_added(cluster, tmp_path):
    from mnft.hosts import inventory

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = inventory.load(cluster.write_inventory(tmp_path / "inventory.yaml", hosts=cluster.hosts[:2], known_hosts=str(empty)))
    with Fleet(inv, Timeouts(connect=10, command=30)) as fleet:
        results = fleet.run(Command.of("true"))
    assert {r.status for r in results} == {Status.HOST_KEY_REJECTED}
    assert all("unknown host key" in r.error and "trust-hosts" in r.error for r in results)
    assert empty.read_text() == "" and not (tmp_path / "mnft-home" / "known_hosts").exists()


@pytest.mark.cluster
def test_trust_hosts_dry_run_shows_fingerprints_and_records_nothing(cluster, tmp_path):
    from mnft.hosts import inventory
    from mnft.hosts.trust import trust_hosts

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inv = inventory.load(cluster.write_inventory(tmp_path / "inventory.yaml", known_hosts=str(empty)))
    results = trust_hosts(inv, Timeouts(connect=10), dry_run=True)
    assert [r.state for r in results] == ["new"] * len(cluster.hosts)
    for result, host in zip(results, cluster.hosts):
        key = paramiko.PKey.from_type_string(host.host_key_pub.split()[0], __import__("base64").b64decode(host.host_key_pub.split()[1]))
        assert result.fingerprint == hostkeys.fingerprint(key)
        assert result.known_as == host.address
    assert not (tmp_path / "mnft-home" / "known_hosts").exists()


def test_a_bounded_command_keeps_its_output_and_exit_code_and_its_input(tmp_path):
    command = Command.of("sh", "-c", "read line; echo \"got $line\"; echo err >&2; exit 3", cwd=str(tmp_path)).render()
    done = subprocess.run(["sh", "-c", bounded(command, timeout=30)], input=b"it\n", capture_output=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, b"got it\n", b"err\n")


def test_a_bounded_command_past_its_time_is_stopped_with_its_children(tmp_path):
    marker = tmp_path / "left"
    # a child in the background would outlive a plain kill of the shell; the host's timeout signals the group
    command = Command.of("sh", "-c", f"(sleep 2; touch {marker}) & sleep 60").render()
    done = subprocess.run(["sh", "-c", bounded(command, timeout=0, grace=0.5)], capture_output=True, timeout=30)
    assert done.returncode == 124  # coreutils timeout: the command timed out
    time.sleep(3)  # past the moment the background child would have written its marker
    assert not marker.exists()


@pytest.mark.cluster
def test_a_timed_out_remote_command_does_not_stay_running(healthy_cluster, tmp_path):
    # closing the channel does not stop a command without a pty and this sshd refuses 'signal' requests, so the
    # host's own timeout stops it, REMOTE_GRACE (10 s) after the controller gave up
    from mnft.hosts import inventory

    cluster = healthy_cluster
    host = cluster.hosts[0]
    inv = inventory.load(cluster.write_inventory(tmp_path / "inventory.yaml", hosts=[host]))
    with Fleet(inv, Timeouts(connect=10, command=30)) as fleet:
        result = fleet.run(Command.of("sleep", "417"), timeout=1)[host.name]
        assert result.status is Status.FAILED and "timed out" in result.error
        again = fleet.run(Command.of("echo", "still usable"))[host.name]
        assert again.ok and again.stdout == "still usable\n"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any("sleep 417" in cmd for _, cmd in cluster.processes(host)):
        time.sleep(0.2)
    assert not any("sleep 417" in cmd for _, cmd in cluster.processes(host))


def _key_server(keys):
    """A socket to an SSH server (paramiko, in a thread) that holds `keys` as host keys."""
    import threading

    client, server = socket.socketpair()

    def serve():
        transport = paramiko.Transport(server)
        for key in keys:
            transport.add_server_key(key)
        try:
            transport.start_server(server=paramiko.ServerInterface())
        except (paramiko.SSHException, EOFError, OSError):
            pass

    threading.Thread(target=serve, daemon=True).start()
    return client


def test_trust_hosts_asks_for_the_key_type_already_recorded(keypair, tmp_path):
    ed25519, _ = keypair
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(tmp_path / "ecdsa")], check=True)
    ecdsa = paramiko.ECDSAKey.from_private_key_file(str(tmp_path / "ecdsa"))
    # a server with both keys presents ed25519 by default, and the recorded ecdsa key when that is asked for
    assert hostkeys.fetch_host_key("h", 22, 5, _key_server([ed25519, ecdsa])) == ed25519
    fetched = hostkeys.fetch_host_key("h", 22, 5, _key_server([ed25519, ecdsa]), recorded=["ecdsa-sha2-nistp256"])
    assert fetched == ecdsa
    trusted = hostkeys.TrustedKeys()
    trusted.add("h", ecdsa.get_name(), ecdsa)
    assert hostkeys.judge("h", fetched, trusted) == "already-trusted"


@pytest.mark.cluster
def test_a_proxyjump_hop_is_verified_like_a_host_and_trust_hosts_reads_keys_through_it(cluster, tmp_path, private_home):
    from mnft.hosts import inventory
    from mnft.hosts.trust import trust_hosts

    hop = cluster.hosts[0]
    # `behind` is 127.0.0.1 as the hop sees it: the hop's own sshd, reachable only through the hop (dialled
    # directly from here it would be this machine), so what answers proves the path taken.
    (private_home / ".ssh").mkdir()
    (private_home / ".ssh" / "config").write_text(
        f"Host behind\n  HostName 127.0.0.1\n  ProxyJump root@{hop.address}\n"
        f"Host {hop.address}\n  IdentityFile {cluster.controller_key}\n"
    )
    hop_trusted = tmp_path / "hop_known_hosts"
    hop_trusted.write_text(f"{hop.address} {hop.host_key_pub}\n")
    nothing = tmp_path / "empty_known_hosts"
    nothing.write_text("")

    def inv(known_hosts):
        return inventory.parse(f"known_hosts: {known_hosts}\nhosts:\n  behind: {{user: root, identity: {cluster.controller_key}}}\n")

    with Fleet(inv(nothing), Timeouts(connect=10)) as fleet:  # the hop's key is unknown: refused, never added
        [result] = fleet.connect_all()
    assert result.status is Status.HOST_KEY_REJECTED
    assert "unknown host key ssh-ed25519" in result.error and f"for {hop.address} (ProxyJump hop to 127.0.0.1)" in result.error

    with Fleet(inv(hop_trusted), Timeouts(connect=10)) as fleet:  # hop trusted, the host behind it not yet
        [result] = fleet.connect_all()
    assert result.status is Status.HOST_KEY_REJECTED and "for 127.0.0.1;" in result.error

    [trusted] = trust_hosts(inv(hop_trusted), Timeouts(connect=10))
    assert (trusted.known_as, trusted.state) == ("127.0.0.1", "recorded")
    assert trusted.fingerprint == hostkeys.fingerprint(paramiko.PKey.from_type_string(*_split(hop.host_key_pub)))
    with Fleet(inv(hop_trusted), Timeouts(connect=10, command=20)) as fleet:
        [result] = fleet.run(Command.of("hostname"))
    assert result.ok and result.stdout.strip() == cluster.run(hop, ["hostname"]).stdout.strip()


def _split(public: str):
    import base64

    kind, data = public.split()[:2]
    return kind, base64.b64decode(data)


def test_closing_a_local_connection_ends_the_stdin_of_what_it_still_runs_as_an_ssh_close_would():
    """mnft's host scripts that outlive a command (a lease's holder, an installer) end when their stdin does:
    on an SSH host when the connection closes, and on a `connection: local` host when the fleet closes."""
    from mnft.hosts.connection import LocalConnection
    from mnft.hosts.settings import Host

    conn = LocalConnection(Host("here", 0, "127.0.0.1", connection="local"))
    waiting = conn.start("cat >/dev/null; echo stdin ended")
    finished = conn.run("echo done")
    assert finished.stdout.strip() == "done"
    conn.close()
    done = waiting.wait(10)  # not communicate(): that would close stdin itself
    assert (done.exit_code, done.stdout.strip()) == (0, "stdin ended")
