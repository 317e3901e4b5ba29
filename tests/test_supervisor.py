"""A detached run's supervisor (issue 41): where it lives, what it is given, what its host side does, and a whole
detached run on this machine (a local inventory: the supervisor is a process of this machine's user).

The same on the simulated cluster, as a member who is not root: tests/test_cluster_supervisor.py."""

from __future__ import annotations

import gzip
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.hosts import inventory as inventories
from mnft.onhost import superhost
from mnft.run import bundle as bundling
from mnft.run import records, supervisor
from mnft.run.bundle import Bundle, Dist
from mnft.run.job import cli_job
from mnft.run.launch import LaunchOptions
from mnft.run.recover import Policy
from mnft.run.train import TrainOptions

REPO = Path(__file__).resolve().parent.parent


def inv(tmp_path: Path, text: str):
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return inventories.load(path)


TWO = "hosts:\n  a: {address: 10.9.0.1, identity: /home/me/.ssh/lab_key, user: me}\n  b: {address: 10.9.0.2}\n"


# ------------------------------------------------------------------------------------------------ where it lives


def test_the_supervisor_lives_on_the_inventorys_supervisor_host_else_the_master(tmp_path):
    assert supervisor.place_of(inv(tmp_path, TWO)).host.name == "a"
    assert "master" in supervisor.place_of(inv(tmp_path, TWO)).why
    named = inv(tmp_path, TWO + "supervisor: b\n")
    assert supervisor.place_of(named).host.name == "b" and supervisor.place_of(named).why == "the inventory's supervisor"
    login = inv(tmp_path, TWO + "supervisor: {name: login, address: 10.9.0.9, user: me}\n")
    place = supervisor.place_of(login)
    assert (place.host.name, place.host.address, place.host.user) == ("login", "10.9.0.9", "me")
    assert [h.name for h in login.hosts] == ["a", "b"]  # the login node does not train


def test_a_local_inventory_is_supervised_here_and_a_mixed_one_nowhere(tmp_path):
    local = inv(tmp_path, "hosts:\n  me: {connection: local}\n")
    assert supervisor.place_of(local).host.is_local
    mixed = inv(tmp_path, "hosts:\n  me: {connection: local}\n  b: {address: 10.9.0.2}\n")
    assert supervisor.place_of(mixed) is None


@pytest.mark.parametrize("text,said", [
    ("supervisor: c\n", "key 'supervisor': 'c' is not a host of this inventory"),
    ("supervisor: [a]\n", "key 'supervisor': expected a host's name or a mapping"),
    ("supervisor: {address: 10.9.0.9, shell: bash}\n", "key 'supervisor': unknown key 'shell'"),
    ("supervisor: {address: 'x y'}\n", "supervisor"),
])
def test_a_bad_supervisor_key_is_one_line_naming_it(tmp_path, text, said):
    with pytest.raises(InputError) as err:
        inv(tmp_path, TWO + text)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_the_supervisor_reaches_the_hosts_as_this_user_with_its_own_keys_never_this_machines_identity_file(tmp_path):
    lab = inv(tmp_path, TWO)
    seen = supervisor.as_seen_from(lab, supervisor.place_of(lab))
    assert [h.identity for h in seen.hosts] == [None, None]
    assert seen.hosts[0].user == "me" and seen.hosts[1].user  # the login this controller's SSH uses, made explicit
    assert seen.known_hosts is None  # its known hosts are the run's own file (the lines of the run's hosts)


# ------------------------------------------------------------------------------------------------ whether it can


def _bundle(*dists: Dist) -> Bundle:
    return Bundle("d" * 32, Path("/nowhere"), dists, (3, 11), "x86_64", ("glibc", "2.36"))


def _host(python=(3, 11, 2), machine="x86_64", libc=("glibc", "2.36"), mesh=True) -> dict:
    return {"python": list(python), "executable": "/usr/bin/python3", "machine": machine, "system": "Linux", "libc": list(libc),
            "mesh_key": mesh, "bundle": False}


PURE = Dist.of("rich", "13.0", (("rich/__init__.py", Path("/x")),), ("py3-none-any",))
WHEEL = Dist.of("pyyaml", "6.0.3", (("yaml/_yaml.cpython-311-x86_64-linux-gnu.so", Path("/x")),), ("cp311-cp311-manylinux_2_17_x86_64",))
DEBIAN = Dist.of("pyyaml", "6.0", (("yaml/_yaml.cpython-311-x86_64-linux-gnu.so", Path("/x")),), ())


def test_a_host_runs_the_bundle_when_its_python_and_platform_take_every_compiled_wheel():
    assert bundling.compatible(_bundle(PURE, WHEEL), _host()) is None
    assert bundling.compatible(_bundle(PURE), _host(python=(3, 12, 1))) is None  # pure Python: any Python ≥ 3.10
    assert "cp312" in bundling.compatible(_bundle(WHEEL), _host(python=(3, 12, 1)))
    assert "aarch64" in bundling.compatible(_bundle(WHEEL), _host(machine="aarch64"))
    assert "glibc 2.12" in bundling.compatible(_bundle(WHEEL), _host(libc=("glibc", "2.12")))
    old = bundling.compatible(_bundle(PURE), _host(python=(3, 8, 10)))
    assert "3.8" in old and "≥ 3.10" in old and "python" in old


def test_a_distribution_installed_without_wheel_tags_needs_this_machines_exact_platform():
    assert bundling.compatible(_bundle(DEBIAN), _host()) is None
    assert "installed for this machine only" in bundling.compatible(_bundle(DEBIAN), _host(libc=("glibc", "2.31")))


def test_a_host_without_a_mesh_key_cannot_supervise_and_the_fix_is_the_mesh(tmp_path):
    lab = inv(tmp_path, TWO)
    why = supervisor.why_not(_host(mesh=False), _bundle(PURE), supervisor.place_of(lab))
    assert why.startswith("a has no mesh key") and "mnft setup --only mesh" in why
    assert supervisor.why_not(_host(mesh=True), _bundle(PURE), supervisor.place_of(lab)) is None


def test_only_what_a_supervisor_gives_refuses_an_unsupervised_detach(tmp_path):
    lab = inv(tmp_path, TWO)
    base = TrainOptions(launch=LaunchOptions(job=cli_job(("train.py",))))
    assert supervisor.needs_supervisor(base, lab) is None
    assert supervisor.needs_supervisor(replace(base, recovery=Policy(max_restarts=1)), lab) == "--max-restarts"
    assert supervisor.needs_supervisor(replace(base, wait=float("inf")), lab) == "--wait"


def test_the_bundle_holds_mnft_and_the_libraries_train_imports_but_never_torch(tmp_path):
    built = bundling.build(tmp_path)
    names = {d.name for d in built.dists}
    assert {"fabric", "paramiko", "invoke", "pyyaml", "rich", "packaging", "cryptography"} <= names
    assert not names & {"torch", "mnft", "setuptools", "pip", "matplotlib"}
    with tarfile.open(built.path) as tar:
        members = tar.getnames()
    assert "site/mnft/run/supervised.py" in members and "site/mnft/onhost/superhost.py" in members
    assert all(m.startswith("site/") and ".." not in m for m in members)
    assert not any("__pycache__" in m for m in members)
    again = bundling.build(tmp_path)
    assert again.digest == built.digest and again.path.stat().st_mtime_ns == built.path.stat().st_mtime_ns  # built once
    assert again.dists == tuple(replace(d, files=()) for d in built.dists)  # its facts from its stamp, no RECORD read
    assert bundling.described(tmp_path).digest == built.digest
    assert bundling.described(tmp_path / "elsewhere").digest == ""  # not built there: a host has no such bundle yet


# ------------------------------------------------------------------------------------------------ what it is given


def test_the_environment_a_run_passes_goes_in_the_spec_and_env_files_stay_here(tmp_path, monkeypatch):
    secrets = tmp_path / "secrets.env"
    secrets.write_text("WANDB_API_KEY=wk-123\n")
    secrets.chmod(0o600)
    monkeypatch.setenv("HF_TOKEN", "hf-abc")
    monkeypatch.setenv("LR", "3e-4")
    monkeypatch.setenv("UNRELATED", "x")
    options = TrainOptions(launch=LaunchOptions(job=cli_job(("train.py",)), env=("LR", "MODE=fast"), env_files=(str(secrets),), detach=True))
    values, lopts = supervisor.shipped_environ(options)
    assert values == {"HF_TOKEN": "hf-abc", "LR": "3e-4", "WANDB_API_KEY": "wk-123"}
    assert lopts.env == ("LR", "MODE=fast", "WANDB_API_KEY") and lopts.env_files == () and lopts.detach is False


# ------------------------------------------------------------------------------------------------ the host side


@pytest.fixture
def host_home(tmp_path, monkeypatch):
    home = tmp_path / "host-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def _tar(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def test_unpack_places_a_bundle_once_and_refuses_one_that_reaches_outside(host_home):
    assert superhost.unpack("b1", io.BytesIO(_tar({"site/pkg/__init__.py": b"x = 1\n"}))) == {"unpacked": True}
    assert (host_home / ".mnft" / "supervisor" / "b1" / "site" / "pkg" / "__init__.py").read_text() == "x = 1\n"
    assert superhost.unpack("b1", io.BytesIO(b"not read")) == {"unpacked": False}
    with pytest.raises(ValueError, match="not a plain file inside it"):
        superhost.unpack("b2", io.BytesIO(_tar({"site/../../evil.py": b"boom"})))
    assert not (host_home / ".mnft" / "evil.py").exists() and not (host_home / ".mnft" / "supervisor" / "b2").exists()
    assert [p.name for p in (host_home / ".mnft" / "supervisor").iterdir()] == ["b1"]  # no temporary left


def test_prepare_makes_a_private_run_directory_once_with_the_files_it_is_given(host_home):
    out = superhost.prepare("r1", {"home/known_hosts": "h1 ssh-ed25519 AAAA\n"})
    folder = Path(out["dir"])
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert (folder / "home" / "known_hosts").read_text() == "h1 ssh-ed25519 AAAA\n"
    with pytest.raises(FileExistsError):
        superhost.prepare("r1", {})
    with pytest.raises(ValueError):
        superhost.prepare("r2", {"../escape": "x"})


FAKE = '''\
import json, os, sys, time
from pathlib import Path
def main(folder):
    spec = sys.stdin.buffer.read()
    me = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    Path(folder, "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "start": me}))
    print("spec", len(spec), "sid", os.getsid(0) == os.getpid(), flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        Path(folder, "exit.json").write_text(json.dumps({"code": 130}))
    return 130
'''


def fake_bundle(home: Path) -> None:
    """Bundle b1 on the host: a stand-in mnft.run.supervised (FAKE) in its site."""
    site = home / ".mnft" / "supervisor" / "b1" / "site" / "mnft" / "run"
    site.mkdir(parents=True)
    (site.parent / "__init__.py").write_text("")
    (site / "__init__.py").write_text("")
    (site / "supervised.py").write_text(FAKE)


def test_start_runs_the_supervisor_in_a_session_of_its_own_and_stop_interrupts_that_process_alone(host_home):
    fake_bundle(host_home)
    superhost.prepare("r1", {})
    (host_home / ".mnft" / "supervised" / "r1" / "runs" / "r1").mkdir()
    started = superhost.start("r1", "b1", lambda: b"the spec")
    try:
        assert started["pid"] > 0 and "error" not in started
        state = superhost.state("r1")
        assert state["alive"] is True and state["supervisor"]["pid"] == started["pid"]
        deadline = time.monotonic() + 10
        while "sid True" not in superhost.state("r1")["log"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "spec 8 sid True" in superhost.state("r1")["log"]  # its spec through the pipe, a session of its own
        assert superhost.start("r1", "b1", lambda: b"again") == {"error": "run r1 has a supervisor already"}
        assert superhost.stop("r1", "me@here pid 1") == {"signalled": True, "alive": True}
        deadline = time.monotonic() + 10
        while superhost.state("r1")["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = superhost.state("r1")
        assert after["alive"] is False and after["exit"] == {"code": 130} and "interrupted" in after["log"]
        asked = json.loads((host_home / ".mnft" / "supervised" / "r1" / "runs" / "r1" / superhost.STOP_REQUESTED).read_text())
        assert asked["by"] == "me@here pid 1"
        assert superhost.stop("r1", "me") == {"signalled": False, "alive": False}  # a pid never signalled twice
        more = superhost.state("r1", after["offset"])
        assert more["log"] == "" and more["offset"] == after["offset"]
    finally:
        try:
            os.killpg(started["pid"], signal.SIGKILL)
        except (OSError, KeyError):
            pass


def test_a_supervisor_that_dies_at_its_start_is_reported_with_its_last_lines(host_home):
    site = host_home / ".mnft" / "supervisor" / "b1" / "site"
    site.mkdir(parents=True)  # no mnft in it: the import fails
    superhost.prepare("r1", {})
    out = superhost.start("r1", "b1", lambda: b"x")
    assert out["error"].startswith("the supervisor ended at its start") and "ModuleNotFoundError" in out["log"]


def test_a_controller_that_sends_no_spec_leaves_no_supervisor_running(host_home):
    fake_bundle(host_home)
    superhost.prepare("r1", {})
    spawned = []

    def no_spec():  # the supervisor was spawned before its spec is read: it is there now
        deadline = time.monotonic() + 10
        while not spawned and time.monotonic() < deadline:
            spawned.extend(pid for pid in os.listdir("/proc") if pid.isdigit() and str(host_home).encode() in _cmdline(pid))
            time.sleep(0.02)
        return b""

    assert superhost.start("r1", "b1", no_spec) == {"error": "no spec came: the supervisor was not started"}
    assert len(spawned) == 1 and not _cmdline(spawned[0])  # and gone now
    assert superhost.state("r1")["alive"] is False


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_host_and_the_controller_name_the_stop_request_and_the_places_alike():
    from mnft.onhost import uninstallhost

    assert superhost.STOP_REQUESTED == records.STOP_REQUESTED
    assert (uninstallhost.SUPERVISOR, uninstallhost.SUPERVISED) == (superhost.BUNDLES, superhost.RUNS)  # what uninstall removes


# ------------------------------------------------------------------------------------------------ a whole run, here


STEPS = '''\
import hashlib, os, sys, time
print("token seen:", hashlib.sha256(os.environ.get("HF_TOKEN", "").encode()).hexdigest() == "e67df5427078e11e12eac7ee195af98786a2ba9829a3dd563880bd694bbd0b18", flush=True)
for i in range(1, int(sys.argv[1]) + 1):
    print(f"step {i} loss {1.0 / i:.4f}", flush=True)
    time.sleep(0.2)
'''


def local_lab(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path]:
    """A tree of these files, and a local inventory (this machine, this Python) whose workdir is under tmp_path."""
    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_text(text)
    lab = tmp_path / "local.yaml"
    lab.write_text(f"hosts:\n  me:\n    connection: local\n    python: {sys.executable}\n    workdir: {tmp_path / 'work'}\n")
    return src, lab


def _mnft(tmp_path: Path, *args: str, env_extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"), **(env_extra or {}))
    env.pop("MNFT_HOME", None)
    (tmp_path / "home").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_detached_run_on_this_machine_is_supervised_followed_and_its_secret_stays_in_memory(tmp_path):
    src, lab = local_lab(tmp_path, {"steps.py": STEPS})
    started = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--detach", "--env", "HF_TOKEN", "--", "steps.py", "8",
                    env_extra={"HF_TOKEN": "hf-secret-9876"})
    assert started.returncode == 0, started.stdout + started.stderr
    [line] = [ln for ln in started.stdout.splitlines() if "handed to its supervisor" in ln]
    run_id = line.split()[1]
    assert "this machine (a local inventory)" in line
    followed = _mnft(tmp_path, "attach", run_id)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "me r0 | token seen: True" in followed.stdout and "me r0 | step 8 loss 0.1250" in followed.stdout
    assert f"run {run_id}: succeeded" in followed.stdout
    status = _mnft(tmp_path, "status", run_id, "--json")
    data = json.loads(status.stdout)
    assert data["supervised_by"]["host"] == "me" and data["supervised_by"]["alive"] is False
    record = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())
    assert record["state"] == "succeeded" and record["supervisor"]["pid"] and record["detach"] is True
    written = [p for p in [*(tmp_path / "home").rglob("*"), *(tmp_path / "runs").rglob("*")] if p.is_file()]
    assert written and not [p for p in written if b"hf-secret-9876" in p.read_bytes()]


# ------------------------------------------------------------------------------------------------ where it is said


def test_status_lab_and_the_board_name_the_supervisor_host_pid_since_and_whether_it_lives():
    from mnft.board.runs import supervisor_of as board_supervisor
    from mnft.hosts.lab import supervisor_of as lab_supervisor
    from mnft.run.report import supervisor_line

    data = {"state": "running", "supervisor": {"host": "h1", "pid": 4242, "since": 1_800_000_000.0, "alive": True}}
    assert supervisor_line(data).startswith("supervisor: h1 pid 4242, since ") and supervisor_line(data).endswith(": alive")
    lost = {"state": "supervisor-lost", "supervisor": {"host": "h1", "pid": 4242, "alive": False}}
    assert supervisor_line(lost) == "supervisor: h1 pid 4242: gone"
    assert supervisor_line({"state": "succeeded", "supervisor": {"host": "h1", "pid": 1, "alive": False, "exit": {"code": 0}}}).endswith(": ended")
    unreached = {"state": "running", "supervisor": {"host": "h1", "pid": 1, "alive": None, "error": "h1: no route to host"}}
    assert supervisor_line(unreached).endswith(": not reached (h1: no route to host)")
    assert lab_supervisor({"supervised": True, "controller": "h1", "pid": 4242}) == "h1 pid 4242"
    assert lab_supervisor({"controller": "laptop", "pid": 7}) is None  # a terminal's run
    assert lab_supervisor({"supervised": "yes", "controller": "h1", "pid": 7}) is None  # anyone may write a lease file: only true counts
    assert board_supervisor(data) == {"host": "h1", "pid": 4242, "since": 1_800_000_000.0, "alive": True, "seen": None}
    assert board_supervisor({"supervisor": {"host": "h1"}}) is None and board_supervisor({}) is None


def test_the_supervisor_gets_the_recorded_host_keys_of_the_runs_hosts_plain_or_hashed_and_no_others(tmp_path, monkeypatch):
    import base64
    import hashlib
    import hmac

    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))
    salt = b"0123456789abcdefghij"
    hashed = "|1|%s|%s" % (base64.b64encode(salt).decode(), base64.b64encode(hmac.new(salt, b"10.9.0.2", hashlib.sha1).digest()).decode())
    known = tmp_path / "known"
    known.write_text(f"10.9.0.1 ssh-ed25519 AAAAone\n{hashed} ssh-ed25519 AAAAtwo\n10.9.0.7 ssh-ed25519 AAAAother\n# a comment\n")
    lab = inv(tmp_path, TWO + f"known_hosts: {known}\n")
    lines = supervisor._known_lines(lab).splitlines()
    assert lines == ["10.9.0.1 ssh-ed25519 AAAAone", f"{hashed} ssh-ed25519 AAAAtwo"]


def test_a_distribution_installed_without_a_record_is_packed_by_its_packages_and_its_metadata(tmp_path):
    """A system package's egg-info (Debian's python3-yaml) has no RECORD: its top-level packages go in whole."""
    from importlib import metadata

    site = tmp_path / "dist-packages"
    (site / "fakepkg").mkdir(parents=True)
    (site / "fakepkg" / "__init__.py").write_text("x = 1\n")
    (site / "fakepkg" / "_speed.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (site / "fakepkg" / "__pycache__").mkdir()
    (site / "fakepkg" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"")
    info = site / "fakepkg-1.0.egg-info"
    info.mkdir()
    (info / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: fakepkg\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("fakepkg\n")
    (site / "other").mkdir()
    (site / "other" / "__init__.py").write_text("")
    dist = metadata.PathDistribution(info)
    assert dist.files is None
    files = bundling._files(dist, {"fakepkg": ["fakepkg"], "other": ["other"]})
    assert sorted(arc for arc, _ in files) == ["fakepkg-1.0.egg-info/PKG-INFO", "fakepkg-1.0.egg-info/top_level.txt",
                                               "fakepkg/__init__.py", "fakepkg/_speed.cpython-311-x86_64-linux-gnu.so"]
    assert Dist.of("fakepkg", "1.0", files, ()).compiled


@pytest.mark.slow
def test_the_board_brings_a_detached_runs_record_from_its_supervisor_as_it_goes(tmp_path, monkeypatch):
    from mnft.board.state import Board

    src, lab = local_lab(tmp_path, {"steps.py": STEPS})
    started = _mnft(tmp_path, "train", "--hosts", str(lab), "--src", str(src), "--detach", "--", "steps.py", "12")
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = started.stdout.split("run ", 1)[1].split()[0]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MNFT_HOME", raising=False)
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    board = Board(inventories.load(lab))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # nobody runs `mnft status`: the board's own rounds bring the record
            board.round()
            row = next(r for r in json.loads(board.runs.text)["runs"] if r["id"] == run_id)
            if row["state"] == "succeeded" and row.get("supervisor"):  # (between the pull and the save, the row is the lab's record alone)
                break
            time.sleep(0.5)
        assert row["state"] == "succeeded" and row["supervisor"]["alive"] is False, row
    finally:
        board.close()
