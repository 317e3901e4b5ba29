"""invoke sync on the simulated cluster: identical trees proven by hash, drift found and repaired, ignored files
kept home, hostile file names copied verbatim and never run, dangerous targets refused, a dead host isolated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mnft.core.errors import ExitCode, InputError
from mnft.hosts import inventory as inventory_mod
from mnft.hosts.fleet import Fleet
from mnft.sync import mirror, source

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ["with space.py", "$(touch PWNED).py", "`touch PWNED2`.txt", "semi;colon&amp|pipe.txt", "quote'd \"x\".txt", "-rf.txt", "star*?[x].txt"]


@pytest.fixture(autouse=True)
def private_mnft_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))


def make_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    files = {
        ".gitignore": "*.log\nbuild/\n",
        "pkg/__init__.py": "",
        "pkg/hello.py": "print('hello from', __spec__.name)\n",
        "pkg/sub/.gitignore": "local.cfg\n",
        "pkg/sub/local.cfg": "secret-ish",
        "pkg/sub/shipped.cfg": "lr: 1e-4\n",
        "train.log": "noise",
        "build/artifact.bin": "b" * 100,
        "runs/old/metrics.jsonl": "{}",
        "pkg/__pycache__/hello.cpython-311.pyc": "c",
        **{f"odd/{name}": name for name in HOSTILE},
    }
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    return src


def inv_for(cluster, tmp_path: Path, workdir: str, hosts=None, **overrides):
    path = cluster.write_inventory(tmp_path / "inventory.yaml", hosts, workdir=workdir, data_dir=workdir + "-data", **overrides)
    return inventory_mod.load(path), path


def host_tree(sim_host, workdir: str) -> Path:
    return sim_host.home / workdir.removeprefix("/root/")


def test_every_host_holds_the_identical_tree(cluster, tmp_path):
    src = make_src(tmp_path)
    workdir = "/root/sync-identical"
    inv, _ = inv_for(cluster, tmp_path, workdir)
    report = mirror.sync_code(inv, src, progress=False)
    assert report.ok, report.summary()
    assert report.exit_code() == ExitCode.OK
    local_digest, local_files = source.tree_hash(src)
    assert report.local_hash == local_digest
    for sim in cluster.hosts:
        assert report.hosts[sim.name].status == "changed"
        assert report.hosts[sim.name].remote_hash == local_digest
        copy = host_tree(sim, workdir)
        assert source.tree_hash(copy, source.ALWAYS_EXCLUDES)[1] == local_files  # read from outside, independently
        # ignored files stayed home
        for rel in ("train.log", "build", "runs", "pkg/sub/local.cfg", "pkg/__pycache__"):
            assert not (copy / rel).exists(), rel
        # hostile names arrived verbatim and nothing ran
        for name in HOSTILE:
            assert (copy / "odd" / name).read_text() == name
        assert not list(sim.home.rglob("PWNED*")) and not list((sim.root / "tmp").rglob("PWNED*"))
    # the layout lets `cd workdir && python -m pkg.hello` work
    done = cluster.run(cluster.hosts[0], ["sh", "-c", f"cd {workdir} && {cluster.python} -m pkg.hello"])
    assert "hello from pkg.hello" in done.stdout
    again = mirror.sync_code(inv, src, progress=False)
    assert {h.status for h in again.hosts.values()} == {"ok"} and all(h.bytes_sent == 0 for h in again.hosts.values())


def test_drift_on_one_host_is_detected_by_check_and_sync_then_repaired(cluster, tmp_path):
    src = make_src(tmp_path)
    workdir = "/root/sync-drift"
    inv, _ = inv_for(cluster, tmp_path, workdir)
    assert mirror.sync_code(inv, src, progress=False).ok
    drifted = cluster.hosts[1]
    cluster.run(drifted, ["sh", "-c", f"echo 'lr: 1' > {workdir}/pkg/sub/shipped.cfg && touch {workdir}/pkg/stray.py"])
    with Fleet(inv) as fleet:
        hashes, _ = mirror.code_hashes(fleet, inv.hosts, src)
    assert hashes[drifted.name]["matches"] is False
    assert hashes[drifted.name]["differing"] == ["differs: pkg/sub/shipped.cfg", "extra: pkg/stray.py"]
    assert all(hashes[s.name]["matches"] for s in cluster.hosts if s is not drifted)
    from mnft.check.findings import CheckOptions
    from mnft.check.gather import gather

    with Fleet(inv) as fleet:
        checked = gather(fleet, CheckOptions(network=False, code_src=str(src)))
    assert checked.to_json()["hosts"][drifted.name]["code_hash"]["matches"] is False
    assert [p.field for p in checked.problems if p.host == drifted.name and p.field == "code"] == ["code"]
    # an edit on the host of a file mnft placed, and a file a person left: neither is mnft's to overwrite or remove
    dry = mirror.sync_code(inv, src, progress=False, dry_run=True)
    assert dry.hosts[drifted.name].status == "conflict" and dry.hosts[drifted.name].conflicts == ["pkg/sub/shipped.cfg"]
    assert dry.hosts[drifted.name].would_delete == []
    refused = mirror.sync_code(inv, src, progress=False)
    assert refused.exit_code() == ExitCode.FAILED and "pkg/sub/shipped.cfg" in refused.hosts[drifted.name].error
    assert (host_tree(drifted, workdir) / "pkg/sub/shipped.cfg").read_text() == "lr: 1\n"
    assert {refused.hosts[s.name].status for s in cluster.hosts if s is not drifted} == {"ok"}  # one host's conflict hides no other
    fixed = mirror.sync_code(inv, src, progress=False, force=True)
    assert fixed.ok
    assert fixed.hosts[drifted.name].status == "changed" and fixed.hosts[drifted.name].files_deleted == 0
    assert (host_tree(drifted, workdir) / "pkg/sub/shipped.cfg").read_text() == "lr: 1e-4\n"
    assert (host_tree(drifted, workdir) / "pkg/stray.py").exists()


def test_outputs_and_logs_a_host_wrote_that_match_gitignore_survive_and_are_no_drift(cluster, tmp_path):
    src = make_src(tmp_path)
    (src / ".gitignore").write_text("*.log\nbuild/\ncheckpoints/\n")
    workdir = "/root/sync-outputs"
    inv, _ = inv_for(cluster, tmp_path, workdir, hosts=cluster.hosts[:2])
    assert mirror.sync_code(inv, src, progress=False).ok
    sim = cluster.hosts[0]
    own = ["checkpoints/step100.pt", "train.log", "pkg/eval/loss.log", "build/cache.bin", "pkg/sub/local.cfg"]
    cluster.run(sim, ["sh", "-c", "cd \"$1\" && for f in \"$@\"; do mkdir -p \"$(dirname \"$f\")\" && echo host-made > \"$f\"; done", "sh", workdir, *own])
    dry = mirror.sync_code(inv, src, progress=False, dry_run=True)
    assert dry.hosts[sim.name].would_delete == [] and dry.hosts[sim.name].status == "ok"
    with Fleet(inv) as fleet:
        assert mirror.code_hashes(fleet, inv.hosts, src)[0][sim.name]["matches"] is True
    from mnft.check.findings import CheckOptions
    from mnft.check.gather import gather

    with Fleet(inv) as fleet:
        checked = gather(fleet, CheckOptions(network=False, code_src=str(src)))
    assert not [p for p in checked.problems if p.field == "code"]
    again = mirror.sync_code(inv, src, progress=False)
    assert again.ok and {h.status for h in again.hosts.values()} == {"ok"}
    for rel in own:
        assert (host_tree(sim, workdir) / rel).read_text() == "host-made\n", rel


def test_a_workdir_and_source_with_spaces_and_shell_metacharacters_copy_verbatim_and_run_nothing(cluster, tmp_path):
    src = make_src(tmp_path / "sync dir" / "$(touch PWNED); `touch PWNED2` & 'q'")
    workdir = "/root/sync w $(touch PWNED); `touch PWNED2` | 'q' \"dq\""
    inv, _ = inv_for(cluster, tmp_path, workdir, hosts=cluster.hosts[:2])
    report = mirror.sync_code(inv, src, progress=False)
    assert report.ok, report.summary()
    local = source.tree_hash(src)
    for sim in cluster.hosts[:2]:
        copy = host_tree(sim, workdir)
        assert copy.is_dir() and source.tree_hash(copy, source.exclude_rules(src)[0]) == local
        assert report.hosts[sim.name].remote_hash == local[0]
    again = mirror.sync_code(inv, src, progress=False, dry_run=True)
    assert {h.status for h in again.hosts.values()} == {"ok"}
    marked = [p for base in (tmp_path, *[s.root for s in cluster.hosts]) for p in base.rglob("PWNED*")]
    marked += [p for base in (ROOT, Path.cwd()) for p in base.glob("PWNED*")]  # a controller-side shell's cwd
    assert marked == []


def test_a_modification_rsync_cannot_see_is_still_caught_by_the_hash(cluster, tmp_path):
    """Same size and mtime on the host: rsync's quick check would skip it; the hash names it (a change on the host of a
    file mnft placed: a conflict), and the forced sync repairs it, comparing contents."""
    src = make_src(tmp_path)
    workdir = "/root/sync-sneaky"
    inv, _ = inv_for(cluster, tmp_path, workdir, hosts=cluster.hosts[:1])
    assert mirror.sync_code(inv, src, progress=False).ok
    sim = cluster.hosts[0]
    path = f"{workdir}/pkg/sub/shipped.cfg"
    cluster.run(sim, ["sh", "-c", f"t=$(stat -c %Y {path}); echo 'lr: 9e-4' > {path}; touch -d @$t {path}"])
    report = mirror.sync_code(inv, src, progress=False)
    assert report.hosts[sim.name].conflicts == ["pkg/sub/shipped.cfg"], report.summary()
    assert (host_tree(sim, workdir) / "pkg/sub/shipped.cfg").read_text() == "lr: 9e-4\n"
    report = mirror.sync_code(inv, src, progress=False, force=True)
    assert report.ok, report.summary()
    assert (host_tree(sim, workdir) / "pkg/sub/shipped.cfg").read_text() == "lr: 1e-4\n"


def test_dangerous_targets_are_refused_before_any_host_is_touched(cluster, tmp_path):
    src = make_src(tmp_path)
    for target in ("/root", "~", "/", "~/.", "/root/x/.."):
        path = cluster.write_inventory(tmp_path / "bad.yaml", workdir={"h2": target})
        with pytest.raises(InputError) as exc:
            mirror.sync_code(inventory_mod.load(path), src, progress=False)
        assert exc.value.exit_code == ExitCode.BAD_INPUT
        assert not (cluster.hosts[0].home / "mnft" / "odd").exists()  # h1 (a fine target) was not touched either
    done = subprocess.run([sys.executable, "-m", "invoke", "sync", "--hosts", str(path), "--src", str(src)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "refused" in done.stderr


def test_a_target_that_resolves_to_home_is_refused_on_that_host_only(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    src = make_src(tmp_path)
    sim = cluster.hosts[0]
    cluster.run(sim, ["ln", "-sfn", "/root", "/root/home-link"])
    try:
        path = cluster.write_inventory(tmp_path / "inv.yaml", cluster.hosts[:2], workdir={"h1": "/root/home-link", "h2": "/root/sync-link-ok"})
        report = mirror.sync_code(inventory_mod.load(path), src, progress=False)
        assert report.hosts["h1"].status == "refused" and "home directory" in report.hosts["h1"].error
        assert report.exit_code() == ExitCode.BAD_INPUT
        assert report.hosts["h2"].status == "changed"
        assert not (sim.home / "pkg").exists()  # nothing landed in (or was deleted from) the home
    finally:
        cluster.run(sim, ["rm", "-f", "/root/home-link"])


def test_one_unreachable_and_one_failing_host_do_not_stop_the_others(healthy_cluster, tmp_path):
    cluster = healthy_cluster
    src = make_src(tmp_path)
    workdir = "/root/sync-partial"
    inv, path = inv_for(cluster, tmp_path, workdir)
    dead, broken = cluster.hosts[2], cluster.hosts[3]
    cluster.stop_sshd(dead)
    cluster.run(broken, ["sh", "-c", f"rm -rf {workdir} && echo not-a-dir > {workdir}"])  # the target is a file
    try:
        report = mirror.sync_code(inv, src, progress=False)
        assert report.hosts[dead.name].status == "unreachable" and report.hosts[dead.name].error
        assert report.hosts[broken.name].status == "failed" and report.hosts[broken.name].error
        for sim in cluster.hosts[:2]:
            assert report.hosts[sim.name].status == "changed"
            assert report.hosts[sim.name].remote_hash == report.local_hash
        assert report.exit_code() == ExitCode.UNREACHABLE
        done = subprocess.run([sys.executable, "-m", "invoke", "sync", "--hosts", str(path), "--src", str(src), "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 4, done.stderr
        data = json.loads(done.stdout)
        assert data["hosts"]["h1"]["status"] == "ok" and data["hosts"]["h1"]["hash_match"] is True
        assert data["hosts"][dead.name]["status"] == "unreachable"
    finally:
        cluster.run(broken, ["rm", "-f", workdir])


def test_data_goes_to_data_dir_once_on_a_shared_filesystem(cluster, tmp_path):
    data = tmp_path / "dataset"
    (data / "shards").mkdir(parents=True)
    for i in range(3):
        (data / "shards" / f"{i}.jsonl").write_text(json.dumps({"i": i}) + "\n")
    h1, h2, h3 = cluster.hosts[:3]
    # h1 and h2 "share" a filesystem: both point at h1's data dir through the path h1 writes (simulated by
    # giving h2 a data_dir that already holds the same copy after h1's sync: a bind would need root in-host).
    path = cluster.write_inventory(tmp_path / "inv.yaml", [h1, h3], workdir="/root/sync-data-code", data_dir="/root/sync-data")
    report = mirror.sync_data(inventory_mod.load(path), data, progress=False)
    assert report.ok, report.summary()
    for sim in (h1, h3):
        assert report.hosts[sim.name].status == "changed"
        assert (sim.home / "sync-data" / "shards" / "2.jsonl").read_text() == '{"i": 2}\n'
    shared = cluster.write_inventory(tmp_path / "shared.yaml", [h1, h2], workdir="/root/sync-data-code", data_dir="/root/sync-data-shared",
                                     shared_fs=True)
    report = mirror.sync_data(inventory_mod.load(shared), data, progress=False)
    # h2 does not really share h1's disk here: the writer is h1, and h2 must say it cannot see the data
    assert report.hosts["h1"].status == "changed"
    assert report.hosts["h2"].status == "failed" and "host h2 does not see the shared data at /root/sync-data-shared" in report.hosts["h2"].error
    assert not (h2.home / "sync-data-shared").exists()
    # the next run: h1 already holds the data, so h2 (still without the mount) verifies and fails again, uncopied
    again = mirror.sync_data(inventory_mod.load(shared), data, progress=False)
    assert again.hosts["h1"].status == "ok"
    assert again.hosts["h2"].status == "failed" and "host h2 does not see the shared data" in again.hosts["h2"].error
    assert not (h2.home / "sync-data-shared").exists()


def test_an_inventory_without_a_user_syncs_as_the_controllers_login_into_that_users_home(cluster, tmp_path, monkeypatch):
    """The lab's shared inventory names no user: each member logs in as their own login ($LOGNAME, as getpass reads
    it; ~/.ssh/config's User where it has one). rsync must log in as the same user as the SSH that checks the copy: it
    used OpenSSH's own default, the local uid's name, wrote into another user's home, and the sync "differed after
    the sync"."""
    cluster.add_user("dora")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LOGNAME", "dora")
    monkeypatch.setenv("USER", "dora")
    src = make_src(tmp_path)
    inv, _ = inv_for(cluster, tmp_path, "~/sync-login", user=None, python="/usr/bin/python3")  # (the system Python: dora may run it)
    assert {h.user for h in inv.hosts} == {None}
    report = mirror.sync_code(inv, src, progress=False)
    assert report.ok, report.summary()
    for sim in cluster.hosts:
        copy = sim.root / "tmp" / "home-dora" / "sync-login"
        assert (copy / "pkg" / "hello.py").is_file() and copy.stat().st_uid != 0
        assert not (host_tree(sim, "/root/sync-login")).exists()
