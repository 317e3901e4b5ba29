"""Resume says what works (issue 45): a hint after a stop, an idle stop or an interrupt is printed only as a command
that works; a script that resumes itself (`resume: {layout: none, args: []}`, docs/jobs.md) has a rule; a run started
without a rule is continued with `--resume-run ID --job FILE` (FILE's resume rule, the rest as recorded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnft.core import interrupts
from mnft.core.errors import InputError
from mnft.run import job as jobs
from mnft.run import records
from mnft.run.rerun import resume_hint, with_rule_of
from mnft.run.train import not_resumable

MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]
SELF = "script: train.py\nresume: {layout: none, args: []}\n"


def test_a_script_that_resumes_itself_has_a_resume_rule_and_keeps_it_in_its_record(tmp_path):
    (tmp_path / "self.yaml").write_text(SELF)
    (tmp_path / "none.yaml").write_text("script: train.py\n")
    itself, without = jobs.load_job_file(tmp_path / "self.yaml"), jobs.load_job_file(tmp_path / "none.yaml")
    assert jobs.resumable(itself) and not_resumable(itself) is None
    assert not jobs.resumable(without) and "no resume rule" in not_resumable(without)
    again = jobs.from_record(json.loads(json.dumps(itself.to_record())))  # a resume rebuilds it from run.json
    assert again.resume == itself.resume and jobs.resumable(again)
    assert jobs.resumable(jobs.recipe_job("lora")) and not jobs.resumable(jobs.cli_job(("train.py",)))


def test_the_hint_names_resume_run_only_for_a_job_that_can_be_resumed():
    assert resume_hint("R1", jobs.recipe_job("lora")).endswith("continue it with `mnft train --resume-run R1`")
    told = resume_hint("R1", jobs.cli_job(("train.py",)))
    assert "train.py has no resume rule" in told and "`mnft train --resume-run R1 --job FILE`" in told
    assert "--resume-run R1`" not in told  # never the command that exits 2


def test_a_job_files_rule_replaces_only_the_recorded_jobs_rule(tmp_path):
    (tmp_path / "self.yaml").write_text(SELF + "args: [--other]\nname: another\n")
    (tmp_path / "none.yaml").write_text("script: other.py\n")
    recorded = jobs.cli_job(("train.py", "--lr", "1e-4"))
    given = with_rule_of(recorded, jobs.load_job_file(tmp_path / "self.yaml"), "self.yaml")
    assert given.resume.declared and given.entry == recorded.entry and given.extra_args == recorded.extra_args and given.args == ()
    with pytest.raises(InputError, match="none.yaml: no resume rule"):
        with_rule_of(recorded, jobs.load_job_file(tmp_path / "none.yaml"), "none.yaml")


@pytest.mark.parametrize("job,hint", [({"entry": ["train.py"], "resume": {"layout": "hf"}}, "continue it with `mnft train --resume-run R-running`"),
                                      ({"entry": ["train.py"]}, "`mnft train --resume-run R-running --job FILE`")])
def test_an_interrupted_run_is_told_how_to_continue_as_a_stopped_one(tmp_path, monkeypatch, job, hint):
    from mnft.run.guard import Guard

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    said: list[str] = []
    for phase in ("checking", "running"):
        record = records.RunRecord.create(f"R-{phase}", state=phase, hosts={}, job=job)
        with pytest.raises(interrupts.Interrupted), interrupts.handling(), Guard(warn=said.append) as guard:
            guard.record = record
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert len(said) == 1 and said[0].startswith("run R-running interrupted; ") and said[0].endswith(hint)  # checking: never started


@pytest.fixture
def repo(tmp_path):
    project = tmp_path / "project"
    (project / "jobs").mkdir(parents=True)
    (project / "train.py").write_text("print('hello')\n")
    (project / "jobs" / "self.yaml").write_text(SELF)
    (project / "jobs" / "none.yaml").write_text("script: train.py\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    return project


def run(cwd: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("MNFT_RUNS_DIR", None)
    (tmp_path / "home").mkdir(exist_ok=True)
    return subprocess.run([*MNFT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_stopped_script_without_a_rule_is_continued_with_a_job_files_rule_from_any_directory(repo, tmp_path):
    """The recorded run (a plain `-- train.py`, stopped): `--resume-run ID` alone is refused (it would start at step
    1); `--resume-run ID --job F` takes F's rule and the rest from the record, also from another directory."""
    from mnft.hosts.inventory import load
    from mnft.cli.tasks import DEFAULT_INVENTORY
    from mnft.run.rerun import snapshot

    os.environ["MNFT_RUNS_DIR"] = str(repo / "runs")  # recorded as train records it, in the repository's runs/
    try:
        rec = records.RunRecord.create("20261201-090000-aaaa", state="stopped", launched=True, job=jobs.cli_job(("train.py",)).to_record(),
                                       inventory=snapshot(load(DEFAULT_INVENTORY)), code={"src": str(repo)}, hosts={})
    finally:
        del os.environ["MNFT_RUNS_DIR"]
    assert rec.path.is_dir()
    alone = run(repo, tmp_path, "train", "--resume-run", rec.run_id, "--dry-run")
    assert alone.returncode == 2 and "train.py has no resume rule" in alone.stderr, alone.stderr
    none = run(repo, tmp_path, "train", "--resume-run", rec.run_id, "--job", "jobs/none.yaml", "--dry-run")
    assert none.returncode == 2 and "jobs/none.yaml: no resume rule" in none.stderr, none.stderr
    ruled = run(repo, tmp_path, "train", "--resume-run", rec.run_id, "--job", "jobs/self.yaml", "--dry-run")
    assert ruled.returncode == 0, ruled.stdout[-2000:] + ruled.stderr[-2000:]
    assert f"resuming run {rec.run_id}" in ruled.stdout and "(the resume rule of jobs/self.yaml)" in ruled.stdout
    elsewhere = run(tmp_path / "home", tmp_path, "train", "--resume-run", rec.run_id, "--job", str(repo / "jobs" / "self.yaml"), "--dry-run")
    assert elsewhere.returncode == 0 and f"resuming run {rec.run_id}" in elsewhere.stdout, elsewhere.stderr[-2000:]
