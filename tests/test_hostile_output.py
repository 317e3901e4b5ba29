"""Whatever a user's script prints, the supervisor keeps supervising: every line goes through the metrics
parsers, the live display, the status reader and the step timeline without an exception, at a bounded cost.
(Issue 19, class 5: one line with a step of 1e999 used to crash the supervisor and leave run.json `running`.)"""

from __future__ import annotations

import math
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from mnft.run import scrape, timeline
from mnft.run.progress import Display, progress_text

FORMATS = ("auto", "hf", "torchtune", "sana", "jsonl", "mnft")

NASTY = [
    '{"step": 1e999, "loss": 1.0}',  # the step that crashed the supervisor
    '{"step": -1, "loss": 1}', '{"step": 99999999999999999999999, "loss": 1}', '{"step": "7", "loss": "x"}',
    "{'loss': 1e999, 'epoch': 1e999}", "{'loss': nan, 'epoch': -inf}", "{'loss': '4.7', 'epoch': '1e308'}",
    "{'loss': " + "[" * 5000 + "]" * 5000 + "}",  # nesting deep enough to break a recursive parser
    "{'loss': " + "9" * 5000 + "}",  # an integer of thousands of digits
    "Step 1e999 | loss:1e999 lr:nan", "Step 99999999999999999999999999 | loss:1", "1|99999999999999999999|Loss: 1",
    "Epoch: 0 | Global Step: 999999999999999999999999 | loss:1",
    "\x00\x1b[31m{'loss': 1}\x1b[0m\ufffd\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
    "\r" * 10000 + "{'loss': 1.0}", " 50%|##| 99999999999999999999/1 [", "",
]


def ok_record(found):
    if found is None:
        return True
    step = found.get("step")
    return step is None or (isinstance(step, int) and 0 <= step < 2**63)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("line", NASTY, ids=range(len(NASTY)))
def test_a_nasty_line_is_a_record_or_nothing_never_an_exception(fmt, line):
    found = scrape.LineParser(fmt)(line)
    assert ok_record(found)
    display = Display(Console(file=open("/dev/null", "w")), 8)
    display.metric(found or {"loss": "inf"})
    progress_text(found or {})


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.sampled_from(FORMATS))
def test_any_text_is_a_record_or_nothing(text, fmt):
    assert ok_record(scrape.LineParser(fmt)(text))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["loss", "step", "epoch", "lr", "grad_norm"]),
                       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=8)), max_size=5))
def test_any_dict_a_script_prints_survives_the_display_and_the_timeline(values):
    line = str(values)
    found = scrape.LineParser("hf")(line)
    assert ok_record(found)
    Display(Console(file=open("/dev/null", "w")), 8).metric(found or {})
    records = timeline.derive_steps([found] if found and "loss" in found else [], timeline.Calibration(1e300, 5))
    merged = timeline.merge([timeline.AttemptMetrics(1, records), timeline.AttemptMetrics(2, records, resumed_step=1)])
    assert all(r.get("step") is None or r["step"] >= 0 for r in merged.records)


def test_a_100_mb_line_without_a_newline_costs_little():
    line = "{'loss': " + "1" * (100 * 1024 * 1024) + "}"
    tracemalloc.start()
    t = time.monotonic()
    assert scrape.LineParser("auto")(line) is None  # far longer than any metrics line: not parsed at all
    elapsed, (_, peak) = time.monotonic() - t, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 2.0 and peak < 10 * 1024 * 1024  # generous bounds, not a benchmark


def test_an_epoch_no_training_reaches_gives_no_step():
    assert timeline.Calibration(1e300, 5).step(1e300) is None and timeline.Calibration(10.0, 5).step(math.inf) is None


def test_the_agent_cuts_a_line_without_end_once_and_reads_on_after_it(tmp_path):
    from mnft.onhost.follow import MAX_LINE, _Tail

    out = tmp_path / "output.log"
    out.write_bytes(b"before\n" + b"x" * (10 << 20))  # 10 MB, no newline yet
    tail = _Tail(str(out))
    lines = [line for _ in range(4) for line in tail.lines()]
    assert lines[0] == "before" and len(lines) == 2 and lines[1].startswith("x" * MAX_LINE) and lines[1].endswith("bytes]")
    with out.open("ab") as f:
        f.write(b"the rest of it\nafter\n")
    assert [line for _ in range(2) for line in tail.lines()] == ["after"]
