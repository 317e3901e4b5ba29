"""`invoke provision` on the simulated cluster: the same environment everywhere from a lock, offline (the hosts have
no internet; the wheels are tiny ones made here), drift found by `check` and fixed on that host only, a failure that
leaves a host on its previous environment, a full disk refused before anything is copied, the wheelhouse relayed
over the SSH mesh, rollback, dry run, an idempotent second run, bad input refused with nothing changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from wheelmaker import make_wheel, sha256, write_lock

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
MINOR = "%d.%d" % sys.version_info[:2]


def _base_python() -> str:
    """The hosts' own Python (the system's, when it is this version), else this one (bound into every host)."""
    system = "/usr/bin/python3"
    if os.access(system, os.X_OK):
        done = subprocess.run([system, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
        if done.stdout.strip() == MINOR:
            return system
    return sys.executable


BASE_PYTHON = _base_python()  # the environment holds only what the lock says (built without site-packages)


def controller_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), PYTHONUNBUFFERED="1")


def invoke(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=controller_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def provision_json(tmp_path: Path, inventory: Path, lock: Path | None, *extra: str) -> tuple[int, dict]:
    done = invoke(tmp_path, "provision", "--hosts", str(inventory), *(["--lock", str(lock)] if lock else []), "--json", *extra)
    assert done.returncode != 2, done.stdout + done.stderr
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"provision printed no JSON (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


def env_problems(tmp_path: Path, inventory: Path) -> dict[str, str]:
    done = invoke(tmp_path, "check", "--hosts", str(inventory), "--json", "--no-network")
    report = json.loads(done.stdout)
    return {p["host"]: p["message"] for host in report["hosts"].values() for p in host["problems"] if p["field"] == "env"}


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    directory = tmp_path / "wheels"
    for name, version in (("alpha", "1.0"), ("alpha", "1.1"), ("beta", "2.0"), ("gamma", "0.3")):
        make_wheel(directory, name, version, padding=200_000)
    return directory


def lock_of(tmp_path: Path, wheels: Path, name: str, pins: dict[str, str], **kw) -> Path:
    kw.setdefault("python", MINOR)
    return write_lock(tmp_path / name, sorted(wheels.glob("*.whl")), pins, find_links=wheels, **kw)


def imported(cluster, host, *modules: str) -> list[str]:
    code = "import importlib,sys\nfor m in sys.argv[1:]:\n    print(importlib.import_module(m).__version__)"
    done = cluster.run(host, ["/root/mnft-env/bin/python", "-c", code, *modules])
    return done.stdout.split()


def statuses(report: dict) -> dict[str, str]:
    return {name: h["status"] for name, h in report["hosts"].items()}


def test_provision_from_nothing_then_drift_is_found_by_check_and_fixed_on_that_host_only(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(3)
    h1, h2, h3 = cluster.hosts
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    lock = lock_of(tmp_path, wheels, "requirements.lock", {"alpha": "1.0", "beta": "2.0"})

    code, report = provision_json(tmp_path, inventory, lock)
    assert code == 0, report
    assert statuses(report) == {"h1": "changed", "h2": "changed", "h3": "changed"}
    assert len({h["fingerprint"] for h in report["hosts"].values()}) == 1
    assert not report["relay"] and report["controller_bytes"] >= 3 * report["wheelhouse_bytes"] * 0.9  # no mesh: one copy per host
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "beta") == ["1.0", "2.0"]
        assert not (host.home / "mnft-env.d" / "previous").exists()
    assert env_problems(tmp_path, inventory) == {}  # check runs the environment's python (recorded, not in the inventory)

    # drift h2 by hand: another alpha and an extra package, installed from a copy of the wheels on the host
    shutil.copytree(wheels, h2.home / "drift")
    cluster.run(h2, ["/root/mnft-env.d/dist/uv", "pip", "install", "--quiet", "--offline", "--no-index", "--find-links", "/root/drift",
                     "--python", "/root/mnft-env/bin/python", "alpha==1.1", "gamma==0.3"], env={"UV_CACHE_DIR": "/root/drift-cache"})
    problems = env_problems(tmp_path, inventory)
    assert list(problems) == ["h2"]
    assert "alpha 1.1 (master: 1.0)" in problems["h2"] and "extra: gamma 0.3" in problems["h2"]

    table = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(lock), "--dry-run")
    assert table.returncode == 0, table.stderr
    assert "h2: would build a new environment: upgrade alpha 1.1 -> 1.0; remove gamma 0.3" in table.stdout
    assert "h1: would" not in table.stdout and "nothing was changed" in table.stdout
    assert "shared environments are not detected in a dry run" in table.stdout  # it left no mark to find them

    code, report = provision_json(tmp_path, inventory, lock)
    assert code == 0, report
    assert statuses(report) == {"h1": "ok", "h2": "changed", "h3": "ok"}
    assert report["hosts"]["h2"]["upgrade"] == ["alpha 1.1 -> 1.0"] and report["hosts"]["h2"]["remove"] == ["gamma 0.3"]
    assert imported(cluster, h2, "alpha") == ["1.0"]
    assert env_problems(tmp_path, inventory) == {}

    again = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(lock))
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout and "0 changed" in again.stdout


def test_a_failed_install_leaves_that_host_on_its_previous_environment(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(3)
    h1, h2, h3 = cluster.hosts
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    wheelhouse = tmp_path / "wheelhouse"
    shutil.copytree(wheels, wheelhouse)  # the controller's wheelhouse, made here so the test knows each file's mtime
    v1 = lock_of(tmp_path, wheels, "v1.lock", {"alpha": "1.0", "beta": "2.0"})
    v2 = lock_of(tmp_path, wheels, "v2.lock", {"alpha": "1.1", "beta": "2.0"})
    code, report = provision_json(tmp_path, inventory, v1, "--wheelhouse", str(wheelhouse))
    assert code == 0, report
    v1_env = {h.name: os.readlink(h.home / "mnft-env") for h in cluster.hosts}

    # h2's copy of alpha 1.1 is damaged (same size and time, so a copy by size and time keeps it)
    good = wheelhouse / "alpha-1.1-py3-none-any.whl"
    bad = h2.home / "mnft-env.d" / "dist" / "wheels" / good.name
    bad.write_bytes(b"\0" * good.stat().st_size)
    os.utime(bad, ns=(good.stat().st_atime_ns, good.stat().st_mtime_ns))

    code, report = provision_json(tmp_path, inventory, v2, "--wheelhouse", str(wheelhouse))
    assert code == 1, report
    assert statuses(report) == {"h1": "changed", "h2": "failed", "h3": "changed"}
    assert "keeps its previous environment" in report["hosts"]["h2"]["error"]
    assert os.readlink(h2.home / "mnft-env") == v1_env["h2"]
    assert imported(cluster, h2, "alpha") == ["1.0"] and imported(cluster, h1, "alpha") == imported(cluster, h3, "alpha") == ["1.1"]
    assert sorted(os.listdir(h2.home / "mnft-env.d" / "envs")) == [os.path.basename(v1_env["h2"])]  # the failed build is gone

    code, report = provision_json(tmp_path, inventory, v2, "--wheelhouse", str(wheelhouse))  # the damaged wheel was dropped: sent again
    assert code == 0, report
    assert statuses(report) == {"h1": "ok", "h2": "changed", "h3": "ok"}
    assert imported(cluster, h2, "alpha") == ["1.1"]

    # the controller's connection lost before the switch (the script's stdin closed): the build is thrown away
    from mnft.env.wheelhouse import Wheelhouse
    from mnft.hosts import pyrun
    from mnft.onhost.boot import FILE_BOOTSTRAP

    house = Wheelhouse(wheelhouse)
    spec = {"venv": "~/mnft-env", "id": "lost-connection", "python": BASE_PYTHON, "watch_stdin": True,
            "wheels": [{"name": w.name, "version": w.installed_version, "sha256": w.sha256, "file": w.file, "installed_version": w.installed_version}
                       for w in (house.wheel("alpha-1.1-py3-none-any.whl"), house.wheel("beta-2.0-py3-none-any.whl"))]}
    link = os.readlink(h1.home / "mnft-env")
    shipped = h1.home / "envhost.payload"  # the payload from a file, as a keeper starts: stdin ends right after it
    shipped.write_bytes(pyrun.payload("envhost"))
    done = cluster.run(h1, [BASE_PYTHON, "-c", FILE_BOOTSTRAP, cluster.home_mountpoint + "/envhost.payload", "install", json.dumps(spec)], input="")
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "ok": False, "error": "the controller's connection was lost before the switch: the previous environment stays"}
    assert os.readlink(h1.home / "mnft-env") == link and imported(cluster, h1, "alpha") == ["1.1"]
    assert "lost-connection" not in os.listdir(h1.home / "mnft-env.d" / "envs")

    # an unreachable host is reported as such and keeps what it has; the others are provisioned
    cluster.link_down(h3)
    code, report = provision_json(tmp_path, inventory, v1, "--wheelhouse", str(wheelhouse), "--connect-timeout", "5")
    assert code == 4, report
    assert statuses(report) == {"h1": "changed", "h2": "changed", "h3": "unreachable"}
    cluster.link_up(h3)
    assert imported(cluster, h3, "alpha") == ["1.1"] and imported(cluster, h1, "alpha") == ["1.0"]


def test_a_disk_too_small_is_refused_before_anything_is_copied(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(3)
    h3 = cluster.hosts[2]
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    lock = lock_of(tmp_path, wheels, "requirements.lock", {"alpha": "1.0", "beta": "2.0"})
    cluster.run(h3, ["sh", "-c", "mkdir -p /root/mnft-env.d && mount -t tmpfs -o size=4m tmpfs /root/mnft-env.d"])
    done = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(lock))
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("mnft:")]
    assert "host h3:" in line and "free at /root/mnft-env.d" in line and "nothing was changed on any host" in line
    for host in cluster.hosts:
        assert not (host.home / "mnft-env").exists()
        assert not (host.home / "mnft-env.d" / "dist").exists()


def test_the_wheelhouse_is_relayed_over_the_mesh_so_the_controller_sends_it_about_once(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(4)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    book = tmp_path / "trust.yaml"
    book.write_text("- name: controller key\n  authorized_keys: {}\n- name: mesh\n  mesh: {}\n")
    setup = invoke(tmp_path, "setup", "--hosts", str(inventory), "--playbook", str(book))
    assert setup.returncode == 0, setup.stdout + setup.stderr
    lock = lock_of(tmp_path, wheels, "requirements.lock", {"alpha": "1.0", "beta": "2.0", "gamma": "0.3"})

    counter = Path(f"/sys/class/net/{cluster.bridge}/statistics/tx_bytes")  # what the controller sent onto the cluster network
    before = int(counter.read_text())
    code, report = provision_json(tmp_path, inventory, lock)
    sent = int(counter.read_text()) - before
    assert code == 0, report
    assert report["relay"] is True
    vias = {name: h["via"] for name, h in report["hosts"].items()}
    assert list(vias.values()).count("controller") == 1 and set(vias.values()) - {"controller"} <= {"h1", "h2", "h3", "h4"}
    wheelhouse = report["wheelhouse_bytes"]
    assert report["controller_bytes"] <= 1.1 * wheelhouse
    assert sent <= 1.3 * wheelhouse, (sent, wheelhouse)  # measured on the wire: about one wheelhouse, not four
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "beta", "gamma") == ["1.0", "2.0", "0.3"]


def test_rollback_switches_back_and_forth_and_dry_run_changes_nothing(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(3)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    v1 = lock_of(tmp_path, wheels, "v1.lock", {"alpha": "1.0", "beta": "2.0"})
    v2 = lock_of(tmp_path, wheels, "v2.lock", {"alpha": "1.1", "gamma": "0.3"})
    assert provision_json(tmp_path, inventory, v1)[0] == 0
    assert provision_json(tmp_path, inventory, v2)[0] == 0
    links = {h.name: os.readlink(h.home / "mnft-env") for h in cluster.hosts}

    code, report = provision_json(tmp_path, inventory, v1, "--dry-run")
    assert code == 0 and set(statuses(report).values()) == {"would-change"}
    assert report["hosts"]["h1"]["upgrade"] == ["alpha 1.1 -> 1.0"]
    assert report["hosts"]["h1"]["install"] == ["beta 2.0"] and report["hosts"]["h1"]["remove"] == ["gamma 0.3"]
    assert {h.name: os.readlink(h.home / "mnft-env") for h in cluster.hosts} == links

    code, report = provision_json(tmp_path, inventory, None, "--rollback")
    assert code == 0, report
    assert set(statuses(report).values()) == {"rolled-back"}
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "beta") == ["1.0", "2.0"]
    assert provision_json(tmp_path, inventory, None, "--rollback")[0] == 0
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "gamma") == ["1.1", "0.3"]
        assert os.readlink(host.home / "mnft-env") == links[host.name]


def test_bad_input_is_one_line_exit_2_and_nothing_changes(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(2)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    unpinned = tmp_path / "unpinned.lock"
    unpinned.write_text("alpha==1.0\nbeta>=2.0\n")
    cases = {
        "missing": (tmp_path / "nope.lock", "lock file not found"),
        "unpinned": (unpinned, f"{unpinned}:2: beta is not pinned to one version"),
        "no python": (lock_of(tmp_path, wheels, "py.lock", {"alpha": "1.0"}, python="3.99"), "host h1 has no Python 3.99"),
        "no wheel": (lock_of(tmp_path, wheels, "w.lock", {"alpha": "9.9"}), f"no wheel of alpha==9.9 for platform cp{MINOR.replace('.', '')}, {os.uname().machine}, glibc"),
    }
    for name, (lock, message) in cases.items():
        done = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(lock))
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("mnft:")]  # (progress lines before it are dim)
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, (name, done.stderr)
    online_lock = tmp_path / "index.lock"
    online_lock.write_text(f"# python: {MINOR}\n--index-url https://pypi.org/simple\nalpha==1.0\n")
    done = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(online_lock), "--offline")
    assert done.returncode == 2 and "--offline forbids the index (https://pypi.org/simple)" in done.stderr
    for host in cluster.hosts:
        assert not (host.home / "mnft-env").exists() and not (host.home / "mnft-env.d").exists()


# ------------------------------------------------------------------------------------------------ torch + training


RECIPE_NEEDS = "torch==2.13.0\ntransformers\npeft\npyyaml\ntokenizers\nsafetensors\n"  # what the recipes import


def local_wheel_sources() -> list[str]:
    """The lock's wheel sources on this machine's disk: pip's configured file:// indexes and find-links (the CPU
    torch build lies there); never a network index."""
    done = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    lines = []
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        values = value.strip().strip("'\"").split()
        if key.endswith("index-url"):
            lines += [f"--extra-index-url {v}" for v in values if v.startswith("file://")]
        elif key.endswith("find-links"):
            lines += [f"--find-links {v}" for v in values if not v.startswith(("http://", "https://"))]
    if os.environ.get("PIP_FIND_LINKS"):
        lines += [f"--find-links {v}" for v in os.environ["PIP_FIND_LINKS"].split() if not v.startswith(("http://", "https://"))]
    return list(dict.fromkeys(lines))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_cpu_torch_build_is_provisioned_on_two_hosts_which_then_train_the_lora_recipe(fresh_cluster_factory, tmp_path):
    sources = local_wheel_sources()
    if not any("find-links" in s for s in sources):
        pytest.skip("no local wheel source for torch on this machine (pip's find-links)")
    extra = [s for s in sources if s.startswith("--extra-index-url")]
    # the first local index replaces PyPI: nothing is fetched from the network, neither here nor on the hosts
    index = [extra[0].replace("--extra-index-url", "--index-url"), *extra[1:]] if extra else ["--no-index"]
    sources = [*index, *(s for s in sources if "find-links" in s)]
    (tmp_path / "requirements.in").write_text(RECIPE_NEEDS)
    import uv

    compiled = subprocess.run([uv.find_uv_bin(), "pip", "compile", "requirements.in", "--offline", "--no-config", "--quiet",
                               *(w for s in sources for w in s.split()), "--index-strategy", "unsafe-best-match", "--python-version", MINOR,
                               "--python-platform", "x86_64-manylinux_2_28", "--generate-hashes", "-o", "compiled.lock"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 0, compiled.stderr
    lock = tmp_path / "requirements.lock"
    lock.write_text("\n".join(sources) + "\n" + (tmp_path / "compiled.lock").read_text())
    cluster = fresh_cluster_factory(2)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)  # no torch in the base Python
    env = {**controller_env(tmp_path), "MNFT_RUNS_DIR": str(tmp_path / "runs")}

    done = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "provision", "--hosts", str(inventory), "--lock", str(lock), "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert statuses(report) == {"h1": "changed", "h2": "changed"}
    for host in cluster.hosts:
        version = cluster.run(host, ["/root/mnft-env/bin/python", "-c", "import torch; print(torch.__version__)"], timeout=120)
        assert version.stdout.strip().startswith("2.13.0")

    trained = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "train", "--recipe", "lora", "--hosts", str(inventory),
                              "--src", str(REPO), "--set", "max_steps=4", "--set", "log_every=2"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    [run] = list((tmp_path / "runs").glob("[!.]*"))
    record = json.loads((run / "run.json").read_text())
    assert record["state"] == "succeeded", record
    # the run used the provisioned environment, without the inventory naming it (its python stays the base one)
    assert {h["python"] for h in record["inventory"]["hosts"]} == {"~/mnft-env/bin/python"}
    assert {h["base_python"] for h in record["inventory"]["hosts"]} == {BASE_PYTHON}


def test_online_hosts_install_straight_from_the_locks_index_still_exactly_pinned(fresh_cluster_factory, tmp_path, wheels):
    cluster = fresh_cluster_factory(2)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    # the "index": a directory every host can read (the hosts share this machine's /var/tmp, not its /tmp)
    index = Path(tempfile.mkdtemp(prefix="mnft-test-online-", dir="/var/tmp"))
    try:
        shutil.copytree(wheels, index, dirs_exist_ok=True)
        lock = write_lock(tmp_path / "requirements.lock", sorted(index.glob("*.whl")), {"alpha": "1.1", "beta": "2.0"}, find_links=index, python=MINOR)
        code, report = provision_json(tmp_path, inventory, lock, "--online")
        assert code == 0, report
        assert statuses(report) == {"h1": "changed", "h2": "changed"}
        for host in cluster.hosts:
            assert imported(cluster, host, "alpha", "beta") == ["1.1", "2.0"]
            assert os.listdir(host.home / "mnft-env.d" / "dist" / "wheels") == []  # no wheel went through the controller
    finally:
        shutil.rmtree(index, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ a shared home (issue 20)


def test_a_shared_home_gets_one_install_verified_from_every_host_and_one_rollback(fresh_cluster_factory, tmp_path, wheels):
    """Three hosts with one home (an NFS home in a lab): the environment there is built once, by one host, and every
    host of the group reads it back (it used to fail: three builds of one env id in one directory)."""
    cluster = fresh_cluster_factory(3, shared_home=("h1", "h2", "h3"))
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    v1 = lock_of(tmp_path, wheels, "v1.lock", {"alpha": "1.0", "beta": "2.0"})
    v2 = lock_of(tmp_path, wheels, "v2.lock", {"alpha": "1.1", "gamma": "0.3"})
    home = cluster.hosts[0].home

    code, report = provision_json(tmp_path, inventory, v1)
    assert code == 0, report
    assert statuses(report) == {"h1": "changed", "h2": "changed", "h3": "changed"}
    assert {n: h["action"] for n, h in report["hosts"].items()} == {"h1": "install", "h2": "verify", "h3": "verify"}
    [built] = os.listdir(home / "mnft-env.d" / "envs")  # one build, not three
    assert {h["env"] for h in report["hosts"].values()} == {str(Path("/root/mnft-env.d/envs") / built)}  # seen from every host
    assert len({h["fingerprint"] for h in report["hosts"].values()}) == 1
    assert report["controller_bytes"] <= 1.1 * report["wheelhouse_bytes"]  # the wheels went to the one installer
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "beta") == ["1.0", "2.0"]

    code, report = provision_json(tmp_path, inventory, v1)  # a second run: nothing to do
    assert code == 0 and set(statuses(report).values()) == {"ok"} and report["changed"] == 0, report
    assert os.listdir(home / "mnft-env.d" / "envs") == [built]

    code, report = provision_json(tmp_path, inventory, v2)
    assert code == 0 and [n for n, h in report["hosts"].items() if h["action"] == "install"] == ["h1"], report
    code, report = provision_json(tmp_path, inventory, None, "--rollback")  # once, for the group
    assert code == 0, report
    assert {n: h["action"] for n, h in report["hosts"].items()} == {"h1": "rollback", "h2": "verify", "h3": "verify"}
    assert set(statuses(report).values()) == {"rolled-back"}
    assert os.readlink(home / "mnft-env") == str(Path("/root/mnft-env.d/envs") / built)
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha", "beta") == ["1.0", "2.0"]


# ------------------------------------------------------------------------------------------------ interrupted (issue 19)

STAND_IN_UV = """#!/bin/sh
# a stand-in for uv that never finishes on its own: it makes the new environment's directory (uv venv's last
# argument), starts a child in its process group and waits
for a; do last=$a; done
mkdir -p "$last/bin"
sleep 300 &
echo "$$ $!" > "$HOME/stand-in-uv.pids"
wait
"""


def stand_in_uv(tmp_path: Path) -> dict[str, str]:
    """The controller's environment for a provision that ships a stand-in uv (it is found by `uv.find_uv_bin()`,
    hash-checked and run on the hosts like the real one)."""
    binary = tmp_path / "stand-in" / "uv-binary"
    (tmp_path / "stand-in" / "uv").mkdir(parents=True, exist_ok=True)
    binary.write_text(STAND_IN_UV)
    binary.chmod(0o755)
    (tmp_path / "stand-in" / "uv" / "__init__.py").write_text(f"def find_uv_bin():\n    return {str(binary)!r}\n")
    return {**controller_env(tmp_path), "PYTHONPATH": str(tmp_path / "stand-in")}


def alive(pid: int) -> bool:
    """The host's processes are this machine's (the test bed has no pid namespace): a zombie counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(predicate, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (waited {timeout:.0f} s)")
        time.sleep(0.1)


def test_a_controller_that_goes_mid_install_leaves_no_installer_and_the_previous_environment(fresh_cluster_factory, tmp_path, wheels):
    """The controller interrupted (SIGTERM), then killed outright (SIGKILL: its SSH connections drop), while the
    hosts build: each host's script sees its stdin end and ends the installer's whole process group (the stand-in
    uv and the child it started), removes the half-built environment and keeps the previous one (the installer
    used to run on to its end)."""
    import signal

    cluster = fresh_cluster_factory(2)
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    v1 = lock_of(tmp_path, wheels, "v1.lock", {"alpha": "1.0", "beta": "2.0"})
    v2 = lock_of(tmp_path, wheels, "v2.lock", {"alpha": "1.1", "beta": "2.0"})
    assert provision_json(tmp_path, inventory, v1)[0] == 0
    before = {h.name: os.readlink(h.home / "mnft-env") for h in cluster.hosts}
    pids_files = [h.home / "stand-in-uv.pids" for h in cluster.hosts]

    for how in (signal.SIGTERM, signal.SIGKILL):
        for f in pids_files:
            f.unlink(missing_ok=True)
        controller = subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(REPO), "provision", "--hosts", str(inventory), "--lock", str(v2)],
                                      cwd=REPO, env=stand_in_uv(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: all(f.exists() and len(f.read_text().split()) == 2 for f in pids_files), 60, "the stand-in uv started on every host")
            installers = [int(pid) for f in pids_files for pid in f.read_text().split()]
            assert all(alive(pid) for pid in installers)
            controller.send_signal(how)
            controller.wait(timeout=30)
        finally:
            if controller.poll() is None:
                controller.kill()
                controller.wait()
        wait_for(lambda: not any(alive(pid) for pid in installers), 8, f"the installers still run on the hosts after the controller's {how.name}")
        wait_for(lambda: all(os.listdir(h.home / "mnft-env.d" / "envs") == [os.path.basename(before[h.name])] for h in cluster.hosts), 8,
                 "the half-built environment is still there")  # (removed once its installer is gone)
        for host in cluster.hosts:
            assert os.readlink(host.home / "mnft-env") == before[host.name]
    for host in cluster.hosts:
        assert imported(cluster, host, "alpha") == ["1.0"]


SHORT_DEADMAN = """import sys
import mnft.env.provision as provision
provision.INSTALL_DEADMAN, provision.INSTALL_HEARTBEAT_EVERY = 2.0, 0.25  # seconds: a test's patience
from invoke.main import program
program.run(["invoke"] + sys.argv[1:])
"""


def test_a_network_gone_mid_install_ends_that_hosts_installer_after_the_deadman_and_keeps_its_environment(fresh_cluster_factory, tmp_path, wheels):
    """h2's cable pulled while the hosts build (no FIN: its SSH channel stays open on h2, silent): once the
    deadman passes without the controller's heartbeat, h2's script ends its installer's group, removes the
    half-built environment and keeps the previous one; the cable back, h2 is on its previous environment. (The
    deadman is 2 s here, 30 s in mnft.)"""
    import signal

    cluster = fresh_cluster_factory(2)
    h1, h2 = cluster.hosts
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON)
    v1 = lock_of(tmp_path, wheels, "v1.lock", {"alpha": "1.0", "beta": "2.0"})
    v2 = lock_of(tmp_path, wheels, "v2.lock", {"alpha": "1.1", "beta": "2.0"})
    assert provision_json(tmp_path, inventory, v1)[0] == 0
    before = {h.name: os.readlink(h.home / "mnft-env") for h in cluster.hosts}
    pids = {h.name: h.home / "stand-in-uv.pids" for h in cluster.hosts}
    controller = subprocess.Popen([sys.executable, "-c", SHORT_DEADMAN, "-r", str(REPO), "provision", "--hosts", str(inventory), "--lock", str(v2)],
                                  cwd=REPO, env=stand_in_uv(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    installers: dict[str, list[int]] = {}
    try:
        wait_for(lambda: all(f.exists() and len(f.read_text().split()) == 2 for f in pids.values()), 60, "the stand-in uv started on every host")
        installers = {name: [int(pid) for pid in f.read_text().split()] for name, f in pids.items()}
        cluster.link_down(h2)
        try:
            wait_for(lambda: not any(alive(pid) for pid in installers["h2"]), 15, "h2's installer still runs with its controller's network gone")
            wait_for(lambda: os.listdir(h2.home / "mnft-env.d" / "envs") == [os.path.basename(before["h2"])], 8, "h2's half-built environment is still there")
            assert all(alive(pid) for pid in installers["h1"])  # h1 still hears its controller: its build goes on
        finally:
            cluster.link_up(h2)
    finally:
        os.killpg(controller.pid, signal.SIGKILL)
        controller.communicate()
    wait_for(lambda: not any(alive(pid) for pids_ in installers.values() for pid in pids_), 10, "an installer still runs")
    for host in cluster.hosts:
        assert os.readlink(host.home / "mnft-env") == before[host.name]
    assert imported(cluster, h2, "alpha") == ["1.0"]


# ------------------------------------------------------------------------------------------------ secrets (issue 19)


class SlowIndex:
    """A PEP 503 simple index over http on the controller's side of the bridge (the hosts reach the controller
    there), behind HTTP basic auth, serving each wheel slowly (`rate` bytes/s) so an install lasts seconds."""

    def __init__(self, address: str, wheels: list[Path], user: str, token: str, rate: int) -> None:
        import base64
        import hashlib
        import http.server
        import threading
        import time

        files = {w.name: w for w in wheels}
        expected = "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
        self.requests: list[tuple[str, bool]] = []  # (path, with the right credentials)
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                authorized = self.headers.get("Authorization") == expected
                index.requests.append((self.path, authorized))
                if not authorized:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="lab"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                parts = [p for p in self.path.split("/") if p]
                if parts[:1] == ["simple"] and len(parts) == 2:
                    project = parts[1].replace("-", "_")
                    links = "".join(f'<a href="/files/{n}#sha256={hashlib.sha256(p.read_bytes()).hexdigest()}">{n}</a>\n'
                                    for n, p in sorted(files.items()) if n.startswith(project + "-"))
                    body = f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif parts[:1] == ["files"] and len(parts) == 2 and parts[1] in files:
                    data = files[parts[1]].read_bytes()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    step = max(1, rate // 10)
                    for start in range(0, len(data), step):  # rate bytes a second, in tenths
                        self.wfile.write(data[start:start + step])
                        self.wfile.flush()
                        time.sleep(0.1)
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{user}:{token}@{address}:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_index_token_never_reaches_a_hosts_command_lines_nor_mnfts_output_or_records(fresh_cluster_factory, tmp_path, wheels):
    """provision --online from an index whose URL holds a token (user:TOKEN@): while the hosts install from it, every
    command line on the hosts (`ps -eo args`, captured again and again) lacks the token, and so do mnft's output, its
    records on the controller and the files it leaves on the hosts. The index is slow so the captures see uv run."""
    import secrets
    import threading

    cluster = fresh_cluster_factory(2)
    venv = f"~/env-{secrets.token_hex(4)}"  # a path of this test's own: the uv processes it captures are this test's
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=BASE_PYTHON, venv=venv)
    token = "tok" + secrets.token_hex(12)
    chosen = [wheels / "alpha-1.1-py3-none-any.whl", wheels / "beta-2.0-py3-none-any.whl"]
    index = SlowIndex(cluster.bridge_address, chosen, "lab", token, rate=100_000)  # ~2 s a wheel
    try:
        lock = tmp_path / "requirements.lock"
        lock.write_text(f"# python: {MINOR}\n--index-url {index.url}\n"
                        f"alpha==1.1 --hash=sha256:{sha256(chosen[0])}\nbeta==2.0 --hash=sha256:{sha256(chosen[1])}\n")
        captures: list[str] = []
        done = threading.Event()

        def capture() -> None:
            while not done.is_set():
                for host in cluster.hosts:
                    captures.append(cluster.run(host, ["ps", "-eo", "args"]).stdout)

        watcher = threading.Thread(target=capture, daemon=True)
        watcher.start()
        try:
            provisioned = invoke(tmp_path, "provision", "--hosts", str(inventory), "--lock", str(lock), "--online", "--json")
        finally:
            done.set()
            watcher.join(timeout=30)
    finally:
        index.close()
    assert provisioned.returncode == 0, provisioned.stdout + provisioned.stderr
    assert statuses(json.loads(provisioned.stdout)) == {"h1": "changed", "h2": "changed"}
    assert any(path.startswith("/files/") and authorized for path, authorized in index.requests)  # uv used the token
    env_dir = venv.replace("~", "/root") + ".d"
    assert any(f"{env_dir}/dist/uv pip sync" in c for c in captures), f"no capture of {len(captures)} saw the installer run"
    assert not [c for c in captures if token in c]
    assert token not in provisioned.stdout + provisioned.stderr
    mnft_home = Path(controller_env(tmp_path)["MNFT_HOME"])
    assert [p for p in mnft_home.rglob("*") if p.is_file() and token.encode() in p.read_bytes()] == []
    for host in cluster.hosts:  # what mnft (and uv) leave on a host: environments, their records, uv's cache, leases
        left = [p for p in host.home.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
        assert left == [], left
