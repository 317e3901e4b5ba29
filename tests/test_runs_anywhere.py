"""A user's runs are found from any directory (issue 45): each run recorded under runs/ of the directory train was
started in is linked, by its id, in the user's index ($MNFT_HOME/runs); `status ID`, `logs ID`, `wait ID`, `stop ID`
and the board find it from anywhere, and `mnft runs` lists them all. The current directory's runs come first; an
index entry whose record is gone is skipped; a record is never replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mnft.core.errors import InputError
from mnft.run import records

MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]
INVENTORY = {"path": None, "format": "mnft", "master": "h1", "known_hosts": None, "rendezvous_port": 29500,
             "hosts": [{"name": "h1", "slots": 1}, {"name": "h2", "slots": 1}]}


def start(directory, run_id, monkeypatch, **data):
    """A run recorded as train records it, from `directory` (runs/ there)."""
    directory.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(directory)
    record = records.RunRecord.create(run_id, state="running", launched=True, inventory=INVENTORY,
                                      hosts={"h1": {"node_rank": 0}, "h2": {"node_rank": 1}},
                                      job={"entry": ["train.py"], "name": "sft"}, **data)
    record.path = directory.resolve() / "runs" / run_id  # relative to where it was started: named whole here
    return record


@pytest.fixture
def two_repos(tmp_path, monkeypatch):
    monkeypatch.delenv("MNFT_RUNS_DIR", raising=False)
    a = start(tmp_path / "proj-a", "20261201-090000-aaaa", monkeypatch)
    b = start(tmp_path / "proj-b", "20261201-100000-bbbb", monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(home)
    return a, b, home


def test_a_run_is_found_by_its_id_from_a_directory_it_was_not_started_in(two_repos):
    a, b, _ = two_repos
    assert records.load(a.run_id).path == a.path and records.load(b.run_id).data["started_in"].endswith("proj-b")


def test_without_an_id_the_latest_here_comes_first_else_the_latest_of_the_users(two_repos, tmp_path, monkeypatch):
    a, b, _ = two_repos
    with pytest.raises(InputError, match=r"no runs recorded yet.*yours elsewhere: 2, the latest 20261201-100000-bbbb.*runs"):
        records.load(None)  # `stop` with no id: never another directory's run
    assert records.load(None, anywhere=True).run_id == b.run_id  # status, logs, wait: the user's latest
    monkeypatch.chdir(tmp_path / "proj-a")
    assert records.load(None, anywhere=True).run_id == a.run_id  # here has a run: it is the default, as before


def test_a_stale_index_entry_is_skipped_and_a_record_is_never_replaced(two_repos, tmp_path, monkeypatch):
    a, b, _ = two_repos
    for name in a.path.iterdir():
        name.unlink()
    a.path.rmdir()  # its record deleted
    assert list(records.every_run()) == [b.run_id]
    with pytest.raises(InputError, match="no such run"):
        records.load(a.run_id)
    again = start(tmp_path / "proj-c", a.run_id, monkeypatch)  # the id taken again elsewhere: the stale entry follows it
    assert records.indexed_path(a.run_id) == again.path
    start(tmp_path / "proj-d", a.run_id, monkeypatch)  # and again, while proj-c's record is there: proj-c's entry stays
    assert records.indexed_path(a.run_id) == again.path
    assert json.loads((again.path / "run.json").read_text())["started_in"].endswith("proj-c")


def test_mnft_runs_lists_every_run_of_the_user_from_anywhere(two_repos, tmp_path):
    a, b, home = two_repos
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(records.Path(records.__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    env.pop("MNFT_RUNS_DIR", None)
    listed = subprocess.run([*MNFT, "runs", "--json"], cwd=home, env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["runs"]
    assert [(r["id"], os.path.basename(r["repo"]), r["job"], r["state"], r["hosts"]) for r in rows] == [
        (b.run_id, "proj-b", "sft", "running", ["h1", "h2"]), (a.run_id, "proj-a", "sft", "running", ["h1", "h2"])]
    assert all(isinstance(r["since"], float) for r in rows)
    table = subprocess.run([*MNFT, "runs"], cwd=home, env=dict(env, COLUMNS="200"), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and a.run_id in table.stdout and "proj-b" in table.stdout, table.stdout + table.stderr


def test_status_of_a_run_by_id_from_elsewhere_reads_its_record_not_no_such_run(two_repos):
    """`mnft status ID` / `logs ID` / `wait ID` take the run from `_record_fleet` / records.load: from any directory."""
    from mnft.cli import tasks

    a, _, _ = two_repos
    record, fleet = tasks._record_fleet(a.run_id, None)
    assert record.path == a.path and [h.name for h in fleet.inventory.hosts] == ["h1", "h2"]
    assert not tasks._someone_elses(a.run_id)  # the user's own run, not another user's seen on the hosts


def test_the_board_shows_runs_started_in_other_directories(two_repos):
    from mnft.board import runs as runs_of

    a, b, _ = two_repos
    assert runs_of.run_dirs() == {a.run_id: a.path, b.run_id: b.path}
