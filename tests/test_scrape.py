"""Metrics from what training scripts already print or write (formats from research/user_scripts.md)."""

from __future__ import annotations

import json

import pytest

from mnft.core.errors import InputError
from mnft.run import scrape
from mnft.run.scrape import LineParser


def test_hf_trainer_dict_lines():
    parse = LineParser("hf")
    assert parse("{'loss': 2.3145, 'grad_norm': 1.873, 'learning_rate': 4.9e-05, 'epoch': 0.01}") == {
        "loss": 2.3145, "grad_norm": 1.873, "lr": 4.9e-05, "epoch": 0.01, "step": None}
    assert parse("{'loss': nan, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.5}")["loss"] == "nan"
    summary = parse("{'train_runtime': 12.5, 'train_samples_per_second': 40.1, 'train_steps_per_second': 3.2, 'train_loss': 1.9, 'epoch': 1.0}")
    assert summary["event"] == "summary" and summary["train_loss"] == 1.9
    assert parse("{'eval_loss': 1.2}") is None  # an evaluation is not a training step
    assert parse("Some text {'loss': 1}") is None


def test_torchtune_log_file_lines_and_its_progress_bar():
    parse = LineParser("torchtune")
    assert parse("Step 10 | loss:1.2345 lr:2e-05 tokens_per_second_per_gpu:123.4 peak_memory_alloc:3.2") == {
        "loss": 1.2345, "lr": 2e-05, "tokens_per_second_per_gpu": 123.4, "peak_memory_alloc": 3.2, "step": 10}
    assert parse("1|7|Loss: 0.98:  10%|█         | 7/70 [00:03<00:30]") == {"epoch": 1.0, "loss": 0.98, "step": 7}


def test_sana_lines_with_colours_and_a_caption_that_says_loss():
    line = ("\x1b[1m[Sana]\x1b[0m - INFO - Epoch: 0 | Global Step: 50 | Local Step: 50 // 1000, total_eta: 1:00:00, "
            "epoch_eta:0:10:00, time: all:1.2, model:1.0, data:0.1, lm:0.0, vae:0.0, lr:1.0e-04, Cap: a sign reading loss:9.9, "
            "s:(1024, 1024), loss:0.1234, grad_norm:0.5")
    assert LineParser("sana")(line) == {"loss": 0.1234, "lr": 1e-04, "grad_norm": 0.5, "epoch": 0.0, "step": 50}


def test_json_lines_and_a_user_regex():
    assert LineParser("jsonl")(json.dumps({"step": 3, "loss": 1.5, "tokens_per_s": 900})) == {"loss": 1.5, "tokens_per_s": 900.0, "step": 3}
    assert LineParser("jsonl")('{"event": "checkpoint", "step": 3}') is None
    parse = LineParser("regex", r"iter (?P<step>\d+): loss=(?P<loss>\S+) acc=(?P<acc>\S+)")
    assert parse("[train] iter 12: loss=0.5 acc=0.9") == {"loss": 0.5, "acc": 0.9, "step": 12}
    with pytest.raises(InputError, match="named group 'loss'"):
        LineParser("regex", r"iter (?P<step>\d+)")


def test_auto_recognises_every_known_format_and_ignores_the_rest():
    parse = LineParser("auto")
    assert parse("{'loss': 1.0, 'epoch': 0.1}")["loss"] == 1.0
    assert parse("Step 4 | loss:2.0 lr:1e-4")["step"] == 4
    assert parse('{"step": 2, "loss": 3.0}')["step"] == 2
    assert parse("Epoch: 1 | Global Step: 9 | lr:1e-4, loss:0.7, grad_norm:1")["step"] == 9
    for noise in ("Loading checkpoint shards: 100%", "{'a': 1}", "", "Traceback (most recent call last):", "{broken"):
        assert parse(noise) is None


def _corpus():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("metric_lines", Path(__file__).parent / "data" / "metric-lines" / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CORPUS


@pytest.mark.parametrize("source, line, expected", _corpus(), ids=[c[0][:60] for c in _corpus()])
def test_auto_reads_what_real_scripts_print(source, line, expected):
    """Issue 36: a plain `step 21 loss 0.2474` was "no metrics found". The corpus (tests/data/metric-lines/corpus.py)
    is what real scripts print, each line named by the file that prints it; auto reads each as its record, or as
    no record for what is not a training step (an evaluation, a save, torch's warnings)."""
    assert LineParser("auto")(line) == expected, source


def test_a_progress_bar_rewriting_its_line_is_read_by_its_last_piece():
    assert LineParser("torchtune")("1|1|Loss: 3.0\r1|2|Loss: 2.5\r1|3|Loss: 2.0") == {"epoch": 1.0, "loss": 2.0, "step": 3}


def test_trainer_state_log_history_gives_steps(tmp_path):
    state = {"global_step": 20, "log_history": [
        {"epoch": 0.5, "grad_norm": 1.0, "learning_rate": 4e-05, "loss": 2.0, "step": 10},
        {"epoch": 0.5, "eval_loss": 1.9, "step": 10},
        {"epoch": 1.0, "grad_norm": 0.8, "learning_rate": 2e-05, "loss": 1.5, "step": 20},
        {"epoch": 1.0, "step": 20, "train_loss": 1.75, "train_runtime": 3.0},
    ]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state, indent=2))
    assert [(r["step"], r["loss"], r["lr"]) for r in scrape.trainer_state(tmp_path / "trainer_state.json")] == [(10, 2.0, 4e-05), (20, 1.5, 2e-05)]
    assert scrape.trainer_state(tmp_path / "missing.json") == []


def test_tensorboard_event_files_through_the_tensorboard_reader(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs" / "Nov23_host1"))
    for step in (10, 20, 30):
        writer.add_scalar("train/loss", 3.0 - step / 10, step)
        writer.add_scalar("train/learning_rate", 1e-4, step)
        writer.add_scalar("train/grad_norm", 0.5, step)
    writer.close()
    found = scrape.tensorboard(tmp_path / "runs")
    assert [(r["step"], round(r["loss"], 3)) for r in found] == [(10, 2.0), (20, 1.0), (30, 0.0)]
    assert found[0]["lr"] == pytest.approx(1e-4) and found[0]["train/grad_norm"] == 0.5


def test_records_without_a_step_are_numbered_in_order():
    records = [{"loss": 2.0, "step": None}, {"event": "summary", "train_loss": 1}, {"loss": 1.0, "step": None}]
    assert [(r["step"], r.get("index")) for r in scrape.steps_only(records)] == [(None, 1), (None, 2)]
