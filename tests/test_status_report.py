"""`invoke status`: the row a host gets from its run directory and how the table shows it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from mnft import agent
from mnft.report import print_status


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
    state = agent.status(str(run))
    assert state["state"] == "exited" and state["exit_code"] == 0
    assert state["last_metric"] == {"step": 200, "loss": 1.2032}


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

    from mnft import train

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in [
        {"step": 1, "loss": 5.0, "tokens_per_s": 100.0},
        {"step": 2, "loss": "nan", "tokens_per_s": 90.0},
    ]))
    train.plot(metrics, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").stat().st_size > 0
    record = SimpleNamespace(path=tmp_path)
    train.print_summary({"run_id": "R1", "state": "failed", "hosts": {}, "last_step": 2, "last_loss": "nan"}, record, Console(file=None))
    assert "last step 2: loss nan" in capsys.readouterr().out


def test_a_detached_run_is_not_written_back_as_ended_while_a_host_was_not_heard_from(tmp_path, monkeypatch):
    from mnft import runs, train

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = runs.RunRecord.create("R2", state="running", hosts={"a": {"node_rank": 0}, "b": {"node_rank": 1}})
    train.write_back(record, {"a": {"state": "exited", "exit_code": 0}})  # b's logs could not be collected
    assert runs.load("R2").data["state"] == "running"
    train.write_back(record, {"a": {"state": "exited", "exit_code": 0}, "b": {"state": "exited", "exit_code": 0}})
    assert runs.load("R2").data["state"] == "succeeded"
