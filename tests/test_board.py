"""`mnft board` without hosts (issue 28): who may read it, what a run's row and page say, the lab's JSON against
`mnft lab --json`'s rows, and the page in Debian's chromium (Playwright) over a lab and runs made up by
tests/boardfakes.py: hostile text shown as text, no control that acts, the curve, the restarts and lost steps, an
unreachable host. The same board over real hosts and real runs: tests/test_cluster_board.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from boardfakes import open_page, HOSTILE, Served, inventory, lab_views, write_run, write_runs

from mnft.board import runs as runs_of
from mnft.board.app import Origins, split_host
from mnft.board.state import Board
from mnft.hosts.lab import rows

REPO = Path(__file__).resolve().parent.parent
CONTROLS = "form, button, input, select, textarea, [contenteditable], [onclick], [formaction]"
NAMES = ["h1", "h2", "h3", "h4"]


# ------------------------------------------------------------------------------------------------ who may read it


def test_a_host_header_names_the_board_or_is_refused():
    local = Origins.serving("127.0.0.1", 8765)
    assert local.host_ok("127.0.0.1:8765") and local.host_ok("localhost:9000") and local.host_ok("[::1]:8765")  # ssh -L picks its port
    for foreign in ("evil.example:8765", "evil.example", "127.0.0.1.evil.example:8765", "", "a b:1", "localhost:0", "localhost:x",
                    "[::1", "user@localhost:8765", "10.0.0.5:8765"):
        assert not local.host_ok(foreign), foreign
    exposed = Origins(frozenset({"10.0.0.5", "gpu-ctl"}), 8765)
    assert exposed.host_ok("10.0.0.5:8765") and exposed.host_ok("GPU-CTL.:8765") and not exposed.host_ok("10.0.0.5:8766")
    assert not exposed.host_ok("10.0.0.5") and not exposed.host_ok("attacker.example:8765")  # a rebinding name is never ours
    assert split_host("[fe80::1]:80") == ("fe80::1", 80) and split_host("h:65536") is None and split_host("a:b:c") is None


def test_only_get_from_the_board_itself_is_answered():
    origins = Origins.serving("127.0.0.1", 8765)
    own = {"host": "127.0.0.1:8765"}
    assert origins.refuse("GET", "/api/lab", own) is None
    assert origins.refuse("HEAD", "/", own) is None
    assert origins.refuse("GET", "/api/events", {**own, "origin": "http://127.0.0.1:8765", "sec-fetch-site": "same-origin"}) is None
    assert origins.refuse("GET", "/", {**own, "sec-fetch-site": "cross-site"}) is None  # a link to the board from elsewhere opens it
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"):
        assert origins.refuse(method, "/api/lab", own)[0] == 405
    assert origins.refuse("GET", "/api/lab", {"host": "evil.example:8765"})[0] == 403
    assert origins.refuse("GET", "/api/lab", {})[0] == 403
    for headers in ({"origin": "http://evil.example"}, {"origin": "null"}, {"origin": "https://127.0.0.1:8765"},
                    {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-site"}):
        assert origins.refuse("GET", "/api/runs", {**own, **headers})[0] == 403, headers


# ------------------------------------------------------------------------------------------------ the runs


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("MNFT_RUNS_DIR", str(root))
    return root


def test_a_runs_row_and_page_say_what_its_record_and_collected_metrics_say(runs_dir):
    path = write_run(runs_dir, "20261127-100000-aaaa", hosts=["h1", "h2"], state="failed", steps=90, attempts=3, job_name="sft",
                     output=["step 1", "\x1b[1mbold\x1b[0m\tand a bell\x07"])
    row = runs_of.summary("20261127-100000-aaaa", path)
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert (row["state"], row["job"], row["hosts"], row["restarts"], row["goodput"]) == ("failed", "sft", ["h1", "h2"], 2, 0.7)
    assert (row["step"], row["loss"]) == (metrics[-1]["step"], metrics[-1]["loss"])
    page = runs_of.detail("20261127-100000-aaaa", path)
    curve = page["curve"]
    assert curve["source"] == "metrics" and curve["points"] == len(metrics) and curve["x"] == [m["step"] for m in metrics]
    assert curve["attempt"] == [m["attempt"] for m in metrics] and sorted(set(curve["attempt"])) == [1, 2, 3]
    assert curve["restarts"] == [{"step": 30, "label": "attempt 2 (killed)"}, {"step": 60, "label": "attempt 3 (killed)"}]
    assert curve["lost"] == [{"attempt": 1, "from": 30, "to": 35, "steps": 5}, {"attempt": 2, "from": 60, "to": 65, "steps": 5}]
    assert page["failure"]["attempt"] == 1 and page["failure"]["cause"] == "h2: rank 1 was killed by SIGKILL"  # the first one
    assert [a["number"] for a in page["time"]["attempts"]] == [1, 2, 3] and page["time"]["goodput"] == 0.7
    h1 = page["host_states"][0]
    assert h1["lines_from"] == "collected" and h1["lines"] == [[0, "step 1"], [0, "bold\tand a bell?"]]  # colours dropped, a bell as '?'


def test_a_resumed_runs_page_shows_every_run_it_resumed_each_attempt_a_series_and_where_it_resumed(runs_dir):
    first = write_run(runs_dir, "20261127-100000-aaaa", hosts=["h1", "h2"], state="stopped", steps=40, attempts=2)
    second = write_run(runs_dir, "20261127-120000-bbbb", hosts=["h1", "h2"], steps=20)
    record = json.loads((second / "run.json").read_text())
    (second / "run.json").write_text(json.dumps(dict(record, resumed_from="20261127-100000-aaaa")))
    (second / "metrics.jsonl").write_text("".join(json.dumps({"step": 40 + s, "loss": 1.0 - s / 100, "attempt": 1}) + "\n" for s in range(1, 21)))
    page = runs_of.detail("20261127-120000-bbbb", second)
    curve = page["curve"]
    theirs = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert page["resumed_from"] == ["20261127-100000-aaaa"]
    assert curve["x"] == [m["step"] for m in theirs] + list(range(41, 61)) and curve["points"] == len(theirs) + 20
    assert curve["attempt"] == [m["attempt"] for m in theirs] + [3] * 20
    assert curve["labels"] == {"1": "20261127-100000-aaaa attempt 1", "2": "20261127-100000-aaaa attempt 2", "3": "this run"}
    assert {"step": 41, "label": "resumed from 20261127-100000-aaaa"} in curve["restarts"]
    assert {"step": 20, "label": "20261127-100000-aaaa: attempt 2 (killed)"} in curve["restarts"]
    alone = runs_of.detail("20261127-100000-aaaa", first)["curve"]  # the earlier run's own page: itself only
    assert alone["labels"] == {} and alone["points"] == len(theirs)


def test_a_run_going_on_is_read_from_what_its_supervisor_keeps_and_its_hosts_answer(runs_dir):
    path = write_run(runs_dir, "20261127-110000-bbbb", hosts=["h1", "h2"], state="running", steps=0)
    (path / "run.json").write_text(json.dumps(dict(json.loads((path / "run.json").read_text()), time=None, ended=None)))
    now = time.time()
    points = [{"attempt": 1, "t": now - 10 + i, "step": i, "loss": 2.0 - i / 10} for i in range(1, 8)]
    (path / "live-metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    (path / "live.json").write_text(json.dumps({"pid": 1, "updated": now, "attempt": 1, "state": "running", "metric": points[-1]}))
    row = runs_of.summary("20261127-110000-bbbb", path)
    assert row["supervised"] and (row["step"], row["loss"]) == (7, points[-1]["loss"])
    answers = {"h1": {"state": "running", "processes": 2, "last_metric": {"step": 9, "loss": 1.1}, "lines": [[0, "<b>x</b>"]]},
               "h2": {"state": "running", "processes": 2, "last_metric": None, "lines": []}}
    page = runs_of.detail("20261127-110000-bbbb", path, answers, now)
    assert page["step"] == 9 and page["curve"]["source"] == "live" and page["curve"]["x"] == list(range(1, 8))
    assert page["time"]["attempts"][0]["steps_s"] == pytest.approx(6.0)  # measured by mnft.run.goodput from the arrivals
    assert page["host_states"][0]["lines"] == [[0, "<b>x</b>"]] and page["host_states"][0]["lines_from"] == "host"
    (path / "live.json").write_text(json.dumps({"pid": 1, "updated": now - 3600}))  # its supervisor is gone
    assert not runs_of.summary("20261127-110000-bbbb", path)["supervised"]


def test_a_damaged_record_is_a_row_that_says_so(runs_dir):
    (runs_dir / "20261127-120000-cccc").mkdir()
    (runs_dir / "20261127-120000-cccc" / "run.json").write_text("{not json")
    row = runs_of.summary("20261127-120000-cccc", runs_dir / "20261127-120000-cccc")
    assert row["state"] == "unreadable" and "unreadable run record" in row["reason"]


def test_other_controllers_runs_are_read_from_the_lab_and_this_controllers_own_are_not_repeated():
    rows_json = [{"host": "h1", "device": "0", "state": "held", "user": "alice", "run": "R1", "command": "train", "since": 100.0},
                 {"host": "h2", "device": "0", "state": "held", "user": "alice", "run": "R1", "command": "train", "since": 90.0},
                 {"host": "h1", "device": "1", "state": "held", "user": "root", "run": "MINE-a2", "command": "train", "since": 50.0},
                 {"host": "h2", "device": "#1", "state": "waiting", "user": "bob", "run": "R2", "command": "train", "since": 120.0}]
    theirs = runs_of.others(rows_json, {"MINE"})
    assert [(r["id"], r["user"], r["state"], r["hosts"], r["created"]) for r in theirs] == [
        ("R1", "alice", "running", ["h1", "h2"], 90.0), ("R2", "bob", "waiting", ["h2"], 120.0)]
    assert theirs[0]["devices"] == {"h1": ["0"], "h2": ["0"]}


def test_the_lab_json_holds_mnft_lab_jsons_rows(tmp_path, runs_dir):
    inv = inventory(tmp_path / "lab.yaml", 4)
    views = lab_views(NAMES, down=("h3",))
    board = Board(inv, look=lambda: views)
    board.round()
    lab = json.loads(board.lab.text)
    expected = [r.to_json() for r in rows(inv, views)]
    assert [{k: d[k] for k in expected[0]} for d in lab["devices"]] == json.loads(json.dumps(expected))
    h3 = next(h for h in lab["hosts"] if h["name"] == "h3")
    assert h3["state"] == "unreachable" and h3["answered"] is None and "Unable to connect" in h3["error"]
    assert all(h["answered"] for h in lab["hosts"] if h["name"] != "h3")
    board.close()


# ------------------------------------------------------------------------------------------------ the page


def hostile_views() -> dict[str, dict]:
    """A lab whose lease files say hostile things (anyone may write them): markup in the user, run, command."""
    views = lab_views(NAMES, down=("h3",))
    device = views["h1"]["devices"][0]
    device.update(state="held", holder={"command": HOSTILE[:20], "run_id": "<b>run</b>", "user": HOSTILE, "login": "<i>eve</i>",
                                        "controller": "ctl", "pid": 1, "taken": time.time() - 60}, lockers=[])
    return views


@pytest.fixture
def board_page(tmp_path, runs_dir, chromium):
    inv = inventory(tmp_path / "lab.yaml", 4)
    write_runs(runs_dir, 12, NAMES)
    write_run(runs_dir, "20991231-000000-evil", hosts=["h1", "<script>h2</script>"], state="failed", job_name=HOSTILE, attempts=2, steps=40,
              reason=HOSTILE, output=[HOSTILE, "\x1b]0;title\x07\x1b[2Jcleared?", "\u202ereversed"],
              diagnosis={"kind": "failed", "cause": HOSTILE, "fix": "<a href='javascript:alert(1)'>fix</a>"})
    views = hostile_views()
    with Served(Board(inv, look=lambda: views, every=0.5)) as served:
        with open_page(chromium, served, 768) as page:
            yield page


def test_hostile_text_in_the_lab_and_a_run_is_shown_as_text_and_never_runs(board_page):
    page = board_page
    tile = page.wait_for_selector('.tile[data-host="h1"][data-device="0"]')
    assert page.get_attribute('.tile[data-host="h1"][data-device="0"]', "data-run") == "<b>run</b>"
    assert "<i>eve</i> · 1m" in tile.inner_text() and "run <b>run</b>" in tile.get_attribute("title")
    assert tile.query_selector("i, b b, .who b") is None
    page.goto(page.served.url + "#/run/20991231-000000-evil")
    page.wait_for_selector("#chart[data-points]")
    page.wait_for_selector(".failure")
    assert page.inner_text("#run-head .job") == HOSTILE
    assert page.inner_text(".failure .cause") == "cause: <script>h2</script>: rank 1 was killed by SIGKILL"  # attempt 1's, the first
    assert page.inner_text(".failure .reason") == HOSTILE
    assert page.query_selector('#run-hosts tr[data-host="<script>h2</script>"]') is not None
    log = page.inner_text('pre.log[data-host="h1"]')
    assert HOSTILE in log and "?]0;title?cleared?" in log and "?reversed" in log  # escapes and bidi controls as '?'
    for selector in ("#run img", "#run script", "#run b b", ".failure a", "pre.log i, .failure i, #run-head i", "#hosts img", "#hosts script", "#hosts i", ".tile .who b"):
        assert page.query_selector(selector) is None, selector
    assert page.evaluate("window.__pwned") is None
    assert page.problems == []


def test_the_page_has_no_control_that_acts(board_page):
    page = board_page
    assert page.query_selector_all(CONTROLS) == []
    links = page.eval_on_selector_all("a[href]", "as => as.map(a => a.getAttribute('href'))")
    assert links and all(href.startswith("#/") for href in links)  # only ways around the page itself
    page.goto(page.served.url + "#/run/20991231-000000-evil")
    page.wait_for_selector("#chart[data-points]")
    assert page.query_selector_all(CONTROLS) == []
    assert all(h.startswith("#/") for h in page.eval_on_selector_all("a[href]", "as => as.map(a => a.getAttribute('href'))"))


def test_a_restarted_runs_curve_marks_its_attempts_restarts_and_lost_steps(board_page, runs_dir):
    page = board_page
    page.goto(page.served.url + "#/run/20991231-000000-evil")
    page.wait_for_selector("#chart[data-points]")
    metrics = (runs_dir / "20991231-000000-evil" / "metrics.jsonl").read_text().splitlines()
    assert page.get_attribute("#chart", "data-points") == str(len(metrics)) and page.get_attribute("#chart", "data-attempts") == "2"
    assert page.inner_text("#curve-marks") .split("\n") == ["attempt 2 (killed) resumed at step 20", "attempt 1: steps 21–25 lost (trained again)"]
    assert page.query_selector("#chart canvas") is not None
    time_bar = page.eval_on_selector_all(".timebar .seg", "ss => ss.map(s => s.dataset.part)")
    assert {"launch_s", "kept_s", "checkpoint_s", "lost_s", "detection_s", "restart_s"} <= set(time_bar)


def test_a_resumed_runs_page_draws_the_runs_it_resumed_each_under_its_own_name(board_page, runs_dir):
    page = board_page
    write_run(runs_dir, "20991230-100000-aaaa", hosts=["h1"], state="stopped", steps=40, attempts=2)
    later = write_run(runs_dir, "20991230-120000-bbbb", hosts=["h1"], steps=20)
    (later / "run.json").write_text(json.dumps(dict(json.loads((later / "run.json").read_text()), resumed_from="20991230-100000-aaaa")))
    (later / "metrics.jsonl").write_text("".join(json.dumps({"step": 40 + s, "loss": 1.0 - s / 100, "attempt": 1}) + "\n" for s in range(1, 21)))
    page.goto(page.served.url + "#/run/20991230-120000-bbbb")
    page.wait_for_selector('#chart[data-attempts="3"]', timeout=30000)
    legend = page.inner_text("#chart .u-legend")
    assert "20991230-100000-aaaa attempt 1" in legend and "20991230-100000-aaaa attempt 2" in legend and "this run" in legend
    assert "resumed from 20991230-100000-aaaa" in page.inner_text("#curve-marks")


def test_an_unreachable_host_is_shown_as_such_with_its_last_answer(board_page):
    card = board_page.wait_for_selector('.host[data-host="h3"][data-state="unreachable"]')
    text = card.inner_text()
    assert "unreachable" in text and "answered never" in text and "Unable to connect" in text
    assert re.search(r"answered \d+s ago", board_page.inner_text('.host[data-host="h1"]'))


def test_requests_of_another_page_are_refused_in_the_browser(board_page):
    """A page of another origin (here: about:blank, Origin null) cannot read the board, nor follow its events; even an
    opaque answer is withheld (Cross-Origin-Resource-Policy: same-origin)."""
    page = board_page
    other = page.context.new_page()
    result = other.evaluate("""async (url) => {
        const out = {};
        try { const r = await fetch(url + 'api/lab'); out.fetch = r.status; } catch (e) { out.fetch = 'blocked'; }
        try { const r = await fetch(url + 'api/lab', {mode: 'no-cors'}); out.opaque = r.type; } catch (e) { out.opaque = 'blocked'; }
        out.events = await new Promise((done) => { const es = new EventSource(url + 'api/events');
            es.onmessage = () => done('read'); es.addEventListener('lab', () => done('read')); es.onerror = () => { es.close(); done('refused'); };
            setTimeout(() => done('timeout'), 5000); });
        return out; }""", page.served.url)
    assert result == {"fetch": "blocked", "opaque": "blocked", "events": "refused"}, result


# ------------------------------------------------------------------------------------------------ the command


def test_the_board_command_listens_on_loopback_warns_when_exposed_and_ends_on_ctrl_c(tmp_path):
    env = dict(os.environ, MNFT_RUNS_DIR=str(tmp_path / "runs"), HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(REPO), "board", "--listen", "0.0.0.0", "--port", "0"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        while not (found := re.search(r"mnft board: http://127\.0\.0\.1:(\d+)/", seen)):
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        assert "warning: the board listens on 0.0.0.0: anyone who can reach" in " ".join(seen.split())
        port = int(found.group(1))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/runs")
        answer = conn.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["runs"] == []
        conn.close()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130) and "Traceback" not in out, out


def test_ctrl_c_with_a_page_open_and_a_host_that_hangs_ends_the_board_without_a_traceback(tmp_path, hanging_host, chromium):
    """Issue 36: each open page's event stream went on through the shutdown until uvicorn cancelled it after its grace
    period ("Exception in ASGI application", a CancelledError traceback per page), and the exit waited for the
    question out to a host that accepts TCP and never speaks SSH (two connect timeouts). Now the streams end as the
    shutdown begins and the question is abandoned. (How long it takes: bench/board_exit.py, docs/board.md.)"""
    env = dict(os.environ, MNFT_RUNS_DIR=str(tmp_path / "runs"), HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    lab_yaml = hanging_host.inventory(tmp_path / "lab.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(REPO), "board", "--hosts", str(lab_yaml), "--port", "0",
                             "--connect-timeout", "120"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    context = chromium.new_context()
    try:
        seen = ""
        while not (found := re.search(r"mnft board: (http://127\.0\.0\.1:\d+/)", seen)):
            line = proc.stdout.readline()
            assert line, seen
            seen += line
        page = context.new_page()
        page.goto(found.group(1))
        page.wait_for_selector('.host[data-host="wedged"]', timeout=30000)
        deadline = time.monotonic() + 30
        while not hanging_host.accepted and time.monotonic() < deadline:  # the poller's question is out
            time.sleep(0.05)
        assert hanging_host.accepted
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)  # generous: it waited 120 s or 240 s for the host before
        finally:
            proc.kill()
            context.close()
    out = seen + out
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "Exception in ASGI application" not in out and "CancelledError" not in out, out


# ------------------------------------------------------------------------------------------------ the poller


def test_one_poller_asks_the_hosts_for_every_page_open_never_a_request(tmp_path, runs_dir):
    inv = inventory(tmp_path / "lab.yaml", 4)
    views = lab_views(NAMES)
    asked = []
    with Served(Board(inv, look=lambda: asked.append(time.monotonic()) or views, every=0.5)) as served:
        streams = []
        for _ in range(4):  # four pages open at once
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
            conn.request("GET", "/api/events")
            answer = conn.getresponse()
            assert answer.status == 200 and answer.getheader("content-type").startswith("text/event-stream")
            assert answer.readline() == b"retry: 2000\n" and answer.readline() == b"\n"
            assert answer.readline() == b"event: lab\n" and json.loads(answer.readline()[len(b"data: "):])["devices"]
            streams.append((conn, answer))
        for _ in range(20):
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
            conn.request("GET", "/api/lab")
            assert conn.getresponse().status == 200
            conn.close()
        count = len(asked)
        time.sleep(2.0)
        during = len(asked) - count
        assert 1 <= during <= 6, during  # every 0.5 s, whatever the pages and requests: not per page, not per request
        for conn, _ in streams:
            conn.close()


def test_a_host_that_never_answered_is_shown_not_answering_once_it_is_slow(tmp_path, hanging_host, monkeypatch):
    """A host that hangs (accepts TCP, never speaks SSH) and never answered was "asking" until its question ended:
    not answering, like a host whose last answer is old, once it is slower than `slow`."""
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.inventory import load

    monkeypatch.setenv("HOME", str(tmp_path))
    inv = load(str(hanging_host.inventory(tmp_path / "lab.yaml")))
    board = Board(inv, timeouts=Timeouts(connect=60, command=60), every=0.2, slow=0.5).start()
    try:
        deadline = time.monotonic() + 30
        while (host := json.loads(board.lab.text)["hosts"][0])["state"] == "asking" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        board.close()
    assert hanging_host.accepted and host["state"] == "slow" and host["answered"] is None, host


def test_a_detached_run_is_asked_of_its_hosts_and_a_watched_one_too_and_another_controllers_run_has_a_page(tmp_path, runs_dir):
    inv = inventory(tmp_path / "lab.yaml", 4)
    views = lab_views(NAMES)
    detached = write_run(runs_dir, "20261127-130000-dddd", hosts=["h1"], state="running", steps=0)
    write_run(runs_dir, "20261127-130100-eeee", hosts=["h2"], state="succeeded", steps=10)
    asked = []

    def status(record):
        asked.append(record.run_id)
        return {"h1": {"state": "running", "processes": 2, "last_metric": {"step": 42, "loss": 0.5, "tokens_per_s": 900.0}, "lines": [[0, "hello"]]}}

    board = Board(inv, look=lambda: views, status=status)
    board.round()
    assert asked == ["20261127-130000-dddd"]  # the run going on that no supervisor follows; not the finished one
    row = next(r for r in json.loads(board.runs.text)["runs"] if r["id"] == "20261127-130000-dddd")
    assert (row["state"], row["step"], row["loss"], row["tokens_per_s"]) == ("running", 42, 0.5, 900.0)
    page = json.loads(board.detail("20261127-130000-dddd").text)
    assert page["host_states"][0]["lines"] == [[0, "hello"]] and page["host_states"][0]["lines_from"] == "host" and page["asked"]
    theirs = next(r for r in json.loads(board.runs.text)["runs"] if not r["mine"])
    other = json.loads(board.detail(theirs["id"]).text)
    assert other["mine"] is False and other["user"] == theirs["user"] and other["leases"]
    assert {(lease["host"], lease["state"]) for lease in other["leases"]} <= {(h, "held") for h in NAMES} | {(h, "waiting") for h in NAMES}
    assert json.loads(board.detail("20261127-999999-none").text)["missing"] is True
    (detached / "run.json").write_text(json.dumps(dict(json.loads((detached / "run.json").read_text()), state="succeeded")))
    board.round()  # asked once more (it was going when the round began), then read as ended
    board.round()
    assert asked == ["20261127-130000-dddd"] * 2  # an ended run's hosts are not asked again
    board.close()


# ------------------------------------------------------------------------------------------------ issue 36


ARGS = ("--steps", "8", "--save-every", "1", "--out", "ckpts", "--note", "two words", "--lr", "0.0001", "--warmup", "100",
        "--batch-size", "64", "--gradient-accumulation-steps", "4")


def write_script_run(runs_dir: Path, run_id: str) -> Path:
    """A script run with arguments whose time mnft could not split (no step record read) and 8 checkpoints saved."""
    from mnft.run import goodput
    from mnft.run.job import Job, ResumeRule

    path = write_run(runs_dir, run_id, hosts=["h1"], state="succeeded", steps=0)
    data = json.loads((path / "run.json").read_text())
    data["job"] = Job(("steps.py",), args=ARGS[:2], extra_args=ARGS[2:], resume=ResumeRule("glob", "ckpts", "ckpt_*", "DONE")).to_record()
    attempts = [{"number": 1, "started": data["created"] + 1, "ended": data["created"] + 60, "state": "succeeded"}]
    data.update(attempts=attempts, ended=data["created"] + 60,
                time=goodput.measure(data["created"], data["created"] + 60, attempts, {}, saved_at=[data["created"] + 5 * i for i in range(1, 9)]).to_json())
    (path / "run.json").write_text(json.dumps(data))
    return path


def test_a_runs_command_its_save_count_and_an_unsplit_time_reach_its_row_and_page(runs_dir):
    """Issue 36: the job column said `steps.py` (its arguments never shown); the time panel lacked the terminal's
    "not known" caption and the checkpoints count."""
    path = write_script_run(runs_dir, "20261127-120000-cccc")
    row = runs_of.summary("20261127-120000-cccc", path)
    whole = "steps.py --steps 8 --save-every 1 --out ckpts --note 'two words' --lr 0.0001 --warmup 100 --batch-size 64 --gradient-accumulation-steps 4"
    assert row["command"] == whole
    short = row["command_short"]
    assert short.startswith("steps.py --steps 8 --save-every 1") and short.endswith(" …") and len(short) <= runs_of.COMMAND_WIDTH
    assert whole.startswith(short[:-2])  # cut after a whole argument
    page = runs_of.detail("20261127-120000-cccc", path)
    assert page["time"]["unknown"].startswith("no step record was read from the job's output: where the time went is not known")
    assert page["time"]["attempts"][0]["saved"] == "(8)"
    assert runs_of.command_line(["recipe", "lora", "max_steps=6"], 10) == "recipe lora …"  # the entry point stays whole
    assert runs_of.command_line(["-m", "pkg.train", "--x", "1"], 80) == "-m pkg.train --x 1"


def test_the_page_shows_the_command_the_save_count_and_why_the_time_is_not_split(board_page, runs_dir):
    page = board_page
    write_script_run(runs_dir, "20991231-000001-cmdl")
    cell = page.wait_for_selector('tr[data-run="20991231-000001-cmdl"] td.job', timeout=30000)
    assert cell.inner_text().startswith("steps.py --steps 8 --save-every 1") and cell.inner_text().endswith("…")
    assert cell.get_attribute("title").endswith("--gradient-accumulation-steps 4")  # whole on hover
    page.goto(page.served.url + "#/run/20991231-000001-cmdl")
    page.wait_for_selector("#run-time table")
    assert page.inner_text("#run-head .command").endswith("--batch-size 64 --gradient-accumulation-steps 4")
    assert page.inner_text('#run-time td[data-key="checkpoint_s"]') == "- (8)"
    assert page.inner_text("#run-time .time-unknown").startswith("no step record was read from the job's output: where the time went is not known")
    assert page.problems == []


# ------------------------------------------------------------------------------------------------ sessions, collisions, usage (issue 38)


def sessions_views(now: float) -> dict[str, dict]:
    """h1: GPU 0 a session of alice's running jupyter, idle 40 minutes; GPU 1 a run of bob's that carol also computes on."""
    views = lab_views(["h1"], gpus=2, now=now)
    session, run = views["h1"]["devices"]
    session.update(state="held", holder={"command": "shell", "session": "jupyter lab --no-browser", "run_id": "20261128-100200-5e55",
                                         "user": "alice", "login": "alice", "controller": "ctl", "pid": 1, "taken": now - 3600,
                                         "idle_since": now - 2400}, lockers=["alice pid 300"], processes=[])
    run.update(state="held", holder={"command": "train", "run_id": "20261128-090000-b0b0", "user": "bob", "login": "bob", "controller": "ctl",
                                     "pid": 2, "taken": now - 7200}, lockers=["bob pid 400"],
               collisions=[{"pid": 4242, "user": "carol", "used_mib": 900}])
    views["h1"]["now"] = now
    return views


def usage_lines(now: float) -> dict[str, dict]:
    return {"h1": {"lines": [{"login": "alice", "run_id": "S1", "command": "shell", "devices": [0], "start": now - 7200, "end": now - 3600, "idle_s": 900},
                             {"login": "bob", "run_id": "R1", "command": "train", "devices": [0, 1], "start": now - 3600 * 5, "end": now - 3600 * 4,
                              "idle_s": 0}]},
            "h2": {"error": "Unable to connect to port 22", "status": "unreachable"}}


def test_the_boards_usage_is_what_mnft_lab_usage_sums_and_is_read_again_only_when_due(tmp_path, runs_dir):
    from mnft.hosts import usage as usage_logs

    now = time.time()
    inv = inventory(tmp_path / "lab.yaml", 2)
    asked = []
    board = Board(inv, look=lambda: sessions_views(now), usage=lambda start: asked.append(start) or usage_lines(now), usage_every=3600)
    board.round()
    board._usage_out.result(timeout=30)
    board.round()  # not due again: the logs are not read again
    board._usage_out.result(timeout=30)
    got = json.loads(board.usage.text)
    assert len(asked) == 1 and abs(asked[0] - (now - 7 * 86400)) < 60
    expected = usage_logs.summarise({"h1": usage_lines(now)["h1"]["lines"]}, asked[0])
    assert {k: got[k] for k in ("users", "hosts", "longest_waits")} == json.loads(json.dumps({k: expected[k] for k in ("users", "hosts", "longest_waits")}))
    assert [(u["user"], u["gpu_hours"]) for u in got["users"]] == [("bob", 2.0), ("alice", 1.0)]
    assert got["errors"] == {"h2": "Unable to connect to port 22"} and got["days"] == 7
    lab = {(d["host"], d["device"]): d for d in json.loads(board.lab.text)["devices"]}
    assert lab["h1", "1"]["also"] == "also used by carol pid 4242" and lab["h1", "0"]["command"] == "shell: jupyter lab --no-browser"
    board.close()


def test_the_page_shows_a_session_as_such_a_collision_and_the_last_weeks_usage(tmp_path, runs_dir, chromium):
    now = time.time()
    inv = inventory(tmp_path / "lab.yaml", 2)
    with Served(Board(inv, look=lambda: sessions_views(now), usage=lambda start: usage_lines(now), every=0.5)) as served:
        context = chromium.new_context(viewport={"width": 1366, "height": 768})
        page = context.new_page()
        problems = []
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.goto(served.url)
        page.wait_for_selector("html[data-drawn]", timeout=30000)
        session = page.wait_for_selector('.tile[data-host="h1"][data-device="0"][data-session="1"]').inner_text()
        since = time.strftime("%H:%M", time.localtime(now - 3600))
        assert f"shell by alice since {since}" in session and "jupyter lab" in session and "idle 40m" in session, session
        crowded = page.wait_for_selector('.tile[data-host="h1"][data-device="1"][data-collision="1"]').inner_text()
        assert "also used by carol pid 4242" in crowded
        line = page.wait_for_selector('#collisions li[data-device="1"]').inner_text()
        assert line == "h1 GPU 1: held by bob's run 20261128-090000-b0b0; also used by carol pid 4242"
        page.wait_for_selector('#usage-body tr[data-user="bob"]')
        assert [r.inner_text().split("\t") for r in page.query_selector_all("#usage-body tr")] == [["bob", "2.00", "0%", "1"], ["alice", "1.00", "25%", "1"]]
        assert "not counted: h2" in page.inner_text("#usage-summary")
        assert problems == []
        context.close()


def test_the_legend_names_drained_and_unhealthy_gpus_and_their_tiles_say_why_and_what_is_reserved(tmp_path, runs_dir, chromium):
    """Issue 45: the board had no legend colour or reason for `drained`; a free GPU kept for the line says so."""
    now = time.time()
    views = lab_views(["h1"], gpus=3, now=now)
    drained, broken, free = views["h1"]["devices"]
    drained.update(state="drained", drain={"login": "root", "at": now - 600, "reason": "fan noise"}, holder=None, lockers=[], processes=[])
    broken.update(state="unhealthy", broken="fallen off the bus", holder=None, lockers=[], processes=[])
    free.update(state="free", holder=None, lockers=[], processes=[])
    views["h1"]["line"] = [{"command": "train", "run_id": "R9", "user": "alice", "login": "alice", "want": 2, "queued": now - 60}]
    views["h1"]["now"] = now
    inv = inventory(tmp_path / "lab.yaml", 1)
    with Served(Board(inv, look=lambda: views, usage=lambda start: {}, every=0.5)) as served:
        context = chromium.new_context(viewport={"width": 1366, "height": 768})
        page = context.new_page()
        page.goto(served.url)
        page.wait_for_selector("html[data-drawn]", timeout=30000)
        legend = page.inner_text("#legend")
        assert "drained by an admin" in legend and "unhealthy (never leased)" in legend
        assert "fan noise" in page.wait_for_selector('.tile[data-device="0"][data-state="drained"]').inner_text()
        assert "fallen off the bus" in page.wait_for_selector('.tile[data-device="1"][data-state="unhealthy"]').inner_text()
        kept = page.wait_for_selector('.tile[data-device="2"][data-state="free"]').inner_text()
        assert "reserved for the line: alice's train R9 waits for 2 GPU(s)" in kept, kept
        context.close()
