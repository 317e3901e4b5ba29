"""`invoke status`: the row a host gets from its run directory and how the table shows it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from mnft.run import control

from mnft.onhost import queries
from mnft.run.report import print_status


def finished_run(tmp_path, metric_lines):
    run = tmp_path / "run"
    run.mkdir()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in metric_lines))
    (run / "spec.json").write_text(json.dumps({"run_id": "R1", "tag": "R1@nowhere", "metrics": str(metrics)}))
    (run / "exit_code").write_text("0")
    return run


def test_status_shows_the_last_step_not_the_summary_or_a_checkpoint_event(tmp_path):
    run = finished_run(tmp_path, [
        {"step": 199, "loss": 1.25},
        {"step": 200, "loss": 1.2032},
        {"event": "checkpoint", "step": 200, "path": "/o/checkpoints/step-200"},
        {"event": "summary", "initial_loss": 6.3, "final_loss": 1.16, "steps": 200},
        {"event": "saved", "adapter": "/o/adapter"},
    ])
    state = queries.status(str(run))
    assert state["state"] == "exited" and state["exit_code"] == 0
    assert control.last_metric({"recipe": "lora"}, "a", state) == {"step": 200, "loss": 1.2032}


def test_status_of_a_script_reads_rank_0s_output_in_the_jobs_format(tmp_path):
    run = finished_run(tmp_path, [])
    (run / "output.log").write_text(
        "[rank1]:{'loss': 9.0, 'epoch': 0.5}\n"  # another rank's line never counts
        "[rank0]:{'loss': 2.5, 'grad_norm': 1.0, 'learning_rate': 5e-05, 'epoch': 0.25}\n"
        "[rank0]:{'loss': 2.25, 'grad_norm': 1.0, 'learning_rate': 4e-05, 'epoch': 0.5}\n"
        "[rank0]: 50%|#####     | 20/40 [00:10<00:10]\n")
    data = {"job": {"entry": ["train.py"], "metrics": {"format": "hf"}}, "hosts": {"a": {"node_rank": 0}},
            "inventory": {"hosts": [{"slots": 1}]}}
    state = dict(queries.status(str(run)), metric_lines=[])
    # HF's records carry no step: the training bar printed after the newest one says where it is, about
    assert control.last_metric(data, "a", state) == {"loss": 2.25, "grad_norm": 1.0, "lr": 4e-05, "epoch": 0.5, "step": 20, "step_about": True}
    (run / "output.log").write_text("[rank0]:{'loss': 2.25, 'epoch': 0.5}\n")
    assert control.last_metric(data, "a", dict(queries.status(str(run)), metric_lines=[]))["step"] is None  # no bar: unknown


def test_a_non_finite_loss_is_shown_as_the_recipe_wrote_it(capsys):
    record = SimpleNamespace(run_id="R1", data={"recipe": "lora", "hosts": {"a": {"node_rank": 0}, "b": {"node_rank": 1}}})
    states = {
        "a": {"state": "running", "processes": 2, "last_metric": {"step": 7, "loss": "nan"}, "started": 1.0},
        "b": {"state": "running", "processes": 2, "last_metric": {"step": 7, "loss": 2.5}, "started": 1.0},
    }
    assert print_status(record, states, as_json=False) == 0
    out = capsys.readouterr().out
    assert "nan" in out and "2.5000" in out


def test_a_run_that_ended_on_a_non_finite_loss_still_gets_its_summary_and_plot(tmp_path, capsys):
    from rich.console import Console

    from mnft.run import logs

    logs.plot([{"step": 1, "loss": 5.0, "tokens_per_s": 100.0}, {"step": 2, "loss": "nan", "tokens_per_s": 90.0}], tmp_path / "loss.png", "R1")
    assert (tmp_path / "loss.png").stat().st_size > 0
    record = SimpleNamespace(path=tmp_path, data={"recipe": "lora"})
    logs.print_summary({"run_id": "R1", "state": "failed", "hosts": {}, "last_step": 2, "last_loss": "nan"}, record, Console(file=None))
    assert "last step 2: loss nan" in capsys.readouterr().out


def test_a_detached_run_is_not_written_back_as_ended_while_a_host_was_not_heard_from(tmp_path, monkeypatch):
    from mnft.run import records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R2", state="running", hosts={"a": {"node_rank": 0}, "b": {"node_rank": 1}})
    control.write_back(record, {"a": {"state": "exited", "exit_code": 0}})  # b's logs could not be collected
    assert records.load("R2").data["state"] == "running"
    control.write_back(record, {"a": {"state": "exited", "exit_code": 0}, "b": {"state": "exited", "exit_code": 0}})
    assert records.load("R2").data["state"] == "succeeded"


def test_logs_of_a_script_without_metrics_say_so_and_how_to_set_a_source(tmp_path, monkeypatch, capsys):
    from rich.console import Console

    from mnft.run import logs, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R4", state="succeeded", job={"entry": ["train.py"]}, hosts={"a": {"node_rank": 0}},
                                   inventory={"hosts": [{"slots": 1}]})
    (record.path / "a" / "run").mkdir(parents=True)
    (record.path / "a" / "run" / "output.log").write_text("[rank0]:epoch 1 done\n")
    (record.path / "a" / "run" / "exit_code").write_text("0\n")
    logs.merged_tail(record, 5, Console(file=None, width=300))
    out = capsys.readouterr().out
    assert "no metrics found for train.py (format auto, in rank 0's output): set the job file's metrics" in out
    assert not (record.path / "loss.png").exists()


def test_logs_of_an_hf_script_plot_its_dict_lines_when_no_trainer_state_was_collected(tmp_path, monkeypatch):
    from mnft.run import logs, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R5", state="succeeded", job={"entry": ["run_clm.py"], "metrics": {"format": "hf"}},
                                   hosts={"a": {"node_rank": 0}, "b": {"node_rank": 1}}, inventory={"hosts": [{"slots": 1}, {"slots": 1}]})
    for name, rank in (("a", 0), ("b", 1)):
        (record.path / name / "run").mkdir(parents=True)
        (record.path / name / "run" / "output.log").write_text(
            f"[rank{rank}]: 10%|#         | 1/10[rank{rank}]:{{'loss': '{3.0 + rank}', 'epoch': '0.1'}}\n"
            f"[rank{rank}]:{{'loss': '{2.0 + rank}', 'epoch': '0.2'}}\n")
    metrics = logs.run_metrics(record)
    steps, source = metrics.steps, metrics.source
    assert [(s["index"], s["loss"]) for s in steps] == [(1, 3.0), (2, 2.0)] and source == "a: rank 0's output"
    summary = logs.summarize(record)
    assert (summary["initial_loss"], summary["final_loss"], summary["last_step"]) == (3.0, 2.0, 2)


def test_a_long_last_line_keeps_its_end_cut_at_a_word_boundary_and_marked():
    """Issue 36: `status` cut its last-line column 60 characters from the end, mid-word ("ng_rate=2e-05 …")."""
    from mnft.core.output import clip_end

    line = "{'loss': 1.2345, 'grad_norm': 0.51, 'learning_rate': 2e-05, 'epoch': 0.37, 'step': 120}"
    cut = clip_end(line, 60)
    assert cut == "…0.51, 'learning_rate': 2e-05, 'epoch': 0.37, 'step': 120}"
    assert len(cut) <= 60 and cut.endswith("'step': 120}")
    assert clip_end("short line", 60) == "short line"
    assert clip_end("x" * 100, 60) == "…" + "x" * 59  # no word to cut at: cut where it must, still marked


def test_an_hf_scripts_closing_summary_is_not_read_as_one_more_step(tmp_path, monkeypatch):
    """Issue 45: a run_clm-like script prints train()'s closing dict and then log_metrics' block (`train_loss = …`,
    the run's mean loss); summary.json said final loss 4.7523 over 31 points where rank 0 printed 30 steps."""
    from mnft.run import logs, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R6", state="succeeded", job={"entry": ["run_clm.py"]}, hosts={"a": {"node_rank": 0}},
                                      inventory={"hosts": [{"slots": 1}]})
    (record.path / "a" / "run").mkdir(parents=True)
    steps = [f"[rank0]:{{'loss': '{5.0 - i * 0.0215:.4g}', 'learning_rate': '4e-05', 'epoch': '{(i + 1) / 81:.4g}'}}" for i in range(30)]
    closing = ["[rank0]:{'train_runtime': '0.85', 'train_samples_per_second': '2053', 'train_steps_per_second': '35.29', 'train_loss': '4.752', 'epoch': '0.3704'}",
               "[rank0]:***** train metrics *****", "[rank0]:  epoch                    =     0.3704",
               "[rank0]:  train_loss               =     4.7523", "[rank0]:  train_runtime            = 0:00:00.85"]
    (record.path / "a" / "run" / "output.log").write_text("\n".join(steps + closing) + "\n")
    (record.path / "a" / "run" / "exit_code").write_text("0\n")
    summary = logs.summarize(record)
    assert (summary["logged_points"], summary["final_loss"]) == (30, 4.377)
    assert summary["job_summary"]["train_loss"] == 4.752  # the run's mean stays the job's summary, not a step


def test_a_detached_run_mnft_stop_ended_is_stopped_in_status_its_record_and_its_logs(tmp_path, monkeypatch, capsys):
    """Issue 45: `mnft status` of a stopped detached run said `exited 1 … got signal: 15`. Its hosts marked it
    (stopped_by, before the first signal): status, the record written back and the collected logs say stopped."""
    from mnft.run import logs, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R7", state="running", job={"entry": ["train.py"]}, hosts={"a": {"node_rank": 0}, "b": {"node_rank": 1}},
                                      inventory={"hosts": [{"slots": 1}, {"slots": 1}]})
    states = {name: {"state": "stopped", "exit_code": 1, "stopped_by": "mnft stop", "processes": 0,
                     "last_line": "stopped by `mnft stop` (its shutdown is in the host's output.log)"} for name in ("a", "b")}
    assert print_status(record, states, as_json=False) == 0
    out = capsys.readouterr().out
    assert "stopped" in out and "exited" not in out and "got signal" not in out
    control.write_back(record, states)
    assert (records.load("R7").data["state"], records.load("R7").data["reason"]) == ("stopped", "stopped by `mnft stop`")
    assert records.load("R7").data["hosts"]["a"]["state"] == "stopped"
    for name in ("a", "b"):  # what `logs` collects of each host's run directory
        (record.path / name / "run").mkdir(parents=True)
        (record.path / name / "run" / "exit_code").write_text("1\n")
        (record.path / name / "run" / "stopped_by").write_text("mnft stop\n")
    assert logs.collected_states(record)["a"] == {"state": "stopped", "exit_code": 1, "ended": None, "stopped_by": "mnft stop"}
