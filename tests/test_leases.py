"""One operation per host at a time (issue 19, class 6): the host leases, with `connection: local` hosts (a local
shell per host, the host side shipped through pyrun as to any host) and MNFT_LEASE_DIR in a temporary directory
(conftest's `lease_dir`).

A lease is the machine's, not the login's: one file for every user of the host. It is held while a process holds
a flock on it: the controller's `hold` process (as long as its channel lives), or a run's keeper. A second
operation is refused naming the holder (and, for another login, whom to ask); a lease whose holder is gone is
taken over, said once; nested takes in one controller are no-ops. The lease directory is one where anyone may
plant anything: a file mnft did not make is refused with one line, and never written through."""

from __future__ import annotations

import fcntl
import json
import marshal
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mnft.hosts import leases, pyrun

from mnft.onhost import leasefiles, procs, runs
from mnft.onhost import leases as hostleases
from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse

LEASE, LOCK = "mnft-lease.json", "mnft-lease.lock"


def fleet_of(*names: str) -> Fleet:
    return Fleet(parse("hosts:\n" + "".join(f"  {n}: {{connection: local, python: {json.dumps(sys.executable)}}}\n" for n in names)))


def holder_on_disk(directory: Path) -> dict:
    return json.loads((directory / LEASE).read_text())


def hold_process(directory: Path, holder: dict, *, user: int | None = None, python: str = sys.executable) -> subprocess.Popen:
    """Another controller's hold process on this host (its stdin is its channel), as this user or `user`."""
    proc = subprocess.Popen([python, "-c", pyrun.BOOTSTRAP, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, MNFT_LEASE_DIR=str(directory)), user=user, cwd="/")
    proc.stdin.write(pyrun.payload("leasehost") + json.dumps(holder).encode() + b"\n")
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    assert reply.get("taken"), reply
    return proc


def let_go(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)


OTHER = {"op": "other-op", "command": "sync", "run_id": None, "user": "ana", "controller": "ctl2", "pid": 4242, "started": time.time()}


def test_a_free_host_is_leased_for_the_block_and_the_lease_names_its_holder_and_login(lease_dir):
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync") as held:
        on_disk = holder_on_disk(lease_dir)
        assert on_disk["command"] == "sync" and on_disk["pid"] == os.getpid() and on_disk["op"] == held.op
        assert on_disk["uid"] == os.getuid() and on_disk["login"] == procs.user_name(os.getuid())
        assert leases.show(fleet, fleet.inventory.hosts)["h1"]["held"] is True
    assert holder_on_disk(lease_dir)["released"]  # let go at the end of the block
    with fleet_of("h1") as fleet:
        assert leases.show(fleet, fleet.inventory.hosts)["h1"]["held"] is False


def test_the_lease_script_reaches_each_host_compiled_once_on_the_controller(lease_dir, monkeypatch):
    """A host runs the controller's bytecode of the lease script (a take, lab, show): it does not compile its modules'
    source itself on every look. Shown with a payload whose sources would not even compile: only their bytecode runs."""
    import marshal
    import zlib

    from mnft.hosts import payload

    head, body = payload.build("leasehost").split(b"\n", 1)
    modules = marshal.loads(zlib.decompress(body))
    junk = {name: (b"this is not python (", code) for name, (source, code) in modules.items() if code and name != "boot"}  # boot runs as source
    monkeypatch.setattr(leases, "script", lambda: payload.pack("leasehost", junk))
    with fleet_of("h1") as fleet:
        with leases.hold(fleet, fleet.inventory.hosts, "sync"):
            assert leases.show(fleet, fleet.inventory.hosts)["h1"]["held"] is True
        assert "devices" in leases.lab(fleet, fleet.inventory.hosts)["h1"]
    assert holder_on_disk(lease_dir)["released"]


def test_a_second_operation_on_a_busy_host_is_refused_naming_the_host_and_the_holder(lease_dir):
    other = hold_process(lease_dir, dict(OTHER, command="train", run_id="20260101-1200-ab12"))
    try:
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy) as refused:
            with leases.hold(fleet, fleet.inventory.hosts, "provision"):
                pytest.fail("the block ran on a busy host")
        line = str(refused.value)
        me = procs.user_name(os.getuid())
        assert line.startswith(f"h1 is busy: train run 20260101-1200-ab12 by {me} (ana@ctl2) pid 4242 since ")
        assert "(mnft stop 20260101-1200-ab12, or wait)" in line and "\n" not in line  # the same login: it may stop it
        assert refused.value.exit_code == 1
        assert holder_on_disk(lease_dir)["op"] == "other-op"  # untouched
    finally:
        let_go(other)


def test_a_refusal_lets_go_of_the_hosts_taken_before_it(lease_dir, tmp_path, monkeypatch):
    other_dir = tmp_path / "other-machine"
    other_dir.mkdir()
    other = hold_process(other_dir, OTHER)  # h2 is busy, h1 free
    python2 = tmp_path / "python-h2"  # h2: another machine, as far as its lease is concerned
    python2.write_text(f"#!/bin/sh\nMNFT_LEASE_DIR={other_dir} exec {sys.executable} \"$@\"\n")
    python2.chmod(0o755)
    monkeypatch.setattr(leases, "host_key", lambda host: host.name)
    inv = parse(f"hosts:\n  h1: {{connection: local, python: {json.dumps(sys.executable)}}}\n  h2: {{connection: local, python: {python2}}}\n")
    try:
        with Fleet(inv) as fleet:
            taking = leases.Leases("setup")
            with pytest.raises(leases.HostBusy, match=r"^h2 is busy: sync by \S+ \(ana@ctl2\) pid 4242 since .*\(wait for it to end\); nothing was changed"):
                taking.take(fleet, inv.hosts)
            assert taking.processes == {} and "h1" not in leases._held
            assert holder_on_disk(lease_dir)["released"]  # h1's, taken and let go
            with leases.hold(fleet, inv.hosts[:1], "sync"):
                pass
    finally:
        let_go(other)


def test_a_lease_whose_holder_is_gone_is_taken_over_and_that_is_said_once(lease_dir):
    other = hold_process(lease_dir, OTHER)
    other.kill()  # its controller vanished: the channel closed, the hold process is gone, nothing was released
    other.wait()
    assert "released" not in holder_on_disk(lease_dir)
    said = []
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "setup", on_took_over=lambda h, prev: said.append((h, prev["op"]))):
        assert holder_on_disk(lease_dir)["command"] == "setup"
    assert said == [("h1", "other-op")]


def test_a_lease_released_by_its_holder_is_taken_without_a_word(lease_dir):
    other = hold_process(lease_dir, OTHER)
    let_go(other)
    said = []
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync", on_took_over=lambda h, prev: said.append(h)):
        pass
    assert said == []


def wait_for_run_processes(run_id: str) -> None:
    deadline = time.monotonic() + 30
    while not runs.run_processes(run_id) and time.monotonic() < deadline:  # until its exec is done
        time.sleep(0.05)


def test_a_run_whose_processes_live_on_holds_its_lease_after_its_holders_are_gone(lease_dir):
    other = hold_process(lease_dir, dict(OTHER, command="train", run_id="R7"))
    other.kill()
    other.wait()
    # a worker of attempt 2 of the run, orphaned (its keeper killed): the run is not over on this host
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=dict(os.environ, MNFT_RUN_ID="R7-a2"))
    try:
        wait_for_run_processes("R7")
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match=r"^h1 is busy: train run R7 by \S+ \(ana@ctl2\)"):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)
    finally:
        worker.kill()
        worker.wait()
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
        pass


def test_a_keeper_sharing_the_lock_keeps_the_host_busy_after_the_controller_let_go(lease_dir):
    # the agent gives a run's keeper the lease (mnft.onhost.runleases.lease_fd): a detached run holds its host
    from mnft.onhost import runleases

    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "train", run_id="R8"):
        assert runleases.lease_path() == leasefiles.lease_path() == str(lease_dir / LEASE)
        fd = runleases.lease_fd("R8-a2")
        assert fd is not None and runleases.lease_fd("R9") is None
    try:
        assert "released" not in holder_on_disk(lease_dir)  # somebody else still holds it
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match=r"^h1 is busy: train run R8 "):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)
    finally:
        os.close(fd)
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
        pass


@pytest.mark.parametrize("content", [b'{"run_id": 7}', b"[" * 100000, b'{"run_id": ["R"]}', b"\xff\xfe not json"])
def test_a_keeper_is_not_given_a_lease_whose_run_id_is_not_text(lease_dir, content):
    from mnft.onhost import runleases

    (lease_dir / LEASE).write_bytes(content)  # any user of the host may write the lease: the launch goes on
    assert runleases.lease_fd("R") is None


def test_takes_nested_in_one_controller_are_no_ops_and_two_names_for_one_machine_share_one_lease(lease_dir):
    with fleet_of("a", "b") as fleet, leases.hold(fleet, fleet.inventory.hosts, "train", run_id="R1") as outer:
        assert list(outer.processes) == ["a"]  # b is the same machine
        with leases.hold(fleet, fleet.inventory.hosts, "sync") as inner:  # train's own sync
            assert inner.processes == {}
        assert leases.show(fleet, fleet.inventory.hosts[:1])["a"]["held"] is True
    assert holder_on_disk(lease_dir)["released"]


def test_two_logins_of_one_machine_are_one_lease_key():
    alice, bob = (SimpleNamespace(is_local=False, address="10.0.0.1", port=22, user=user) for user in ("alice", "bob"))
    assert leases.host_key(alice) == leases.host_key(bob)
    assert leases.host_key(SimpleNamespace(is_local=True, address="h", port=22, user="x")) == ("local",)


def test_a_hold_without_heartbeat_lets_go_after_its_deadman(lease_dir):
    proc = hold_process(lease_dir, dict(OTHER, deadman=0.5))
    assert proc.wait(timeout=30) == 0  # its stdin is still open: the controller is silent, not gone
    assert holder_on_disk(lease_dir)["released"]


# ------------------------------------------------------------------------------------ runs in the holder

ECHO = "import json, sys\ndef main(argv):\n    print(json.dumps({'argv': argv, 'stdin': sys.stdin.read()}))\n    return int(argv[0])\n"


def entry(source: str, argv: list, stdin: str = "") -> dict:
    """A run request of an ad-hoc host entry whose main is the source's (as pyrun.run_request makes one)."""
    import base64

    from mnft.hosts import payload

    shipped = payload.pack("x", {"x": (source.encode(), marshal.dumps(compile(source, "x", "exec", dont_inherit=True)))})
    return {"payload": base64.b64encode(shipped).decode(), "argv": argv, "stdin": stdin}


def ask(proc: subprocess.Popen, request: dict, *pieces: bytes) -> dict:
    """Write a run request (after `pieces`: heartbeats, a request split in two…) and read the holder's answer."""
    body = json.dumps(request).encode()
    for piece in pieces:
        proc.stdin.write(piece)
        proc.stdin.flush()
    proc.stdin.write(b"run %d\n" % len(body) + body)
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_the_holder_runs_the_operations_scripts_forked_with_their_arguments_and_stdin_between_heartbeats(lease_dir):
    proc = hold_process(lease_dir, dict(OTHER))
    try:
        answer = ask(proc, entry(ECHO, ["0", "a b", "$HOME"], "rules\n"), b"hb\n")
        assert answer["ran"] == 0 and json.loads(answer["out"]) == {"argv": ["0", "a b", "$HOME"], "stdin": "rules\n"}
        answer = ask(proc, entry(ECHO, ["3"]), b"hb\nhb\n")  # an exit status is told
        assert answer["ran"] == 3
        answer = ask(proc, entry("raise ValueError('a bug')", []))
        assert answer["ran"] == 1 and answer["out"] == ""
        assert holder_on_disk(lease_dir)["op"] == OTHER["op"] and proc.poll() is None  # still held
    finally:
        let_go(proc)
    assert holder_on_disk(lease_dir)["released"]


def test_a_release_during_a_run_ends_the_run_with_the_lease(lease_dir, tmp_path):
    proc = hold_process(lease_dir, dict(OTHER))
    sleeper = "import os, time\ndef main(argv):\n    open(argv[0], 'w').write(str(os.getpid()))\n    time.sleep(600)\n"
    body = json.dumps(entry(sleeper, [str(tmp_path / "pid")])).encode()
    proc.stdin.write(b"run %d\n" % len(body) + body)
    proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((tmp_path / "pid").read_text())
    let_go(proc)
    assert holder_on_disk(lease_dir)["released"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("header", [b"run x\n", b"run 0\n", b"run 99999999999\n", b"release\n"])
def test_a_malformed_request_or_release_lets_the_lease_go(lease_dir, header):
    proc = hold_process(lease_dir, dict(OTHER))
    proc.stdin.write(header)
    proc.stdin.flush()
    assert proc.wait(timeout=10) == 0
    assert holder_on_disk(lease_dir)["released"]


def test_a_sync_hashes_each_host_in_its_lease_holder_and_answers_as_its_own_round_trip_would(lease_dir, tmp_path):
    from mnft.sync import mirror

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("print('a')\n")
    with fleet_of("h1", "h2") as fleet:
        hosts = fleet.inventory.hosts
        targets = {h.name: str(tree) for h in hosts}
        alone = mirror.read_remote(fleet, hosts, targets, ["*.pyc"], mark="n1")
        with leases.hold(fleet, hosts[:1], "sync") as held:
            calls = []
            run = held.run

            def counted(host, *args, **options):
                result = run(host, *args, **options)
                calls.append(host) if result is not None else None
                return result

            held.run = counted
            leased = mirror.read_remote(fleet, hosts, targets, ["*.pyc"], mark="n2")
    assert calls == ["h1"]  # h2 (another name for this machine) is no hold process of this lease: its own round-trip
    for name in ("h1", "h2"):
        (_, a), (result, b) = alone[name], leased[name]
        assert result.ok and (a.digest, a.files, a.root) == (b.digest, b.files, b.root) and b.mark.why is None
    sees = {name: set(leased[name][1].mark.seen) for name in ("h1", "h2")}
    assert mirror.groups_of(["h1", "h2"], sees) == {"h1": ("h1", "h2"), "h2": ("h1", "h2")}  # one directory: found sharing


# ------------------------------------------------------------------------------------ where the lease is


def fake_stat(**dirs: tuple[int, int]):
    """An os.stat whose answers are {path: (mode, uid)} (keys with '/' as '_'); any other path is missing."""
    table = {"/" + k.replace("_", "/"): v for k, v in dirs.items()}

    def stat_of(path):
        if path not in table:
            raise FileNotFoundError(path)
        mode, uid = table[path]
        return SimpleNamespace(st_mode=mode, st_uid=uid)

    return stat_of


@pytest.mark.parametrize("run_lock, chosen", [
    ((stat.S_IFDIR | 0o1777, 0), "/run/lock"),  # Debian, Ubuntu: a tmpfs every user may use
    ((stat.S_IFDIR | 0o755, 0), "/tmp"),  # Fedora, RHEL: root's alone
    ((stat.S_IFDIR | 0o777, 0), "/tmp"),  # not sticky: anyone could remove another's lease
    ((stat.S_IFDIR | 0o1777, 1000), "/tmp"),  # a user's directory
    ((stat.S_IFREG | 0o1777, 0), "/tmp"),
    (None, "/tmp"),  # no /run/lock
])
def test_the_lease_directory_is_run_lock_when_every_user_may_use_it_else_tmp(run_lock, chosen):
    from mnft.onhost import runleases

    dirs = {"run_lock": run_lock} if run_lock else {}
    stat_of = fake_stat(**dirs, tmp=(stat.S_IFDIR | 0o1777, 0))
    assert leasefiles.lease_dir({}, stat_of) == chosen
    assert runleases.lease_path({}, stat_of) == os.path.join(chosen, LEASE)  # the keeper holds the same file


def test_mnft_lease_dir_overrides_the_choice_and_must_be_absolute():
    from mnft.onhost import runleases

    assert leasefiles.lease_dir({"MNFT_LEASE_DIR": "/srv/lab-locks"}, fake_stat()) == "/srv/lab-locks"
    assert runleases.lease_path({"MNFT_LEASE_DIR": "/srv/lab-locks"}, fake_stat()) == os.path.join("/srv/lab-locks", LEASE)
    with pytest.raises(OSError, match="MNFT_LEASE_DIR=locks: not an absolute path"):
        leasefiles.lease_dir({"MNFT_LEASE_DIR": "locks"}, fake_stat())
    assert runleases.lease_path({"MNFT_LEASE_DIR": "locks"}, fake_stat()) is None


def test_the_agent_names_the_lease_as_the_host_side_does_on_this_machine(monkeypatch):
    from mnft.onhost import runleases

    monkeypatch.delenv("MNFT_LEASE_DIR")
    assert runleases.lease_path() == leasefiles.lease_path() == os.path.join(leasefiles.lease_dir(), LEASE)
    assert leasefiles.lease_dir() == ("/run/lock" if leasefiles.shared_dir("/run/lock") else "/tmp")


def test_the_lease_files_are_made_for_every_user_whatever_the_umask(lease_dir):
    old = os.umask(0o077)
    try:
        with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((lease_dir / LEASE).stat().st_mode) == 0o666  # every user writes the holder it takes it as
    assert stat.S_IMODE((lease_dir / LOCK).stat().st_mode) == 0o644  # a flock needs only a read-only descriptor


# ------------------------------------------------------------------------------------ files planted in the lease directory


def refused_take(lease_dir: Path) -> str:
    with fleet_of("h1") as fleet:
        taking = leases.Leases("sync")
        with pytest.raises(leases.HostBusy) as refused:
            taking.take(fleet, fleet.inventory.hosts)
        assert taking.processes == {} and not leases._held
    line = str(refused.value)
    assert "\n" not in line and line.endswith("; nothing was changed on any host")
    return line


def test_a_symlink_at_the_lease_path_is_refused_naming_it_and_its_target_is_untouched(lease_dir, tmp_path):
    target = tmp_path / "precious"
    target.write_text("root:secret\n")
    (lease_dir / LEASE).symlink_to(target)
    line = refused_take(lease_dir)
    assert line.startswith(f"h1: no lease can be taken: {lease_dir / LEASE} is a symbolic link, never followed by mnft (owner ")
    assert "remove it (as root) when no mnft runs on this host" in line
    assert target.read_text() == "root:secret\n"


def test_a_symlink_at_the_lock_path_is_refused_too(lease_dir, tmp_path):
    (lease_dir / LOCK).symlink_to(tmp_path / "nowhere")
    assert f"{lease_dir / LOCK} is a symbolic link" in refused_take(lease_dir)
    assert not (tmp_path / "nowhere").exists()  # not created through the link


def test_a_hard_link_at_the_lease_path_is_refused_and_the_file_it_names_is_never_truncated(lease_dir, tmp_path):
    shadow = tmp_path / "shadow"  # as /etc/shadow would be, where fs.protected_hardlinks is off
    shadow.write_text("root:$6$hash:19000:0:99999:7:::\n")
    os.link(shadow, lease_dir / LEASE)
    line = refused_take(lease_dir)
    assert f"{lease_dir / LEASE} has 2 hard links: it may be another file's name" in line and "(the file it links to stays)" in line
    assert shadow.read_text() == "root:$6$hash:19000:0:99999:7:::\n"


def test_a_file_that_is_not_a_lease_is_never_written_over(lease_dir):
    (lease_dir / LEASE).write_text("important notes\n")
    assert f"{lease_dir / LEASE} holds 16 bytes that are not an mnft lease (owner root)" in refused_take(lease_dir)
    assert (lease_dir / LEASE).read_text() == "important notes\n"


@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_something_else_than_a_file_at_the_lease_path_is_refused(lease_dir, kind):
    path = lease_dir / LEASE
    os.mkfifo(path) if kind == "a FIFO" else path.mkdir()
    assert f"{path} is {kind}, not a lease file (owner root)" in refused_take(lease_dir)


def test_a_missing_lease_directory_is_a_warning_and_the_operation_goes_on(lease_dir):
    shutil.rmtree(lease_dir)
    said = []
    with fleet_of("h1") as fleet:
        taking = leases.Leases("sync")
        taking.take(fleet, fleet.inventory.hosts, on_problem=lambda host, why: said.append((host, why)))
        assert taking.processes == {}
    assert said == [("h1", f"the lease directory {lease_dir} does not exist")]


# ------------------------------------------------------------------------------------ two login users of one host


SYSTEM_PYTHON = "/usr/bin/python3"  # one every user can run (this one may live under /root)
NOBODY, STRANGER = 65534, 65533  # two other users of this machine (the second without a passwd entry)


@pytest.fixture
def shared_dir():
    """A lease directory as /tmp is: sticky, world-writable, root's (the test's own tmp_path is root's alone)."""
    if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs root (to run processes as other users) and {SYSTEM_PYTHON}")
    directory = Path(tempfile.mkdtemp(prefix="mnft-leases-", dir="/tmp"))
    directory.chmod(0o1777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def take_as(directory: Path, user: int | None, command: str = "sync", run_id: str | None = None) -> tuple[dict, subprocess.Popen]:
    """`hold` as another login user: its first reply, and the process (holding the lease if it took it)."""
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", pyrun.BOOTSTRAP, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={"MNFT_LEASE_DIR": str(directory), "PATH": "/usr/bin:/bin"}, user=user, cwd="/")
    holder = dict(OTHER, op=f"op-{user}-{time.monotonic()}", command=command, run_id=run_id)
    proc.stdin.write(pyrun.payload("leasehost") + json.dumps(holder).encode() + b"\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline()), proc


def test_another_login_users_lease_is_seen_and_named_and_the_files_serve_every_user(shared_dir, monkeypatch):
    reply, nobody = take_as(shared_dir, NOBODY, "train", "R1")  # the first user makes the files
    try:
        assert reply["taken"] and (shared_dir / LEASE).stat().st_uid == NOBODY
        refused, stranger = take_as(shared_dir, STRANGER)
        assert refused["busy"] and refused["same_login"] is False and refused["holder"]["login"] == "nobody"
        stranger.wait(timeout=10)
        line = leases.busy_line("h1", refused["holder"], refused["run_processes"], refused["same_login"])
        assert line.startswith("h1 is busy: train run R1 by nobody (ana@ctl2) pid 4242 since ")
        assert line.endswith("(wait, or ask nobody; `mnft status R1` on ctl2 shows it)")
        monkeypatch.setenv("MNFT_LEASE_DIR", str(shared_dir))
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match=r"^h1 is busy: train run R1 by nobody \(ana@ctl2\)"):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)  # root: refused as well
    finally:
        let_go(nobody)
    reply, stranger = take_as(shared_dir, STRANGER)  # a file another user made: taken, written, let go
    assert reply["taken"] and reply["took_over"] is None
    let_go(stranger)
    assert holder_on_disk(shared_dir)["uid"] == STRANGER and holder_on_disk(shared_dir)["released"]


def test_another_users_lease_file_made_unwritable_is_refused_naming_its_owner_and_what_to_do(shared_dir):
    reply, nobody = take_as(shared_dir, NOBODY)
    let_go(nobody)
    (shared_dir / LEASE).chmod(0o644)  # as its owner may
    reply, stranger = take_as(shared_dir, STRANGER)
    assert stranger.wait(timeout=10) == 1
    assert reply["refused"] == (f"{shared_dir / LEASE} is not writable by uid 65533 (mode 0644; mnft makes it 0666) (owner nobody): "
                                "remove it (as nobody or root) when no mnft runs on this host")


def test_between_two_logins_the_flock_tells_a_run_is_alive_not_its_processes(shared_dir, monkeypatch):
    """Another user's /proc/<pid>/environ is unreadable: its orphaned workers (keeper killed) are invisible to a
    second user, who takes the lease over, while root still sees them. What keeps the host is the keeper's flock."""
    reply, nobody = take_as(shared_dir, NOBODY, "train", "R5")
    nobody.kill()
    nobody.wait()
    worker = subprocess.Popen([SYSTEM_PYTHON, "-c", "import time; time.sleep(300)"], env={"MNFT_RUN_ID": "R5-a1"}, user=NOBODY, cwd="/")
    try:
        wait_for_run_processes("R5")
        monkeypatch.setenv("MNFT_LEASE_DIR", str(shared_dir))
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match="^h1 is busy: train run R5 by nobody"):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)  # root reads nobody's environ
        reply, stranger = take_as(shared_dir, STRANGER)
        assert reply["taken"] and reply["took_over"]["run_id"] == "R5"
        let_go(stranger)
    finally:
        worker.kill()
        worker.wait()


def test_a_lock_held_past_its_wait_is_refused_naming_who_holds_it(lease_dir, monkeypatch):
    monkeypatch.setattr(leasefiles, "MUTEX_WAIT", 0.2)
    script = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644); "
              "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", script, str(lease_dir / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(leasefiles.Refused) as refused:
            hostleases.take(dict(OTHER))
        assert str(refused.value) == (f"the lease's lock {lease_dir / LOCK} has been held for over 0.2s by root pid {holder.pid}: "
                                      "another mnft is stuck there, or a user holds it; wait, or ask its user")
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------------------------ what is said


def test_what_a_busy_line_says():
    started = time.mktime((2026, 1, 2, 10, 2, 0, 0, 0, -1))
    holder = {"command": "train", "run_id": "R", "user": "u", "controller": "ctl", "pid": 123, "started": started}
    assert leases.busy_line("h1", holder) == "h1 is busy: train run R by u@ctl pid 123 since 2026-01-02 10:02 (mnft stop R, or wait)"
    now = dict(holder, command="provision", run_id=None, started=time.time())
    assert leases.busy_line("h2", now) == f"h2 is busy: provision by u@ctl pid 123 since {time.strftime('%H:%M')} (wait for it to end)"
    alice = dict(holder, user="alice", login="alice")
    assert leases.busy_line("h1", alice, same_login=False) == (
        "h1 is busy: train run R by alice@ctl pid 123 since 2026-01-02 10:02 (wait, or ask alice; `mnft status R` on ctl shows it)")
    shared = dict(holder, user="alice", login="lab")  # a lab's shared login: the person is on the controller
    assert leases.busy_line("h1", dict(shared, run_id=None), same_login=False) == (
        "h1 is busy: train by lab (alice@ctl) pid 123 since 2026-01-02 10:02 (wait, or ask lab)")


@pytest.mark.parametrize("holder", [
    None, {}, [], "x", {"command": ["train"], "run_id": {"a": 1}, "pid": "1; rm -rf /", "started": "yesterday"},
    {"started": 1e999}, {"started": -5}, {"started": True}, {"pid": True, "user": None, "login": 7},
])
def test_a_lease_any_user_may_write_is_described_without_a_traceback(holder):
    line = leases.busy_line("h1", holder, 2, same_login=False)
    assert line.startswith("h1 is busy: ") and "\n" not in line


def test_what_a_lease_names_is_shown_without_control_characters_and_cut():
    holder = {"command": "train\x1b[2J", "run_id": "R\nh2 is free", "user": "u" * 500, "controller": "[bold]ctl[/]", "login": "lab\r"}
    line = leases.busy_line("h1", holder, same_login=False)
    assert "\x1b" not in line and "\n" not in line and "\r" not in line and "u" * 65 not in line
    assert "train?[2J run R?h2 is free by lab? (" in line and "@[bold]ctl[/]) pid ? since ?" in line


def test_flock_semantics_the_lease_relies_on(tmp_path):
    """A shared flock taken on one open file refuses another's exclusive one, not another shared one; a read-only
    descriptor is enough for both (another user's lease file)."""
    path = tmp_path / "f"
    path.write_text("")
    a, b = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    fcntl.flock(a, fcntl.LOCK_SH)
    with pytest.raises(BlockingIOError):
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(b, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(a), os.close(b)


def test_taking_over_says_why_a_lease_may_be_free_without_claiming_its_holder_died():
    """A detached run's keeper holds its lease to the run's end and does not mark it released: the run may simply
    have ended, so the line does not say its holder is gone."""
    from mnft.hosts.leases import took_over_line

    ran = {"command": "train", "run_id": "r1", "user": "alice", "controller": "ctl", "pid": 7, "started": 0}
    assert took_over_line("h1", ran).endswith(": nobody holds it any more: the run ended, or its controller is gone")
    assert took_over_line("h1", dict(ran, command="sync", run_id=None)).endswith(": its holder is gone")
