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
