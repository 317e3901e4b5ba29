"""--notify: which command a run gets, what it is told (MNFT_NOTIFY_* variables, pure), how it runs (sh -c the
user's line, never a value put into it; bounded; its failure a warning)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.run import notify
from mnft.run.job import load_job_file
from mnft.run.notify import Notify, environment, settings

FAILED = {
    "run_id": "20260101-0900-ab12", "state": "failed", "job": {"name": "sft"}, "reason": "me r0 exited with 1",
    "failed_host": "gpu2", "hosts": {"gpu1": {"exit_code": 143}, "gpu2": {"exit_code": 1}},
    "diagnosis": {"kind": "oom", "cause": "rank 3 ran out of GPU memory", "fix": "lower batch_size"},
}


def test_a_failed_run_tells_its_outcome_exit_code_hosts_cause_fix_and_log():
    env = environment("ended", FAILED, "/home/me/runs/20260101-0900-ab12")
    assert env["MNFT_NOTIFY_EVENT"] == "ended" and env["MNFT_NOTIFY_RUN"] == "20260101-0900-ab12"
    assert env["MNFT_NOTIFY_KIND"] == "run" and env["MNFT_NOTIFY_OUTCOME"] == "failed"
    assert env["MNFT_NOTIFY_EXIT_CODE"] == "1" and env["MNFT_NOTIFY_FAILED_HOST"] == "gpu2"
    assert env["MNFT_NOTIFY_HOSTS"] == "gpu1,gpu2"
    assert env["MNFT_NOTIFY_CAUSE"] == "rank 3 ran out of GPU memory" and env["MNFT_NOTIFY_FIX"] == "lower batch_size"
    assert env["MNFT_NOTIFY_LOG"] == "/home/me/runs/20260101-0900-ab12"
    assert env["MNFT_NOTIFY_SUMMARY"] == ("mnft run 20260101-0900-ab12 (sft): failed on gpu1,gpu2 (exit code 1): "
                                          "rank 3 ran out of GPU memory")
    assert json.loads(env["MNFT_NOTIFY_MESSAGE_JSON"]) == {"text": env["MNFT_NOTIFY_SUMMARY"]}


def test_a_finished_run_has_exit_code_0_and_no_cause():
    data = {"run_id": "r1", "state": "succeeded", "recipe": "lora", "hosts": {"a": {"exit_code": 0}, "b": {"exit_code": 0}}}
    env = environment("ended", data, "runs/r1")
    assert (env["MNFT_NOTIFY_OUTCOME"], env["MNFT_NOTIFY_EXIT_CODE"], env["MNFT_NOTIFY_CAUSE"]) == ("succeeded", "0", "")
    assert env["MNFT_NOTIFY_SUMMARY"] == "mnft run r1 (recipe lora): succeeded on a,b"


def test_stopped_idle_stopped_and_interrupted_runs_have_no_exit_code_but_their_reason():
    for state, reason in (("stopped", "stopped by `mnft stop` (me@laptop)"), ("idle-stopped", "its GPUs were idle for 2h00m"),
                          ("interrupted", "interrupted (Ctrl-C) while running")):
        env = environment("ended", {"run_id": "r", "state": state, "reason": reason, "hosts": {"a": {}}}, "runs/r")
        assert (env["MNFT_NOTIFY_OUTCOME"], env["MNFT_NOTIFY_EXIT_CODE"]) == (state, "")
        assert env["MNFT_NOTIFY_REASON"] == reason == env["MNFT_NOTIFY_CAUSE"]


def test_a_session_and_a_start_after_waiting_in_line():
    session = {"run_id": "s1", "kind": "session", "state": "idle-stopped", "exit_code": 129, "command": ["python", "hold.py"],
               "devices": {"gpu1": [3]}, "hosts": {}, "reason": "its GPUs were idle for 30s"}
    env = environment("ended", session, "runs/s1")
    assert (env["MNFT_NOTIFY_KIND"], env["MNFT_NOTIFY_EXIT_CODE"], env["MNFT_NOTIFY_HOSTS"]) == ("session", "129", "gpu1")
    started = environment("started", {"run_id": "r2", "state": "checking", "waited_s": 754.04, "devices": {"a": [0]}}, "runs/r2")
    assert (started["MNFT_NOTIFY_EVENT"], started["MNFT_NOTIFY_OUTCOME"], started["MNFT_NOTIFY_WAITED_S"]) == ("started", "started", "754.0")
    assert started["MNFT_NOTIFY_EXIT_CODE"] == ""


def test_an_error_before_the_run_ended_by_itself_is_told_as_failed():
    assert environment("ended", {"run_id": "r", "state": "syncing", "reason": "rsync failed"}, "x")["MNFT_NOTIFY_OUTCOME"] == "failed"


def test_values_are_bounded_one_variable_each_and_hold_no_nul():
    env = environment("ended", {"run_id": "r", "state": "failed", "reason": "x\x00y" + "z" * 10000}, "x")
    assert "\x00" not in env["MNFT_NOTIFY_REASON"] and len(env["MNFT_NOTIFY_REASON"]) == notify.VALUE_CHARS
    assert all(k.startswith("MNFT_NOTIFY_") and isinstance(v, str) for k, v in env.items())


def test_the_command_is_the_users_line_given_whole_to_sh():
    assert notify.argv(Notify("mail -s done me@lab < /dev/null")) == ["/bin/sh", "-c", "mail -s done me@lab < /dev/null"]


def test_which_command_a_run_gets_flag_then_job_file_then_user_config():
    config = {"notify": {"command": "notify-send mnft", "timeout": 5}}
    assert settings(None, None, None) is None
    assert settings(None, None, config) == Notify("notify-send mnft", 5.0, "~/.mnft.yaml's notify")
    assert settings(None, "echo job", config) == Notify("echo job", 5.0, "the job file's notify:")
    assert settings("echo flag", "echo job", config) == Notify("echo flag", 5.0, "--notify")
    assert settings(None, None, {"notify": "echo short"}).command == "echo short"
    assert settings("x", None, {}).timeout == notify.NOTIFY_TIMEOUT


@pytest.mark.parametrize("config, given, said", [
    ({"notify": {"comand": "x"}}, None, "~/.mnft.yaml: notify: unknown key 'comand' (known: command, timeout)"),
    ({"notify": {"command": "x", "timeout": 0}}, None, "~/.mnft.yaml: notify.timeout: 0: give seconds, more than 0 and at most 3600"),
    ({"notify": 3}, None, "~/.mnft.yaml: notify: give a command, or command: and timeout: (see docs/lab.md)"),
    ({}, "", "--notify: a notify command is one shell line"),
    ({}, "a\nb", "--notify: 'a\\nb': a notify command is one line (no newline, no NUL)"),
])
def test_a_bad_notify_setting_is_one_line_naming_where(config, given, said):
    with pytest.raises(InputError) as caught:
        settings(given, None, config)
    assert str(caught.value).startswith(said)


def test_a_job_files_notify_is_parsed_strictly_and_not_recorded(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("script: train.py\nnotify: echo \"$MNFT_NOTIFY_SUMMARY\"\n")
    parsed = load_job_file(job)
    assert parsed.notify == 'echo "$MNFT_NOTIFY_SUMMARY"' and "notify" not in parsed.to_record()
    job.write_text("script: train.py\nnotify: [echo]\n")
    with pytest.raises(InputError, match=r"job.yaml:2: key 'notify': .*one shell line"):
        load_job_file(job)


def test_a_value_reaches_the_command_only_through_its_environment(tmp_path):
    out = tmp_path / "told"
    evil = {"run_id": "r; touch " + str(tmp_path / "pwned"), "state": "failed", "reason": "$(touch " + str(tmp_path / "pwned2") + ")"}
    told = notify.run(Notify(f'printf "%s|%s|%s" "$MNFT_NOTIFY_RUN" "$MNFT_NOTIFY_REASON" "$MNFT_NOTIFY_STALE" > {out}'), environment("ended", evil, "x"),
                      base_env={"PATH": os.environ["PATH"], "MNFT_NOTIFY_STALE": "from an outer run"})
    assert told == notify.Told(True)
    assert out.read_text() == f"{evil['run_id']}|{evil['reason']}|"  # an outer run's MNFT_NOTIFY_* is not this one's
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


def test_a_failing_command_is_a_warning_with_its_output():
    told = notify.run(Notify("echo 'mail: no such user' >&2; exit 3"), {})
    assert told == notify.Told(False, "the notify command (--notify) exited with 3: mail: no such user")


def test_a_hanging_command_is_killed_with_everything_it_started(tmp_path):
    pids = tmp_path / "pids"
    told = notify.run(Notify(f"sleep 300 & echo $! > {pids}; echo $$ >> {pids}; wait", timeout=1.0), {})
    assert told == notify.Told(False, "the notify command (--notify) took more than 1s and was killed")
    for pid in map(int, pids.read_text().split()):
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
