"""Where a run's wall time went, measured from mnft's own event times and the arrival times of rank 0's step
records: a run restarted after a failure, its checkpoints, the steps it trained twice, and its goodput."""

from __future__ import annotations

from mnft.run import goodput

# a run created at t=0; attempt 1 starts, first step record at 10, one every 1 s to step 30 (at 39, a save after
# step 20 made that interval 4 s), fails, noticed at 45; attempt 2 starts at 60 resumed from step 20, first
# record (step 21) at 70, last (step 40) at 89, ends at 91
ATTEMPTS = [
    {"number": 1, "started": 0.5, "ended": 45.0, "detected": 45.0, "state": "failed"},
    {"number": 2, "started": 60.0, "ended": 91.0, "state": "succeeded", "resumed_step": 20},
]
FIRST = [(10.0 + i, i + 1) for i in range(20)] + [(33.0 + i, 21 + i) for i in range(10)]  # step 20 at 29, 21 at 33
SECOND = [(70.0 + i, 21 + i) for i in range(20)]
TOLD = {1: {"steps_lost": 10, "kept_to": 20}, 2: {"steps_lost": 0, "kept_to": 40}}


def measured():
    return goodput.measure(0.0, 91.0, ATTEMPTS, {1: FIRST, 2: SECOND}, TOLD, checkpoint_steps={20})


def test_each_attempt_says_launch_steps_detection_and_restart():
    one, two = measured().attempts
    assert (one.launch_s, one.steps_s, one.detection_s, one.restart_s) == (10.0, 32.0, 3.0, 15.0)
    assert (two.launch_s, two.steps_s, two.finish_s, two.restart_s) == (10.0, 19.0, 2.0, None)


def test_the_save_is_the_interval_holding_its_step_beyond_the_usual_step():
    one, two = measured().attempts
    assert one.checkpoint_s == 3.0  # the 20 -> 21 interval took 4 s, a step takes 1 s
    assert two.checkpoint_s == 0.0  # no save in attempt 2's records


def test_steps_trained_again_are_lost_time_and_goodput_counts_only_kept_steps():
    run = measured()
    one, two = run.attempts
    assert one.steps_lost == 10 and one.lost_s == 42.0 - 29.0  # from step 20's record to the last one
    assert one.kept_s == 32.0 - 3.0 - 13.0 and two.kept_s == 19.0
    assert run.to_json()["goodput"] == round((16.0 + 19.0) / 91.0, 4) and run.to_json()["steps_lost"] == 10


def test_an_attempt_that_never_reached_a_step_is_all_launch_when_another_did():
    attempts = [{"number": 1, "started": 1.0, "ended": 20.0, "detected": 20.0, "state": "failed"},
                {"number": 2, "started": 25.0, "ended": 40.0, "detected": 40.0, "state": "failed"}]
    one, two = goodput.measure(0.0, 40.0, attempts, {1: [(10.0, 1), (19.0, 10)]}).attempts
    assert two.launch_s == 15.0 and two.steps_s is None  # the job prints step records: this one never got to one
    assert one.launch_s == 10.0


def test_without_any_step_record_the_time_is_not_split_and_says_why():
    """Issue 36: a script whose lines mnft could not read had its 60 s of training shown as launch."""
    for state in ("failed", "succeeded", "stopped"):
        attempts = [{"number": 1, "started": 1.0, "ended": 60.0, "detected": 60.0, "state": state}]
        run = goodput.measure(0.0, 60.0, attempts, {})
        (one,) = run.attempts
        assert one.launch_s is None and one.steps_s is None and run.ratio is None
        assert run.to_json()["unknown"] == goodput.UNKNOWN and run.to_json()["launch_s"] is None


def test_the_time_table_says_when_the_time_is_not_known():
    from rich.console import Console

    from mnft.run.report import time_table

    attempts = [{"number": 1, "started": 1.0, "ended": 60.4, "state": "succeeded"}]
    console = Console(width=200, record=True)
    console.print(time_table(goodput.measure(0.0, 60.4, attempts, {}).to_json()))
    text = console.export_text()
    assert "no step record was read from the job's output: where the time went is not known" in text
    assert "60.4s" not in text.split("where the time went: 60.4s wall")[1]  # no column holds the run's time


# ------------------------------------------------------------------------------------------------ checkpoints saved


def _pack_checkpoints(where, capsys) -> dict:
    """What a host's agent answers `logs` about the job's checkpoints directory (its pack, as shipped)."""
    import json

    from mnft.onhost import agent

    (where.parent / "run").mkdir(exist_ok=True)
    assert agent.main(["pack", str(where.parent / "run"), f"--checkpoints={where}"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoints"]


def _record(tmp_path, monkeypatch, layout: dict, attempts: list[dict], created: float):
    from mnft.run import records
    from mnft.run.job import Job, ResumeRule

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    job = Job(("steps.py",), resume=ResumeRule(**layout))
    record = records.RunRecord.create("R1", state="succeeded", launched=True, job=job.to_record(),
                                      hosts={"h1": {"node_rank": 0, "state": "exited", "exit_code": 0}}, attempts=attempts)
    record.data["created"] = created
    record.save()
    return record


def test_a_script_with_a_checkpoint_rule_shows_the_checkpoints_it_saved(tmp_path, monkeypatch, capsys):
    """Issue 36: a script whose glob rule matched 8 saves showed '-' in the checkpoints column: only hf, torchtune
    and mnft names were recognised, and only in files collected as metrics. Now the job's own rule counts the
    names in its checkpoints directory, those this run saved (one an earlier run of the job saved is not)."""
    import os
    import time

    from rich.console import Console

    from mnft.run import logs
    from mnft.run.report import time_table

    now = time.time()
    ckpts = tmp_path / "job" / "ckpts"
    ckpts.mkdir(parents=True)
    for n in range(1, 9):
        (ckpts / f"ckpt_{n * 10}").mkdir()
        (ckpts / f"ckpt_{n * 10}" / "DONE").write_text("")
    (ckpts / "ckpt_0").mkdir()  # an earlier run of the job saved it
    os.utime(ckpts / "ckpt_0", (now - 3600, now - 3600))
    (ckpts / "steps.py").write_text("")  # the job's code, beside what it writes
    (ckpts / "events.log").write_text("")
    record = _record(tmp_path, monkeypatch, {"layout": "glob", "pattern": "ckpt_*", "marker": "DONE", "checkpoints": "ckpts"},
                     [{"number": 1, "started": now - 59, "ended": now + 1, "state": "succeeded"}], now - 60)
    logs.keep_checkpoint_names(record.path / "h1", _pack_checkpoints(ckpts, capsys), time.time())
    spent = logs.summarize(record)["time"]
    assert spent["checkpoints"] == 8 and spent["attempts"][0]["checkpoints"] == 8
    console = Console(width=200, record=True)
    console.print(time_table(spent))
    assert "- (8)" in console.export_text()  # no step record: the save time is not known, the count is


def test_each_attempt_counts_the_saves_it_made_and_their_time_beside(tmp_path, monkeypatch, capsys):
    """The siblings: hf's checkpoint-N split over a restarted run's attempts by when each was written, sana's and
    the recipes' names, a host clock that is off, and a directory too large to list whole."""
    import os

    from rich.console import Console

    from mnft.run import checkpoints, logs

    from mnft.onhost import queries
    from mnft.run.job import ResumeRule
    from mnft.run.report import time_table

    ckpts = tmp_path / "job" / "out"
    ckpts.mkdir(parents=True)
    for step, at in ((10, 1010.0), (20, 1020.0), (30, 1040.0), (40, 1080.0)):
        (ckpts / f"checkpoint-{step}").mkdir()
        os.utime(ckpts / f"checkpoint-{step}", (at, at))
    listing = queries.checkpoint_names(str(ckpts))
    listing["now"] -= 1000.0 - 5.0  # the host's clock is 995 s behind this machine's, which reads it at now + 5 s
    listing["entries"] = {name: t - 995.0 for name, t in listing["entries"].items()}
    attempts = [{"number": 1, "started": 1001.0, "ended": 1030.0, "detected": 1030.0, "state": "failed"},
                {"number": 2, "started": 1035.0, "ended": 1090.0, "state": "succeeded"}]
    record = _record(tmp_path, monkeypatch, {"layout": "hf"}, attempts, 1000.0)
    logs.keep_checkpoint_names(record.path / "h1", listing, listing["now"] + 995.0 + 5.0)
    steps, times, more = logs.checkpoints_saved(record)
    assert steps == {10, 20, 30, 40} and sorted(round(t) for t in times) == [1015, 1025, 1045, 1085] and not more
    # a step a second; the saves after steps 10 and 20 took 2 s each, the one after step 30 1 s
    step_times = {1: [(1002.0 + i + 2 * (i > 10) + 2 * (i > 20), i) for i in range(25)],
                  2: [(1036.0 + i + (i > 30), i) for i in range(20, 41)]}
    run = goodput.measure(1000.0, 1090.0, attempts, step_times, checkpoint_steps=steps, saved_at=times)
    assert [a.checkpoints for a in run.attempts] == [2, 2] and run.checkpoints == 4
    console = Console(width=200, record=True)
    console.print(time_table(run.to_json()))
    text = console.export_text()
    assert "4.0s (2)" in text and "1.0s (2)" in text and "5.0s (4)" in text
    # each layout's own names; none counts nothing
    names = {"latest.pth", "epoch_1_step_500.pth", "epoch_1_step_600.pth", "step-40", "step-80", "notes.txt", "epoch_2", "step_9"}
    assert checkpoints.saved(ResumeRule(layout="sana"), names) == ["epoch_1_step_600.pth", "epoch_1_step_500.pth"]
    assert checkpoints.saved(ResumeRule(layout="mnft"), names) == ["step-80", "step-40"]
    assert checkpoints.saved(ResumeRule(layout="torchtune"), names) == ["epoch_2", "step_9"]
    assert checkpoints.saved(ResumeRule(layout="none"), names) == []
    # a directory too large to name whole: at least that many
    assert queries.checkpoint_names(str(ckpts), limit=3)["more"]
    run = goodput.measure(1000.0, 1090.0, attempts, {}, saved_at=times[:3], saved_more=True)
    console = Console(width=200, record=True)
    console.print(time_table(run.to_json()))
    assert "- (3+)" in console.export_text()


# ------------------------------------------------------------------------------------------------ a run still going


def _running_script(tmp_path, monkeypatch):
    import time

    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    now = time.time()
    record = records.RunRecord.create("R9", state="running", launched=True, job={"entry": ["steps.py"]},
                                      hosts={"h1": {"node_rank": 0, "state": "running"}}, inventory={"hosts": [{"slots": 1}]},
                                      attempts=[{"number": 1, "started": now - 50}])
    record.data["created"] = now - 60
    record.save()
    (record.path / "h1" / "run").mkdir(parents=True)
    (record.path / "h1" / "run" / "output.log").write_text("".join(f"[rank0]:step {n} loss {3 - n / 10}\n" for n in range(1, 6)))
    return record, now


def test_logs_of_a_running_detached_script_never_says_no_step_was_read_beside_its_loss(tmp_path, monkeypatch):
    """Issue 45: `mnft logs` of a running script printed `summary: loss 2.9 -> 2.5` and, in the same breath, `no step
    record was read from the job's output`. The steps were read; what no one saw is when each arrived (a detached
    run has no supervisor to time them), and a loss of a run still going is so far, not its summary."""
    from rich.console import Console

    from mnft.run import logs

    record, _ = _running_script(tmp_path, monkeypatch)
    console = Console(width=300, record=True)
    logs.print_summary(logs.summarize(record), record, console)
    text = console.export_text()
    assert "so far (running): loss 2.9000 -> 2.5000 over 5 steps" in text
    assert "no step record was read" not in text and goodput.UNTIMED.split(":")[0] in text


def test_a_running_attached_runs_time_is_split_from_the_step_records_as_they_arrived(tmp_path, monkeypatch):
    import json

    from mnft.run import logs

    record, now = _running_script(tmp_path, monkeypatch)
    (record.path / logs.LIVE_METRICS).write_text("".join(
        json.dumps({"attempt": 1, "t": now - 40 + n, "step": n, "loss": 3 - n / 10}) + "\n" for n in range(1, 6)))
    spent = logs.summarize(record)["time"]
    assert "unknown" not in spent and spent["attempts"][0]["launch_s"] == 21.0 and spent["attempts"][0]["steps_s"] == 4.0
