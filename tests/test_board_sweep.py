"""The board's sweep view (issue 43): a sweep is one entry of the runs list with its points under it, and has a page
of its own: every point's curve of the sweep's metric on one chart (one series per point, named by its values), the
table `status SWEEP` prints (mnft.run.sweep.point_row), and the best point by the sweep's metric and goal marked in
both. The records are written as the sweep's supervisor (mnft.run.sweeper) and each point's train leave them: the
sweep's own runs/<SWEEP>/run.json of kind sweep, each point an ordinary run runs/<SWEEP>-NN/ naming its sweep.
In Debian's chromium too (Playwright, as tests/test_board.py drives it)."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest
from boardfakes import open_page, HOSTILE, Served, inventory, lab_views, write_run

from mnft.board import runs as runs_of
from mnft.board.state import Board
from mnft.run.job import Job

REPO = Path(__file__).resolve().parent.parent
SWEEP = "20261129-100000-5eep"
NAMES = ["h1", "h2"]
CONTROLS = "form, button, input, select, textarea, [contenteditable], [onclick], [formaction]"

# The sweep `--sweep lr=1e-4,3e-4 --sweep seed=1,2,3`: six points, each one's curve of loss over its steps.
P1 = [(s, round(2.0 - 0.06 * s, 4)) for s in range(1, 21)]  # succeeded: down to 0.80 at its last step
P2 = [(s, round(1.5 - 0.06 * s, 4)) for s in range(1, 19)] + [(19, 0.44), (20, 0.45)]  # succeeded: 0.42 at step 18, the best
P3 = [(s, round(2.2 - 0.1 * s, 4)) for s in range(1, 8)]  # failed at step 7
P4 = [(s, round(1.6 - 0.05 * s, 4)) for s in range(1, 11)]  # still running: its supervisor's live step records
VALUES = [{"lr": lr, "seed": seed} for seed in ("1", "2", "3") for lr in ("1e-4", "3e-4")]


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("MNFT_RUNS_DIR", str(root))
    return root


def write_point(root: Path, sweep_id: str, index: int, values: dict, state: str, curve: list[tuple[int, float]], *, host: str,
                created: float, reason: str | None = None, metric: str = "loss", extra: dict | None = None) -> Path:
    """A point as its train leaves it: an ordinary run record naming its sweep (`sweep`: id, index, values) and its
    devices; its step records in metrics.jsonl once it ended, in live-metrics.jsonl while it runs."""
    run_id = f"{sweep_id}-{index:02d}"
    path = write_run(root, run_id, hosts=[host], state=state, steps=0, created=created, reason=reason)
    data = json.loads((path / "run.json").read_text())
    going = state == "running"
    data.update(sweep={"id": sweep_id, "index": index, "values": values}, devices={host: [index % 4]},
                ended=None if going else created + 100.0, time=None if going else data["time"])
    (path / "run.json").write_text(json.dumps(data))
    records = [{"attempt": 1, "t": created + 10 + s, "step": s, metric: v, "tokens_per_s": 1000.0, **((extra or {}).get(s) or {})} for s, v in curve]
    (path / ("live-metrics.jsonl" if going else "metrics.jsonl")).write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_sweep(root: Path, sweep_id: str, points: list[dict], *, metric: str = "loss", goal: str = "min", state: str = "running",
                created: float, name: str | None = None) -> Path:
    """The sweep's own record, as its supervisor keeps it: kind sweep, its keys, metric, goal and points (each point's
    state as the supervisor last saw it)."""
    path = root / sweep_id
    path.mkdir()
    job = Job(entry=("train.py",), extra_args=("--lr", "{lr}", "--seed", "{seed}"), name=name)
    data = {"run_id": sweep_id, "created": created, "state": state, "reason": None, "job": job.to_record(), "kind": "sweep",
            "supervisor": {"host": "h1", "pid": 4321, "alive": True, "since": created},
            "sweep": {"keys": list(points[0]["values"]), "metric": metric, "goal": goal, "max_parallel": 2, "after": None, "points": points}}
    (path / "run.json").write_text(json.dumps(data))
    return path


def six_points(root: Path, sweep_id: str = SWEEP, created: float | None = None) -> Path:
    """The sweep above: two points succeeded, one failed, one running, two pending (no record of their own yet)."""
    created = created or time.time() - 600
    write_point(root, sweep_id, 1, VALUES[0], "succeeded", P1, host="h1", created=created + 1)
    write_point(root, sweep_id, 2, VALUES[1], "succeeded", P2, host="h2", created=created + 2)
    write_point(root, sweep_id, 3, VALUES[2], "failed", P3, host="h1", created=created + 150, reason="h1: rank 0 ran out of GPU memory")
    write_point(root, sweep_id, 4, VALUES[3], "running", P4, host="h2", created=created + 160)
    seen = ["succeeded", "succeeded", "failed", "starting", "pending", "pending"]  # the supervisor's last look: point 4 was starting
    points = [{"index": n, "values": VALUES[n - 1], "run_id": f"{sweep_id}-{n:02d}", "state": seen[n - 1], "host": ("h1", "h2")[(n - 1) % 2] if n < 5 else None,
               "ended": created + 100.0 if n < 4 else None} for n in range(1, 7)]
    return write_sweep(root, sweep_id, points, created=created)


def no_hosts(record) -> dict:
    """The hosts of a point going on, as the poller asks them (mnft.run.control.status): none answers here."""
    return {}


def get(served: Served, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    conn.request(method, path)
    answer = conn.getresponse()
    body = answer.read()
    conn.close()
    return answer.status, body


# ------------------------------------------------------------------------------------------------ the JSON


def test_a_sweeps_page_is_its_points_table_in_point_order_with_the_best_point_by_its_metric(runs_dir):
    path = six_points(runs_dir)
    page = runs_of.detail(SWEEP, path)
    assert (page["kind"], page["id"], page["state"], page["metric"], page["goal"], page["keys"]) == ("sweep", SWEEP, "running", "loss", "min", ["lr", "seed"])
    assert page["summary"] == "6 point(s): 2 succeeded, 2 pending, 1 failed, 1 running"
    rows = page["rows"]
    assert [(r["index"], r["run_id"], r["label"], r["state"], r["where"], r["step"], r["last"], r["best"]) for r in rows] == [
        (1, f"{SWEEP}-01", "lr=1e-4 seed=1", "succeeded", "h1: GPU 1", 20, 0.8, 0.8),
        (2, f"{SWEEP}-02", "lr=3e-4 seed=1", "succeeded", "h2: GPU 2", 20, 0.45, 0.42),
        (3, f"{SWEEP}-03", "lr=1e-4 seed=2", "failed", "h1: GPU 3", 7, 1.5, 1.5),
        (4, f"{SWEEP}-04", "lr=3e-4 seed=2", "running", "h2: GPU 0", 10, 1.1, 1.1),  # its own record's state, not the supervisor's last look
        (5, f"{SWEEP}-05", "lr=1e-4 seed=3", "pending", "", None, None, None),
        (6, f"{SWEEP}-06", "lr=3e-4 seed=3", "pending", "", None, None, None)]
    assert rows[0]["values"] == {"lr": "1e-4", "seed": "1"} and rows[0]["seconds"] == 100.0 and rows[4]["seconds"] is None
    assert rows[2]["reason"] == "h1: rank 0 ran out of GPU memory" and rows[0]["reason"] is None
    assert [r["recorded"] for r in rows] == [True, True, True, True, False, False]  # a pending point has no page of its own yet
    assert [r["best_point"] for r in rows] == [False, True, False, False, False, False]
    assert page["best"] == {"index": 2, "run_id": f"{SWEEP}-02", "label": "lr=3e-4 seed=1", "value": 0.42, "step": 18}
    assert page["point_ids"] == [f"{SWEEP}-{n:02d}" for n in range(1, 7)] and page["hosts"] == ["h1", "h2"]


def test_each_points_curve_is_the_sweeps_metric_over_its_steps_one_series_per_point_that_logged_it(runs_dir):
    page = runs_of.detail(SWEEP, six_points(runs_dir))
    curves = page["curves"]
    assert (curves["metric"], curves["goal"], curves["points"]) == ("loss", "min", len(P1) + len(P2) + len(P3) + len(P4))
    assert [(c["index"], c["label"], list(zip(c["x"], c["y"]))) for c in curves["series"]] == [
        (1, "lr=1e-4 seed=1", P1), (2, "lr=3e-4 seed=1", P2), (3, "lr=1e-4 seed=2", P3), (4, "lr=3e-4 seed=2", P4)]
    assert [c["best_step"] for c in curves["series"]] == [20, 18, 7, 10]


def test_a_sweep_to_maximise_another_metric_marks_the_highest_and_draws_only_the_steps_that_logged_it(runs_dir):
    created = time.time() - 600
    evals = {10: {"eval_acc": 0.61}, 20: {"eval_acc": 0.70}}
    better = {10: {"eval_acc": 0.66}, 20: {"eval_acc": 0.64}}
    write_point(runs_dir, "S2", 1, {"lr": "1e-4"}, "succeeded", P1, host="h1", created=created, extra=evals)
    write_point(runs_dir, "S2", 2, {"lr": "3e-4"}, "succeeded", P2, host="h2", created=created, extra=better)
    points = [{"index": n, "values": {"lr": lr}, "run_id": f"S2-{n:02d}", "state": "succeeded"} for n, lr in ((1, "1e-4"), (2, "3e-4"))]
    page = runs_of.detail("S2", write_sweep(runs_dir, "S2", points, metric="eval_acc", goal="max", state="succeeded", created=created))
    assert [(r["step"], r["last"], r["best"], r["best_point"]) for r in page["rows"]] == [(20, 0.70, 0.70, True), (20, 0.64, 0.66, False)]
    assert page["best"] == {"index": 1, "run_id": "S2-01", "label": "lr=1e-4", "value": 0.70, "step": 20}
    assert [(c["x"], c["y"]) for c in page["curves"]["series"]] == [([10, 20], [0.61, 0.70]), ([10, 20], [0.66, 0.64])]


def test_a_points_row_read_from_the_few_step_records_the_board_keeps_is_point_rows_over_all_of_them():
    """The board keeps of each point's step records only what its row needs (runs.metric_digest, read again only when
    the point's files change): the row is the one mnft.run.sweep.point_row makes of every record."""
    import random

    from mnft.run import sweep as sweeping

    rng = random.Random(7)
    point = {"index": 1, "values": {"lr": "1"}, "run_id": "S-01", "state": "running"}
    for case in range(200):
        pairs = [(rng.choice([s, s, s, None]), rng.choice([None, round(rng.random(), 1)])) for s in range(rng.randrange(0, 12))]
        for goal in ("min", "max"):
            every = sweeping.point_row(point, None, [{"step": s, "m": v} for s, v in pairs], "m", goal, 0.0)
            kept = sweeping.point_row(point, None, [{"step": s, "m": v} for s, v in runs_of.metric_digest(pairs, goal)["essential"]], "m", goal, 0.0)
            assert kept == every, (case, goal, pairs)


def test_a_record_under_a_points_name_that_names_another_sweep_is_not_read_as_that_point(runs_dir):
    created = time.time() - 600
    write_point(runs_dir, "S3", 1, {"lr": "1e-4"}, "succeeded", P1, host="h1", created=created)
    stranger = write_point(runs_dir, "S3", 2, {"lr": "3e-4"}, "succeeded", [(1, 0.001)], host="h2", created=created)
    data = json.loads((stranger / "run.json").read_text())
    (stranger / "run.json").write_text(json.dumps(dict(data, sweep={"id": "ANOTHER", "index": 2, "values": {}})))
    points = [{"index": 1, "values": {"lr": "1e-4"}, "run_id": "S3-01", "state": "succeeded"},
              {"index": 2, "values": {"lr": "3e-4"}, "run_id": "S3-02", "state": "pending"},
              {"index": 3, "values": {"lr": "1e-3"}, "run_id": "../../etc", "state": "pending"}]  # never a path
    page = runs_of.detail("S3", write_sweep(runs_dir, "S3", points, created=created))
    assert [(r["run_id"], r["state"], r["recorded"], r["best"]) for r in page["rows"]] == [
        ("S3-01", "succeeded", True, 0.8), ("S3-02", "pending", False, None), (None, "pending", False, None)]
    assert page["best"]["run_id"] == "S3-01" and [c["run_id"] for c in page["curves"]["series"]] == ["S3-01"]


def test_the_runs_list_shows_a_sweep_as_one_entry_with_its_points_under_it(tmp_path, runs_dir):
    six_points(runs_dir)
    write_run(runs_dir, "20261129-090000-a1a1", hosts=["h1"], steps=10)  # a run of its own
    write_point(runs_dir, "GONE", 1, {"lr": "1"}, "succeeded", P1, host="h1", created=time.time() - 60)  # its sweep's record is not here
    board = Board(inventory(tmp_path / "lab.yaml", 2), look=lambda: lab_views(NAMES), status=no_hosts)
    board.round()
    rows = [r for r in json.loads(board.runs.text)["runs"] if r["mine"]]  # (the lab's runs of other controllers aside)
    assert sorted(r["id"] for r in rows) == sorted([SWEEP, "20261129-090000-a1a1", "GONE-01"])  # not six points beside their sweep
    sweep = next(r for r in rows if r["id"] == SWEEP)
    assert (sweep["kind"], sweep["state"], sweep["summary"]) == ("sweep", "running", "6 point(s): 2 succeeded, 2 pending, 1 failed, 1 running")
    assert sweep["best"] == {"index": 2, "run_id": f"{SWEEP}-02", "label": "lr=3e-4 seed=1", "value": 0.42, "step": 18}
    assert [(p["id"], p["state"], p["sweep"]) for p in sweep["points"]] == [
        (f"{SWEEP}-0{n}", state, {"id": SWEEP, "index": n, "label": f"lr={VALUES[n - 1]['lr']} seed={VALUES[n - 1]['seed']}"})
        for n, state in ((1, "succeeded"), (2, "succeeded"), (3, "failed"), (4, "running"))]  # the points with a record, in point order
    assert next(r for r in rows if r["id"] == "GONE-01")["sweep"] == {"id": "GONE", "index": 1, "label": "lr=1"}
    assert next(r for r in rows if r["id"] == "20261129-090000-a1a1")["sweep"] is None
    board.close()


def test_a_sweeps_row_and_page_follow_a_point_that_goes_on(tmp_path, runs_dir):
    six_points(runs_dir)
    board = Board(inventory(tmp_path / "lab.yaml", 2), look=lambda: lab_views(NAMES), status=no_hosts)
    board.round()
    page = board.detail(SWEEP)
    version = page.version
    assert json.loads(page.text)["rows"][3]["step"] == 10
    with open(runs_dir / f"{SWEEP}-04" / "live-metrics.jsonl", "a") as out:  # point 4's supervisor receives step 11: below every other
        out.write(json.dumps({"attempt": 1, "t": time.time(), "step": 11, "loss": 0.3}) + "\n")
    page = board.detail(SWEEP)
    assert page.version > version
    now = json.loads(page.text)
    assert now["rows"][3]["step"] == 11 and now["best"]["run_id"] == f"{SWEEP}-04" and now["curves"]["series"][3]["x"][-1] == 11
    board.round()
    assert next(r for r in json.loads(board.runs.text)["runs"] if r["id"] == SWEEP)["best"]["value"] == 0.3
    board.close()


def test_the_api_answers_a_sweeps_page_and_row_as_its_json_read_only(tmp_path, runs_dir):
    path = six_points(runs_dir)
    with Served(Board(inventory(tmp_path / "lab.yaml", 2), look=lambda: lab_views(NAMES), status=no_hosts, every=0.5)) as served:
        status, body = get(served, f"/api/runs/{SWEEP}")
        page = json.loads(body)
        assert status == 200 and page["kind"] == "sweep"
        assert page["rows"] == json.loads(json.dumps(runs_of.detail(SWEEP, path)["rows"]))
        assert page["best"]["run_id"] == f"{SWEEP}-02" and len(page["curves"]["series"]) == 4
        status, body = get(served, "/api/runs")
        assert status == 200 and [r["kind"] for r in json.loads(body)["runs"] if r["id"] == SWEEP] == ["sweep"]
        for method in ("POST", "PUT", "DELETE"):
            assert get(served, f"/api/runs/{SWEEP}", method)[0] == 405


# ------------------------------------------------------------------------------------------------ the page


@pytest.fixture
def sweep_page(tmp_path, runs_dir, chromium):
    six_points(runs_dir)
    write_run(runs_dir, "20261129-090000-a1a1", hosts=["h1"], steps=30)
    evil = [{"index": 1, "values": {"lr": HOSTILE}, "run_id": "20991231-000000-evil-01", "state": "pending"}]
    write_sweep(runs_dir, "20991231-000000-evil", evil, created=time.time() - 60, name=HOSTILE)
    with Served(Board(inventory(tmp_path / "lab.yaml", 2), look=lambda: lab_views(NAMES), status=no_hosts, every=0.5)) as served:
        with open_page(chromium, served, 900) as page:
            yield page


def test_the_sweep_page_draws_every_points_curve_the_table_and_marks_the_best_point(sweep_page):
    page = sweep_page
    page.goto(page.served.url + f"#/sweep/{SWEEP}")
    page.wait_for_selector('#chart[data-series="4"] canvas', timeout=30000)
    assert page.get_attribute("#chart", "data-points") == str(len(P1) + len(P2) + len(P3) + len(P4))
    assert page.get_attribute("#chart", "data-best") == f"{SWEEP}-02"
    legend = page.eval_on_selector_all("#chart .u-legend .u-series .u-label", "ls => ls.map(l => l.textContent)")
    assert legend == ["step", "#1 lr=1e-4 seed=1", "★ #2 lr=3e-4 seed=1", "#3 lr=1e-4 seed=2", "#4 lr=3e-4 seed=2"]
    rows = page.query_selector_all(".sweep-table tbody tr")
    cells = [[td.inner_text() for td in row.query_selector_all("td")] for row in rows]
    assert [c[:5] for c in cells] == [
        ["#1", f"{SWEEP}-01", "1e-4", "1", "succeeded"], ["★ #2", f"{SWEEP}-02", "3e-4", "1", "succeeded"],
        ["#3", f"{SWEEP}-03", "1e-4", "2", "failed"], ["#4", f"{SWEEP}-04", "3e-4", "2", "running"],
        ["#5", f"{SWEEP}-05", "1e-4", "3", "pending"], ["#6", f"{SWEEP}-06", "3e-4", "3", "pending"]]
    assert [c[5:9] for c in cells[:4]] == [["h1: GPU 1", "20", "0.8000", "0.8000"], ["h2: GPU 2", "20", "0.4500", "0.4200"],
                                           ["h1: GPU 3", "7", "1.5000", "1.5000"], ["h2: GPU 0", "10", "1.1000", "1.1000"]]
    assert cells[2][-1] == "h1: rank 0 ran out of GPU memory"
    best = page.query_selector_all(".sweep-table tr[data-best]")
    assert len(best) == 1 and best[0].get_attribute("data-run") == f"{SWEEP}-02" and best[0].get_attribute("class") == "best"
    assert best[0].evaluate("tr => getComputedStyle(tr.cells[0]).fontWeight") in ("700", "bold")
    assert "★ best: point 2 (lr=3e-4 seed=1), " + f"{SWEEP}-02: loss 0.4200 at step 18" in page.inner_text(".best-line")
    assert page.inner_text("#run-head .sweep-summary") == "6 point(s): 2 succeeded, 2 pending, 1 failed, 1 running"
    links = page.eval_on_selector_all(".sweep-table a", "as => as.map(a => a.getAttribute('href'))")
    assert links == [f"#/run/{SWEEP}-0{n}" for n in range(1, 5)]  # each point with a record of its own: its run page
    assert page.query_selector_all(CONTROLS) == []
    page.screenshot(path=str(REPO / "docs" / "board-sweep.png"), full_page=True)  # for docs/board.md
    page.click(f'.sweep-table a[href="#/run/{SWEEP}-02"]')
    page.wait_for_selector('#run[data-kind="run"] #chart[data-points="20"]', timeout=30000)
    assert "point 2 (lr=3e-4 seed=1) of sweep " + SWEEP in page.inner_text("#run-head .meta")
    assert page.problems == []


def test_the_runs_list_shows_the_sweep_once_its_points_under_it_and_leads_to_its_page(sweep_page):
    page = sweep_page
    row = page.wait_for_selector(f'#runs-body tr[data-run="{SWEEP}"][data-kind="sweep"]', timeout=30000)
    assert "6 point(s): 2 succeeded, 2 pending, 1 failed, 1 running · best lr=3e-4 seed=1 (loss 0.4200)" in row.inner_text()
    chips = page.eval_on_selector_all(f'tr.sweep-points[data-sweep="{SWEEP}"] a.chip', "as => as.map(a => [a.textContent, a.dataset.best || ''])")
    assert chips == [["#1 lr=1e-4 seed=1", ""], ["★ #2 lr=3e-4 seed=1", "1"], ["#3 lr=1e-4 seed=2", ""], ["#4 lr=3e-4 seed=2", ""]]
    assert page.query_selector(f'#runs-body > tr[data-run="{SWEEP}-01"]') is None  # its points are not rows of their own
    assert page.query_selector('#runs-body > tr[data-run="20261129-090000-a1a1"]') is not None
    page.click(f'#runs-body tr[data-run="{SWEEP}"] td.id a')
    page.wait_for_selector('#chart[data-series="4"]', timeout=30000)
    assert page.evaluate("location.hash") == f"#/sweep/{SWEEP}" and page.evaluate("document.title").startswith("sweep ")
    assert page.problems == []


def test_hostile_text_in_a_sweeps_record_is_shown_as_text(sweep_page):
    page = sweep_page
    page.goto(page.served.url + "#/sweep/20991231-000000-evil")
    page.wait_for_selector(".sweep-table tbody tr", timeout=30000)
    assert page.inner_text('.sweep-table td[data-key="lr"]') == HOSTILE
    assert page.inner_text("#run-head .job") == HOSTILE
    assert page.get_attribute("#chart", "data-series") == "0" and "no point has logged loss yet" in page.inner_text("#curve-note")
    for selector in ("#run img", "#run script", "#run b b", ".sweep-table b"):
        assert page.query_selector(selector) is None, selector
    assert page.evaluate("window.__pwned") is None
    assert page.problems == []
