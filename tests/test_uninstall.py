"""`mnft uninstall`: what mnft owns (the plan, with data), the host side on a home made here (what goes, what
stays: a run's outputs, a person's file, a file changed since sync placed it, a directory that is not mnft's), and
the host script agreeing with the modules whose files it removes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from mnft.onhost import checkout, sharemarks, treehash
from mnft.onhost import uninstallhost as host
from mnft.uninstall.plan import CONTROLLER, OUTPUTS_KEPT, OWNED, plan_items, settle, to_remove

SPEC = {"venv": "~/mnft-env", "workdir": "~/mnft", "data_dir": "~/mnft-data"}


def fact(**kw) -> dict:
    return {"path": "/p", "kind": "dir", "bytes": 10, "files": 1, "ours": True, "why": None, **kw}


# ------------------------------------------------------------------------------------------------ the plan


def test_what_runs_wrote_is_kept_unless_asked_and_what_is_not_mnfts_is_kept_with_why():
    found = {"env": fact(kind="link", bytes=0), "env_store": fact(bytes=1 << 30), "outputs": fact(bytes=500), "runs": fact(),
             "cache": fact(ours=False, why="a link, not the directory mnft makes: not followed"), "workdir": fact(bytes=0),
             "snapshots": fact(kind="missing")}
    items = {i.key: i for i in plan_items(found)}
    assert list(items) == ["env", "env_store", "outputs", "runs", "cache", "workdir"]  # OWNED's order; missing ones left out
    assert items["outputs"].action == items["runs"].action == "keep" and items["outputs"].why == OUTPUTS_KEPT
    assert items["cache"].action == "keep" and items["cache"].why == "not mnft's: a link, not the directory mnft makes: not followed"
    assert items["workdir"].action == "remove if empty"
    assert to_remove(list(items.values())) == ["env", "env_store", "workdir"]

    every = {i.key: i.action for i in plan_items(found, include_outputs=True)}
    assert every["outputs"] == every["runs"] == "remove" and every["cache"] == "keep"


def test_files_changed_since_sync_placed_them_are_named_as_kept():
    [item] = plan_items({"checkout": fact(kept_count=2, files=5)})
    assert item.action == "remove" and item.why == "2 file(s) changed since mnft placed them: kept"


def test_the_outcome_of_each_item_comes_from_the_hosts_answer():
    items = plan_items({"env": fact(), "snapshots": fact(), "outputs": fact(), "workdir": fact(), "cache": fact()})
    settle(items, {"removed": ["env"], "errors": {"snapshots": "x: Permission denied"}, "skipped": {"cache": "another user's (uid 7)"}})
    assert {i.key: (i.outcome, i.why) for i in items} == {
        "env": ("removed", ""), "snapshots": ("failed", "x: Permission denied"), "outputs": ("kept", OUTPUTS_KEPT),
        "workdir": ("left", "not empty: what is left there is not mnft's"), "cache": ("kept", "not mnft's now: another user's (uid 7)")}


def test_every_owned_place_is_found_by_the_host_script_by_its_key_in_the_same_order():
    keys = [key for key, _, _ in host.locations(SPEC)]
    assert keys == [o.key for o in OWNED]
    assert [key for key, _, _ in host.locations(dict(SPEC, venv=None))] == [o.key for o in OWNED if not o.key.startswith("env")]
    assert {o.key for o in CONTROLLER} == {"wheelhouse", "code_store", "hash_cache", "supervisor_bundles", "provision_record"}


# ------------------------------------------------------------------------------------------------ the host script agrees


def test_the_host_script_uses_the_names_and_mark_places_of_sync_and_provision(tmp_path):
    from mnft.onhost import envhost  # noqa: F401 - the environment's store is envhost's root_of
    assert host.PLACED == treehash.PLACED and host.SHARE_DIR == sharemarks.SHARE_DIR
    (tmp_path / "a" / "b").mkdir(parents=True)
    for path in (tmp_path / "a" / "b", tmp_path / "a" / "missing" / "deeper", tmp_path / "a", Path("/usr/share/x"), Path("/")):
        assert host.anchor(str(path)) == sharemarks._anchor(str(path))[0], path
    assert all(host.MARK.match(n) for n in ("0123abcd.h1", ".0123abcd.h-2.part"))
    assert host.cache_dir() == os.path.dirname(treehash.default_cache("/x"))
    assert host.look_tree(str(tmp_path), None)["ours"] and host.unsafe(os.path.expanduser("~"))
    assert host.unsafe("/usr/lib") and host.unsafe("/") and host.unsafe("/etc")


# ------------------------------------------------------------------------------------------------ on a home made here


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    # provision's environment: the link and its store
    env = h / "mnft-env.d" / "envs" / "e1"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_bytes(b"p" * 1000)
    (h / "mnft-env.d" / "dist").mkdir()
    (h / "mnft-env").symlink_to(env)
    # a code snapshot (read-only files; one read-only directory too) and a job's directory linked from it
    snap = h / "mnft" / ".mnft" / "code" / "0123456789abcdef"
    (snap / "pkg").mkdir(parents=True)
    (snap / "pkg" / "a.py").write_bytes(b"print(1)\n")
    (snap / "pkg" / "a.py").chmod(0o444)
    (snap / "pkg").chmod(0o555)
    job = h / "mnft" / "outputs" / "job1"
    job.mkdir(parents=True)
    os.link(snap / "pkg" / "a.py", job / "a.py")
    (job / "checkpoint.pt").write_bytes(b"weights")
    (h / "mnft" / "runs" / "r1" / "h1").mkdir(parents=True)
    (h / "mnft" / "runs" / "r1" / "h1" / "agent.log").write_text("log")
    # sync's checkout: two files as placed, one changed since, a person's file it never placed
    work = h / "mnft"
    (work / "pkg").mkdir()
    (work / "pkg" / "m.py").write_bytes(b"m")
    (work / "train.py").write_bytes(b"edited by a person")
    (work / "notes.txt").write_text("mine")
    (work / "setup.cfg").write_bytes(b"cfg")
    checkout.write_placed(str(work), {"digest": "d", "files": {"pkg/m.py": [1, _sha(b"m")], "train.py": [5, _sha(b"train")],
                                                               "setup.cfg": [3, _sha(b"cfg")], "../escape": [1, _sha(b"x")]}})
    data = h / "mnft-data"
    data.mkdir()
    (data / "train.jsonl").write_bytes(b"{}\n")
    checkout.write_placed(str(data), {"digest": "d", "files": {"train.jsonl": [3, _sha(b"{}\n")]}})
    assert sharemarks._mark(str(work), "0123abcd.h1") is None
    (h / ".cache" / "mnft").mkdir(parents=True)
    (h / ".cache" / "mnft" / "treehash-x.json").write_text("{}")
    return h


def test_uninstall_removes_mnfts_and_keeps_outputs_a_persons_file_and_a_changed_one(home):
    found = host.look(SPEC)["found"]
    assert found["checkout"]["kept"] == ["../escape", "train.py"] and found["env_store"]["bytes"] == 1000
    items = plan_items(found)
    reply = host.remove(dict(SPEC, remove=to_remove(items)))
    assert reply["errors"] == {} and reply["skipped"] == {}
    assert set(reply["removed"]) == {"env", "env_store", "snapshots", "checkout", "data", "cache", "marks", "mnft_dir", "data_dir"}
    left = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert left == [".cache", "mnft", "mnft/notes.txt", "mnft/outputs", "mnft/outputs/job1", "mnft/outputs/job1/a.py",
                    "mnft/outputs/job1/checkpoint.pt", "mnft/runs", "mnft/runs/r1", "mnft/runs/r1/h1", "mnft/runs/r1/h1/agent.log",
                    "mnft/train.py"]
    assert (home / "mnft" / "outputs" / "job1" / "a.py").read_bytes() == b"print(1)\n"  # a job's code outlives its snapshot

    again = plan_items(host.look(SPEC)["found"])
    assert to_remove(again) == ["workdir"] and {i.key: i.action for i in again}["outputs"] == "keep"  # nothing else of mnft's


def test_include_outputs_removes_what_runs_wrote_too_but_never_a_persons_file(home):
    items = plan_items(host.look(SPEC)["found"], include_outputs=True)
    host.remove(dict(SPEC, remove=to_remove(items)))
    assert sorted(p.name for p in (home / "mnft").iterdir()) == ["notes.txt", "train.py"]


def test_what_only_looks_like_mnfts_is_not_removed(home, tmp_path):
    (home / "mnft-env").unlink()
    (home / "mnft-env").symlink_to(tmp_path)  # a link of the person's own
    other = tmp_path / "elsewhere"
    other.mkdir()
    (home / ".cache" / "mnft" / "treehash-x.json").unlink()
    (home / ".cache" / "mnft").rmdir()
    (home / ".cache" / "mnft").symlink_to(other)  # never followed
    found = host.look(SPEC)["found"]
    items = {i.key: i for i in plan_items(found)}
    assert items["env"].action == "keep" and "outside" in items["env"].why
    assert items["cache"].action == "keep" and "a link" in items["cache"].why
    # the plan was made before the change: the host judges again and keeps what is not mnft's now
    (home / "mnft" / "setup.cfg").write_bytes(b"CFG")
    reply = host.remove(dict(SPEC, remove=["env", "cache", "checkout"]))
    assert set(reply["skipped"]) == {"env", "cache"} and reply["removed"] == ["checkout"]
    assert (home / "mnft" / "setup.cfg").read_bytes() == b"CFG" and other.is_dir() and (home / "mnft-env").is_symlink()


def test_a_directory_at_the_environments_place_that_provision_did_not_make_stays(home):
    import shutil

    (home / "mnft-env").unlink()
    (home / "mnft-env").mkdir()
    shutil.rmtree(home / "mnft-env.d")
    (home / "mnft-env.d").mkdir()
    (home / "mnft-env.d" / "mine").write_text("x")
    items = {i.key: i for i in plan_items(host.look(SPEC)["found"])}
    assert items["env"].action == "keep" and "not the link provision makes" in items["env"].why
    assert items["env_store"].action == "keep" and "not a directory mnft made" in items["env_store"].why


def test_the_host_script_runs_as_shipped(home, tmp_path):
    import subprocess
    import sys

    from mnft.hosts import pyrun

    done = subprocess.run([sys.executable, "-S", "-c", pyrun.BOOTSTRAP, "look", json.dumps(SPEC)], input=pyrun.payload("uninstallhost"),
                          capture_output=True, env=dict(os.environ, HOME=str(home)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["found"]["env"]["ours"] is True
    bad = subprocess.run([sys.executable, "-S", "-c", pyrun.BOOTSTRAP, "look", "{}"], input=pyrun.payload("uninstallhost"), capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"workdir and data_dir" in bad.stderr
