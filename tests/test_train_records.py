"""train's pieces that need no host: secrets on the command line refused, env files, the agent never leaving a
secret behind, resume defaults, the run record written back, rank labels, the progress line without a terminal,
logs -f ending when the run's processes are gone, GPUs still held after stop."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from mnft.core.errors import ExitCode, InputError
from mnft.hosts import inventory, pyrun
from mnft.run import control, launch, logs, progress, records, rerun
from mnft.onhost import follow, queries, rungpus, runprocs
from mnft.run.gang import split_rank
from mnft.run.launch import LaunchOptions

# ------------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("spec", ["HF_TOKEN=hf-abc", "WANDB_API_KEY=k", "DB_PASSWORD=p", "my_secret=x"])
def test_a_secret_given_as_name_equals_value_is_refused_without_echoing_the_value(spec):
    name, _, value = spec.partition("=")
    with pytest.raises(InputError) as err:
        launch.split_env((spec,), {})
    message = str(err.value)
    assert f"use --env {name} (value from this environment) or --env-file FILE (mode 0600)" in message
    assert value not in message and "\n" not in message


def test_a_secret_by_name_comes_from_the_environment_and_plain_values_pass():
    plain, secret = launch.split_env(("HF_TOKEN", "MODE=fast"), {"HF_TOKEN": "hf-1"})
    assert plain == {"MODE": "fast"} and secret == {"HF_TOKEN": "hf-1"}


def test_an_env_file_must_be_0600_and_its_secrets_stay_secret(tmp_path):
    f = tmp_path / "run.env"
    f.write_text("# comment\n\nexport DB_PASSWORD='p@ss word'\nMODE=fast\nAPI_KEY=\"k-1\"\n")
    f.chmod(0o644)
    with pytest.raises(InputError, match=f"--env-file {f}: mode 0644 lets others read it: chmod 600"):
        launch.split_env((), {}, (str(f),))
    f.chmod(0o600)
    plain, secret = launch.split_env((), {}, (str(f),))
    # a file's values are secrets whatever their names (never printed by --dry-run, never written in clear)
    assert plain == {} and secret == {"DB_PASSWORD": "p@ss word", "API_KEY": "k-1", "MODE": "fast"}
    assert launch.split_env(("MODE=slow",), {}, (str(f),))[0] == {"MODE": "slow"}  # given on the command line: plain
    bad = tmp_path / "bad.env"
    bad.write_text("OK=1\nnot a line\n")
    bad.chmod(0o600)
    with pytest.raises(InputError, match=f"--env-file {bad}:2: expected NAME=VALUE"):
        launch.split_env((), {}, (str(bad),))
    with pytest.raises(InputError, match="--env-file .*missing.env"):
        launch.split_env((), {}, (str(tmp_path / "missing.env"),))


def test_the_agent_never_leaves_the_secrets_file_when_the_workdir_is_missing(tmp_path):
    spec = {"run_id": "R", "tag": "R@local", "run_dir": str(tmp_path / "run"), "argv": ["true"], "cwd": str(tmp_path / "nowhere"),
            "env": {}, "secrets": {"API_TOKEN": "hush"}, "metrics": None, "detach": True, "deadman": 5, "grace": 1}
    done = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, "launch"], input=pyrun.payload("agent") + json.dumps(spec).encode() + b"\n",
                          capture_output=True, timeout=60)
    assert done.returncode == 2
    assert json.loads(done.stdout.decode().splitlines()[-1])["message"].startswith(f"working directory {tmp_path / 'nowhere'} does not exist")
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and b"hush" in p.read_bytes()]
    assert leftovers == [] and not (tmp_path / "run" / "secrets.json").exists()


# ------------------------------------------------------------------------------------------- resume


PREVIOUS = {
    "run_id": "20260101-000000-aaaa",
    "inventory": {"path": "/lab/inv.yaml"},
    "overrides": ["max_steps=400", "save_every=4"],
    "env_specs": ["WANDB_API_KEY", "MODE=fast"],
    "env_files": ["/lab/secrets.env"],
}


def test_resume_reuses_the_previous_hosts_overrides_and_env_names():
    reused = rerun.reuse_previous(PREVIOUS, hosts=None, overrides=(), env=(), env_files=())
    assert reused.hosts == "/lab/inv.yaml" and reused.run_id == PREVIOUS["run_id"]
    assert reused.job.extra_args == ("max_steps=400", "save_every=4")
    assert reused.env == ("WANDB_API_KEY", "MODE=fast") and reused.env_files == ("/lab/secrets.env",)
    assert reused.notes == ("--hosts /lab/inv.yaml", "--set max_steps=400 --set save_every=4",
                            "--env WANDB_API_KEY --env MODE=fast", "--env-file /lab/secrets.env")


def test_resume_does_not_reuse_overwrite_or_resume_which_would_refuse_or_restart_the_run():
    previous = {**PREVIOUS, "overrides": ["max_steps=400", "overwrite=true", "resume=none"]}
    reused = rerun.reuse_previous(previous, hosts=None, overrides=(), env=(), env_files=())
    assert reused.job.extra_args == ("max_steps=400",)
    assert reused.notes[-1] == "(not overwrite=true resume=none: a resume continues from the latest checkpoint)"


def test_resume_explicit_flags_win_and_overrides_merge_by_key():
    reused = rerun.reuse_previous(PREVIOUS, hosts="/lab/other.yaml", overrides=("max_steps=12",), env=("MODE=slow",), env_files=())
    assert reused.hosts == "/lab/other.yaml"
    assert reused.job.extra_args == ("save_every=4", "max_steps=12")
    assert reused.env == ("WANDB_API_KEY", "MODE=slow")
    assert not any(n.startswith("--hosts") for n in reused.notes)


def test_resume_takes_its_code_from_the_same_tree_as_it_is_now_unless_src_is_given_again():
    previous = {**PREVIOUS, "code": {"src": "/home/alice/proj", "hash": "ab" * 32}}
    reused = rerun.reuse_previous(previous, hosts=None, overrides=(), env=(), env_files=())
    assert reused.src == "/home/alice/proj" and reused.notes[-1] == "--src /home/alice/proj (as it is now)"
    given = rerun.reuse_previous(previous, hosts=None, overrides=(), env=(), env_files=(), src="/home/alice/fork")
    assert given.src == "/home/alice/fork" and not any(n.startswith("--src") for n in given.notes)
    assert rerun.reuse_previous(PREVIOUS, hosts=None, overrides=(), env=(), env_files=()).src is None  # an older record: the default


def test_resume_and_default_run_skip_runs_that_never_started(tmp_path, monkeypatch):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    records.RunRecord.create("20260101-000000-aaaa", state="failed", launched=True)
    records.RunRecord.create("20260101-000001-bbbb", state="refused", launched=False)
    assert rerun.previous_run(None).run_id == "20260101-000000-aaaa"
    assert records.load(None).run_id == "20260101-000001-bbbb"  # without a preference: simply the latest
    assert rerun.previous_run("20260101-000001-bbbb").run_id == "20260101-000001-bbbb"  # named: that one


def test_the_agent_does_not_replay_a_resumed_jobs_old_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    tail = follow._Tail(str(metrics), from_end=True)
    assert tail.lines() == []
    with open(metrics, "a") as fh:
        fh.write('{"step": 3}\n{"step": 4')
    assert tail.lines() == ['{"step": 3}']
    metrics.write_text('{"step": 1}\n')  # rewritten from scratch: read again from the start
    assert tail.lines() == ['{"step": 1}']
    assert follow._Tail(str(tmp_path / "not-yet.jsonl"), from_end=True).pos == 0


# ------------------------------------------------------------------------------------------- the run record


def record_with(tmp_path, monkeypatch, state="running"):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    return records.RunRecord.create("R1", state=state, launched=True, hosts={"a": {"node_rank": 0, "state": "running"}, "b": {"node_rank": 1, "state": "running"}})


def test_status_writes_a_detached_runs_end_into_its_record(tmp_path, monkeypatch):
    record = record_with(tmp_path, monkeypatch)
    control.write_back(record, {"a": {"state": "exited", "exit_code": 0}, "b": {"state": "running"}})
    saved = json.loads((record.path / "run.json").read_text())
    assert saved["state"] == "running" and saved["hosts"]["a"]["exit_code"] == 0 and saved["hosts"]["b"]["state"] == "running"
    control.write_back(record, {"a": {"state": "exited", "exit_code": 0}, "b": {"state": "exited", "exit_code": 3, "ended": 5.0}})
    saved = json.loads((record.path / "run.json").read_text())
    assert saved["state"] == "failed" and saved["failed_host"] == "b" and saved["hosts"]["b"] == {"node_rank": 1, "state": "exited", "exit_code": 3, "ended": 5.0}


def test_a_detached_run_that_exited_0_everywhere_is_recorded_succeeded(tmp_path, monkeypatch):
    record = record_with(tmp_path, monkeypatch)
    control.write_back(record, {"a": {"state": "exited", "exit_code": 0}, "b": {"state": "exited", "exit_code": 0}})
    assert json.loads((record.path / "run.json").read_text())["state"] == "succeeded"


def test_logs_writes_summary_json_from_the_collected_files(tmp_path, monkeypatch):
    record = record_with(tmp_path, monkeypatch)
    for name, code in (("a", "0"), ("b", "0")):
        (record.path / name / "run").mkdir(parents=True)
        (record.path / name / "run" / "exit_code").write_text(code + "\n")
    (record.path / "b" / "extra" / "0").mkdir(parents=True)  # rank 0 ran on b (c10d): its metrics are the run's
    (record.path / "b" / "extra" / "0" / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0, "skipped_steps": 0}\n'
        '{"event": "summary", "initial_loss": 2.5, "final_loss": 2.0, "tokens_per_s": 99.0, "steps": 2}\n')
    control.write_back(record, logs.collected_states(record))
    summary = logs.summarize(record)
    assert json.loads((record.path / "summary.json").read_text()) == summary
    assert summary["state"] == "succeeded" and summary["metrics_host"] == "b"
    assert summary["hosts"] == {"a": {"node_rank": 0, "state": "exited", "exit_code": 0}, "b": {"node_rank": 1, "state": "exited", "exit_code": 0}}
    assert (summary["last_step"], summary["final_loss"], summary["tokens_per_s"]) == (2, 2.0, 99.0)


# ------------------------------------------------------------------------------------------- ranks (c10d)


def test_lines_are_labelled_with_the_rank_torch_gave_the_worker():
    assert split_rank("[rank5]:hello", rank_offset=0) == (5, "hello")  # mnft's template: the global rank
    assert split_rank("[default1]:hello", rank_offset=4) == (5, "hello")  # torchrun's default: local rank
    assert split_rank("plain", rank_offset=4) == (None, "plain")


def test_pieces_of_a_glued_line_keep_their_ranks_and_torchs_own_prefix_is_dropped():
    from mnft.run.gang import split_ranks

    assert split_ranks("[rank0]: 40%|####  | 8/20[rank0]:{'loss': '4.69'}", 0) == [(0, " 40%|####  | 8/20"), (0, "{'loss': '4.69'}")]
    assert split_ranks("[rank3]:[rank3]:   File \"t.py\", line 8", 0) == [(3, '  File "t.py", line 8')]
    assert split_ranks("[default0]:a[default1]:b", 4) == [(4, "a"), (5, "b")]
    assert split_ranks("no prefix", 0) == [(None, "no prefix")]


def test_the_failed_rank_and_its_traceback_are_found_in_a_hosts_output():
    from mnft.run.gang import failure_excerpt

    tail = [(None, "ARGV []"), (2, "Traceback (most recent call last):"), (2, '  File "/w/ddp.py", line 8, in <module>'),
            (2, "    raise ValueError('boom')"), (2, "ValueError: boom"), (3, "Traceback (most recent call last):"),
            (3, "  File \"x\""), (3, "RuntimeError: Connection closed by peer"), (None, "Root Cause (first observed failure):"),
            (None, "[0]:"), (None, "  time      : 2026-11-23_06:07:37"), (None, "  host      : h2"), (None, "  rank      : 2 (local_rank: 0)")]
    assert failure_excerpt(tail) == (2, ["Traceback (most recent call last):", '  File "/w/ddp.py", line 8, in <module>',
                                         "    raise ValueError('boom')", "ValueError: boom"])
    assert failure_excerpt([(None, "Killed")]) == (None, [])


def test_an_exit_code_the_job_declares_resumable_is_recorded_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    job = {"entry": ["llava/train/train_mem.py"], "resume": {"layout": "hf", "exit_codes": [124]}}
    record = records.RunRecord.create("R3", state="running", job=job, hosts={"a": {"node_rank": 0}, "b": {"node_rank": 1}})
    control.write_back(record, {"a": {"state": "exited", "exit_code": 124}, "b": {"state": "exited", "exit_code": 124}})
    saved = records.load("R3").data
    assert saved["state"] == "resumable" and "asks to be resumed" in saved["reason"]


def test_a_job_without_metrics_shows_its_time_and_last_line():
    out = io.StringIO()
    clock = Clock()
    display = progress.Display(Console(file=out, force_terminal=False, width=200), 8, every_s=30.0, clock=clock)
    display.line("h1", 0, "loading shards")
    display.tick()
    clock.now = 31.0
    display.line("h1", 0, "epoch 1 done")
    display.tick()
    assert out.getvalue().splitlines()[-1] == "progress: running 31s, no metrics found; last line: epoch 1 done"
    display.metric({"loss": 2.5, "epoch": 0.1, "step": None})  # the first metrics are shown at once, clock or not
    assert out.getvalue().splitlines()[-1] == "progress: loss 2.5000  epoch 0.10"


def test_c10d_watches_rank_0_metrics_on_every_host_and_static_on_the_master():
    inv = inventory.parse("hosts:\n  a: {address: 10.0.0.1, slots: 2}\n  b: {address: 10.0.0.2, slots: 1}\n")
    kw = dict(master_addr="10.0.0.1", port=1, run_id="R", job_id="J", ifaces={}, env={}, secret_names=())
    a, b = launch.plan(inv, options=LaunchOptions(rdzv="c10d"), **kw)
    assert a.metrics == b.metrics == "~/mnft/outputs/J/metrics.jsonl"
    assert a.env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]:"
    same = inventory.parse("hosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2}\n")
    a, b = launch.plan(same, options=LaunchOptions(), **kw)
    assert a.metrics and b.metrics is None


# ------------------------------------------------------------------------------------------- progress line


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_jobs_summary_is_shown_after_the_lines_it_printed_before_writing_it():
    """Issue 36: the recipes print `checkpoint step-200 complete`, then write their summary to the metrics file, which
    the host's agent follows apart from the output: the summary reached the terminal first. It is shown as the
    attempt ends."""
    out = io.StringIO()
    display = progress.Display(Console(file=out, force_terminal=False, width=200), 8)
    display.metric({"step": 200, "loss": 0.5})
    display.metric({"event": "summary", "initial_loss": 2.5, "final_loss": 0.5, "tokens_per_s": 99.0, "steps": 200})
    display.line("h1", 0, "checkpoint step-200 complete")
    display.end()
    lines = out.getvalue().splitlines()
    assert lines[-2:] == ["h1 r0   | checkpoint step-200 complete", "summary: loss 2.5000 -> 0.5000, 99 tokens/s over 200 steps"]


def test_without_a_terminal_the_progress_line_is_printed_every_n_steps_or_seconds():
    out = io.StringIO()
    clock = Clock()
    display = progress.Display(Console(file=out, force_terminal=False, width=200), 8, every_steps=10, every_s=30.0, clock=clock)
    for step in range(1, 26):
        clock.now = step * 1.0
        display.metric({"step": step, "loss": 1.0 / step, "tokens_per_s": 100.0, "skipped_steps": 0})
    clock.now = 60.0
    display.metric({"step": 26, "loss": 0.5, "tokens_per_s": 100.0})  # 35 s after step 21's line
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1", "11", "21", "26"]
    assert lines[0] == "progress: step 1  loss 1.0000  100 tokens/s  skipped 0"


# ------------------------------------------------------------------------------------------- logs -f


def test_tail_follow_ends_when_no_process_of_the_run_remains_even_without_an_exit_code(tmp_path):
    (tmp_path / "w").mkdir()
    spec = {"run_id": "RK", "tag": "RK@local", "run_dir": str(tmp_path / "run"), "argv": [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
            "cwd": str(tmp_path / "w"), "env": {}, "secrets": {}, "metrics": None, "detach": True, "deadman": 5, "grace": 1}
    started = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, "launch"], input=pyrun.payload("agent") + json.dumps(spec).encode() + b"\n",
                             capture_output=True, timeout=60)
    pgid = json.loads(started.stdout.decode().splitlines()[0])["pgid"]
    follower = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "tail", str(tmp_path / "run"), "5", "--follow"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    follower.stdin.write(pyrun.payload("agent"))
    follower.stdin.flush()  # stays open: the follower is still there
    for _ in range(600):  # the run is up (bounded: a run that never starts fails below, it does not hang)
        if runprocs.run_pids("RK@local"):
            break
        time.sleep(0.1)
    assert runprocs.run_pids("RK@local")
    os.killpg(pgid, signal.SIGKILL)  # keeper and command die at once: nobody writes exit_code
    guard = threading.Timer(60, follower.kill)  # a follower that never ends fails the test instead of hanging it
    guard.start()
    out = follower.stdout.read()  # stdin stays open: the follower must end by itself
    guard.cancel()
    follower.stdin.close()
    follower.wait()
    last = json.loads(out.decode().splitlines()[-1])
    assert last["event"] == "exit" and last["code"] is None and "keeper was killed" in last["reason"]
    assert not (tmp_path / "run" / "exit_code").exists()


# ------------------------------------------------------------------------------------------- stop and GPUs


SMI = "1234, 15360\n5678, 812\n  \n9, [N/A]\n"


def test_nvidia_smi_compute_apps_are_parsed():
    assert rungpus.parse_compute_apps(SMI) == [{"pid": 1234, "memory_mib": 15360}, {"pid": 5678, "memory_mib": 812}, {"pid": 9, "memory_mib": None}]
    assert rungpus.parse_compute_apps("") == []


def test_a_gpu_held_by_the_run_after_stop_fails_and_one_held_by_your_other_processes_warns():
    me, bob = os.getuid(), os.getuid() + 1
    owners = {1234: me, 5678: me, 9: me, 4242: bob}.get
    apps = rungpus.parse_compute_apps(SMI + "4242, 900\n")  # 4242: another user's run on the shared host: not a warning
    report = rungpus.gpu_report(apps, {1234, 77}, owner=owners)
    assert report == {"gpus_held": ["pid 1234 (15360 MiB)"], "gpus_other": ["pid 5678 (812 MiB)", "pid 9 (? MiB)"]}
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    result = {"h1": {"killed": [1234], "remaining": [], **report}, "h2": {"killed": [], "remaining": [], "gpus_held": [], "gpus_other": []}}
    assert control.gpu_verdict(result, ExitCode.OK, console) == ExitCode.FAILED
    assert "h1: a GPU is still held by the run: pid 1234 (15360 MiB)" in out.getvalue()
    assert "h1: warning: GPUs held by your other processes (not this run's): pid 5678 (812 MiB), pid 9 (? MiB)" in out.getvalue()
    others_only = {"h1": {"killed": [], "remaining": [], "gpus_held": [], "gpus_other": ["pid 5678 (812 MiB)"]}}
    assert control.gpu_verdict(others_only, ExitCode.OK, None) == ExitCode.OK
    assert rungpus.gpu_report(None, set())["gpu_error"] == "nvidia-smi failed"


def test_the_agent_packs_a_metrics_directory_with_a_dangling_link_skipping_the_link(tmp_path, capsys):
    import base64
    import tarfile

    (tmp_path / "run").mkdir()
    metrics = tmp_path / "tb"
    metrics.mkdir()
    (metrics / "events.out").write_text("e")
    (metrics / "gone").symlink_to(tmp_path / "nowhere")
    assert queries.pack(str(tmp_path / "run"), [str(metrics)]) == 0
    reply = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = tarfile.open(fileobj=io.BytesIO(base64.b64decode(reply["tar"]))).getnames()
    assert "extra/0/events.out" in names and not any(n.endswith("gone") for n in names)


def test_an_env_file_is_checked_as_opened_and_must_be_yours(tmp_path):
    import os

    f = tmp_path / "run.env"
    f.write_text("A=1\n")
    f.chmod(0o600)
    os.chown(f, 12345, -1)  # the tests run as root: another user's file
    with pytest.raises(InputError, match="owned by uid 12345, not by you"):
        launch.split_env((), {}, (str(f),))
    big = tmp_path / "big.env"
    big.write_text("A=" + "x" * (launch.ENV_FILE_MAX + 10) + "\n")
    big.chmod(0o600)
    with pytest.raises(InputError, match="larger than 256 KiB"):
        launch.split_env((), {}, (str(big),))


@pytest.mark.parametrize("run_id", ["../outside", "/etc", "a/b", "..", "x\n"])
def test_a_run_id_never_leaves_runs(tmp_path, monkeypatch, run_id):
    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "run.json").write_text('{"run_id": "../outside"}')
    with pytest.raises(InputError, match="not a run id"):
        records.load(run_id)


def test_a_damaged_run_record_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    (tmp_path / "R1").mkdir()
    (tmp_path / "R1" / "run.json").write_text("[" * 100000)
    with pytest.raises(InputError, match="unreadable run record"):
        records.load("R1")
    (tmp_path / "R1" / "run.json").write_text('{"run_id": "R2"}')
    with pytest.raises(InputError, match="not this run's record"):
        records.load("R1")


# ------------------------------------------------------------------------------------------- where the records go


def test_run_records_in_a_repository_stay_out_of_its_git_status(tmp_path, monkeypatch):
    """runs/ written into the user's repository (the default, relative to where mnft runs) shows nothing in `git
    status`: mnft leaves a .gitignore of `*` in it, as .pytest_cache does; a user's own .gitignore there is kept."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("print('t')\n")
    subprocess.run(["git", "-C", str(repo), "add", "train.py"], check=True)
    monkeypatch.chdir(repo)
    monkeypatch.delenv("MNFT_RUNS_DIR", raising=False)
    records.RunRecord.create("20260101-000000-aaaa", state="checking")
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True, check=True)
    assert status.stdout.splitlines() == ["A  train.py"]
    assert records.all_runs() == ["20260101-000000-aaaa"]  # the .gitignore is not a run
    (repo / "runs" / ".gitignore").write_text("# mine\n*.json\n")
    records.RunRecord.create("20260101-000000-bbbb", state="checking")
    assert (repo / "runs" / ".gitignore").read_text() == "# mine\n*.json\n"
