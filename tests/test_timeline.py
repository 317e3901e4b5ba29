"""A restarted run's metrics told truthfully: HF Trainer's step-less console records get their steps from the
epoch (calibrated by the job's trainer_state.json), each attempt keeps its own records, and an attempt that
resumed supersedes what the one before it trained past the checkpoint. Data: real output of transformers 5.24's
Trainer (tests/data/hf-trainer-5.24/README.md says how it was made)."""

from __future__ import annotations

import json
from pathlib import Path

from mnft.run import scrape, timeline
from mnft.run.timeline import AttemptMetrics, Calibration

DATA = Path(__file__).parent / "data" / "hf-trainer-5.24"


def printed(name: str) -> list[dict]:
    return [r for r in scrape.LineParser("hf").lines((DATA / name).read_text().splitlines()) if "loss" in r]


def state(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_hf_console_records_carry_no_step_but_an_epoch():
    records = printed("attempt-1.out")
    assert [r["step"] for r in records] == [None] * 6 and records[2]["epoch"] == 1.375


def test_the_step_is_derived_from_the_epoch_with_the_jobs_own_trainer_state():
    calibration = timeline.calibration_from_states([state("checkpoint-20.trainer_state.json")])
    assert calibration.logging_steps == 5 and round(calibration.steps_per_epoch, 3) == round(20 / 1.84375, 3)
    steps = timeline.derive_steps(printed("attempt-1.out"), calibration)
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30] and all(r["step_from"] == "epoch" for r in steps)
    # gradient accumulation makes epochs uneven (11 optimizer steps an epoch, the last short): the whole run agrees
    final = state("final.trainer_state.json")
    truth = [(e["step"], e["epoch"]) for e in final["log_history"] if "loss" in e]
    derived = timeline.derive_steps([{"loss": 1.0, "epoch": float(f"{epoch:.4g}"), "step": None} for _, epoch in truth], calibration)
    assert [r["step"] for r in derived] == [step for step, _ in truth]


def test_a_resumed_attempt_counts_from_its_checkpoint_not_from_one():
    calibration = timeline.calibration_from_states([state("checkpoint-20.trainer_state.json")])
    steps = timeline.derive_steps(printed("attempt-2.out"), calibration, after=20)
    assert [r["step"] for r in steps] == [25, 30, 35, 40, 45, 50, 55, 60]


def test_four_printed_digits_never_make_a_step_go_back():
    # a long epoch: 1000 steps an epoch, logged every step; '2.001' and '2.0015' print alike
    calibration = Calibration(1000.0, 1)
    records = [{"loss": 1.0, "epoch": e, "step": None} for e in (2.0, 2.001, 2.001, 2.003)]
    assert [r["step"] for r in timeline.derive_steps(records, calibration)] == [2000, 2001, 2002, 2003]


def test_printed_values_give_way_to_the_exact_ones_of_the_same_step():
    calibration = timeline.calibration_from_states([state("checkpoint-20.trainer_state.json")])
    exact = scrape.trainer_state_records(state("checkpoint-20.trainer_state.json"))
    refined = timeline.refine(timeline.derive_steps(printed("attempt-1.out"), calibration), exact)
    assert refined[3]["loss"] == exact[3]["loss"] == 4.6892555236816404 and refined[3]["step"] == 20
    assert refined[4]["loss"] == 4.681  # step 25 is in no file: the printed digits stay
    other = timeline.refine([{"step": 20, "loss": 9.0}], exact)  # a different loss is not the same record
    assert other == [{"step": 20, "loss": 9.0}]


def test_without_a_checkpoint_a_finished_run_is_calibrated_by_its_closing_summary():
    lines = (DATA / "attempt-2.out").read_text().splitlines()
    summary = next(r for r in scrape.LineParser("hf").lines(lines) if r.get("event") == "summary")
    calibration = timeline.calibration_from_summary(summary, resumed_step=20)
    steps = timeline.derive_steps(printed("attempt-2.out"), calibration, after=20)
    assert [r["step"] for r in steps][-1] == 60 and [r["step"] for r in steps][0] == 25


def test_the_training_bar_gives_the_global_step_live_and_other_bars_are_not_it():
    found = [timeline.bar_step(line) for line in (DATA / "attempt-2.err").read_text().splitlines()]
    assert [f for f in found if f] == [(0, 60), (24, 60), (25, 60), (30, 60), (35, 60), (40, 60), (45, 60), (47, 60)]


def test_the_kept_timeline_cuts_each_attempt_where_the_next_one_resumed():
    calibration = timeline.calibration_from_states([state("checkpoint-20.trainer_state.json")])
    first = timeline.derive_steps(printed("attempt-1.out"), calibration)
    second = timeline.derive_steps(printed("attempt-2.out"), calibration, after=20)
    merged = timeline.merge([AttemptMetrics(1, first), AttemptMetrics(2, second, resumed_step=20)])
    assert [(r["attempt"], r["step"]) for r in merged.records] == [(1, 5), (1, 10), (1, 15), (1, 20)] + [(2, s) for s in range(25, 61, 5)]
    one, two = merged.attempts
    assert (one.first_step, one.last_step, one.kept_to, one.steps_lost) == (5, 30, 20, 10)
    assert (two.first_step, two.last_step, two.kept_to, two.steps_lost) == (25, 60, 60, 0)
    assert merged.records[-1]["loss"] == 4.667 and merged.numbered


def test_an_attempt_that_began_again_supersedes_everything_before_it():
    first = [{"step": s, "loss": 5.0} for s in (1, 2, 3)]
    second = [{"step": s, "loss": 4.0} for s in (1, 2)]
    merged = timeline.merge([AttemptMetrics(1, first), AttemptMetrics(2, second)])
    assert [(r["attempt"], r["step"]) for r in merged.records] == [(2, 1), (2, 2)]
    assert merged.attempts[0].steps_lost == 3


def test_records_without_steps_stay_in_their_attempts_order():
    first = [{"step": None, "loss": 5.0}, {"step": None, "loss": 4.5}]
    second = [{"step": None, "loss": 4.4}]
    merged = timeline.merge([AttemptMetrics(1, first), AttemptMetrics(2, second, resumed_step=10)])
    assert [(r["attempt"], r["loss"], r["index"]) for r in merged.records] == [(1, 5.0, 1), (1, 4.5, 2), (2, 4.4, 3)]
    assert not merged.numbered and merged.attempts[0].steps_lost is None


def test_a_job_that_resumes_itself_is_cut_where_its_next_attempt_began():
    """layout none (the script finds its own checkpoint): mnft does not know the resume point, the records say it."""
    first = [{"step": s, "loss": 1.0} for s in (1, 2, 3)]
    second = [{"step": s, "loss": 0.5} for s in (3, 4, 5)]  # it saved at step 2 and began again at 3
    merged = timeline.merge([AttemptMetrics(1, first), AttemptMetrics(2, second)])
    assert [(r["attempt"], r["step"]) for r in merged.records] == [(1, 1), (1, 2), (2, 3), (2, 4), (2, 5)]
    assert merged.attempts[0].steps_lost == 1


def test_a_metrics_file_carried_across_a_resume_counts_each_step_once_for_the_attempt_that_trained_it():
    """mnft's recipes append to one metrics.jsonl: attempt 2's copy holds attempt 1's lines (1-8) before its own
    (5-16, resumed from step 4)."""
    first = [{"step": s, "loss": 1.0} for s in range(1, 9)]
    second = first + [{"step": s, "loss": 0.5} for s in range(5, 17)]
    merged = timeline.merge([AttemptMetrics(1, first), AttemptMetrics(2, second, resumed_step=4)])
    assert [(r["attempt"], r["step"]) for r in merged.records] == [(1, s) for s in range(1, 5)] + [(2, s) for s in range(5, 17)]
    assert {r["loss"] for r in merged.records if r["attempt"] == 2} == {0.5}
    one, two = merged.attempts
    assert (one.first_step, one.last_step, one.steps_lost) == (1, 8, 4) and (two.first_step, two.last_step) == (5, 16)
