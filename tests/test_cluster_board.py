"""Issue 28 on a real simulated cluster: `mnft board` as a person uses it, in Debian's chromium driven by Playwright.

Two hosts h1, h2 with 4 stand-in GPUs each (tests/fakegpu.py); one GPU of h2 is used by a program started by hand
(in use outside mnft). The board is the real command (`invoke board --hosts … --port 0`) over the controller's
runs/, and the runs are real `mnft train` runs of a small script (steps.py: a JSON step record a step, each rank
registered on its GPU) whose job file has a hostile name and whose rank 0 prints a hostile line. What is asserted
is what the page shows, as a person would read it, against what the CLI and the records say.
"""

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
from fakegpu import RANK_SNIPPET

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parent.parent
HOSTILE_JOB = '<img src=x onerror="window.__pwned=1">sft & <b>friends</b>'
HOSTILE_LINE = "<script>window.__pwned = 2</script><i>not italic</i> \x1b[31mred\x1b[0m"
STEPS = RANK_SNIPPET + '''
import json, os, sys, time

steps, pause = int(sys.argv[1]), float(sys.argv[2])
rank = int(os.environ.get("RANK", "0"))
if rank == 0:
    print(HOSTILE, flush=True)
for step in range(1, steps + 1):
    time.sleep(pause)
    if rank == 0:
        print(json.dumps({"step": step, "loss": round(3.0 / (1 + step / 8), 4), "tokens_per_s": 1000.0 + step}), flush=True)
'''.replace("HOSTILE", repr(HOSTILE_LINE))
WRITES = ("POST", "PUT", "DELETE", "PATCH", "OPTIONS")
CONTROLS = "form, button, input, select, textarea, [contenteditable], [onclick], [formaction]"


class Lab:
    """The cluster, the controller's directory (inventory, runs/, home), the lab's tree and the board serving it."""

    def __init__(self, cluster, work: Path) -> None:
        self.cluster, self.work = cluster, work
        self.inventory = str(cluster.write_inventory(work / "lab.yaml", workdir="/root/mnft-board"))
        self.src = work / "src"
        (self.src / "jobs").mkdir(parents=True)
        (self.src / "steps.py").write_text(STEPS)
        (self.src / "jobs" / "steps.yaml").write_text(json.dumps({"name": HOSTILE_JOB, "script": "steps.py"}))
        self.runs = work / "runs"
        self.board = None
        self.url = None

    def env(self) -> dict:
        home = self.work / "home"
        home.mkdir(exist_ok=True)
        return dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(self.runs), PYTHONUNBUFFERED="1")

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "invoke", "-r", str(REPO), *args]

    def mnft(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=self.src, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False)

    def train(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv("train", "--hosts", self.inventory, "--src", str(self.src), "--job", "jobs/steps.yaml", "--gpus", "2", "--", *args),
                                cwd=self.src, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def start_board(self) -> None:
        self.board = subprocess.Popen(self.argv("board", "--hosts", self.inventory, "--port", "0", "--connect-timeout", "3"), cwd=self.work, env=self.env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.board.stdout.readline()
            if not line:
                break
            seen.append(line)
            if found := re.search(r"mnft board: (http://127\.0\.0\.1:(\d+)/)", line):
                self.url, self.port = found.group(1), int(found.group(2))
                return
        raise AssertionError("the board did not start:\n" + "".join(seen))

    def stop_board(self) -> int | None:
        if self.board is None or self.board.poll() is not None:
            return None if self.board is None else self.board.returncode
        self.board.send_signal(signal.SIGINT)
        try:
            return self.board.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.board.kill()
            return None

    def lab_json(self) -> list[dict]:
        done = self.mnft("lab", "--hosts", self.inventory, "--json")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout)["devices"]

    def run_ids(self) -> list[str]:
        return sorted(p.name for p in self.runs.glob("[!.]*") if (p / "run.json").is_file()) if self.runs.is_dir() else []

    def request(self, method: str, path: str, headers: dict | None = None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request(method, path, headers={"Host": f"127.0.0.1:{self.port}", **(headers or {})})
        response = conn.getresponse()
        response.body = response.read() if path != "/api/events" or response.status != 200 else b""
        conn.close()
        return response


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory, chromium):
    work = tmp_path_factory.mktemp("board")
    with testbed.Cluster.create(2, work / "bed", outsider=False, gpus=4) as cluster:
        h2 = cluster.hosts[1]
        by_hand = cluster.popen(h2, ["nvidia-smi", "--fake-use", "3", "--", "sleep", "600"], start_new_session=True)
        the_lab = Lab(cluster, work)
        the_lab.start_board()
        try:
            yield the_lab
        finally:
            code = the_lab.stop_board()
            by_hand.kill()
            by_hand.wait(timeout=10)
            assert code in (0, 130), f"the board ended with {code} on Ctrl-C"


@pytest.fixture
def page(lab, chromium):
    context = chromium.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda exc: page.problems.append(f"page error: {exc}"))
    page.on("console", lambda msg: page.problems.append(f"console {msg.type}: {msg.text}") if msg.type in ("error", "warning") else None)
    page.goto(lab.url)
    page.wait_for_selector("html[data-drawn]", timeout=30000)
    page.evaluate("window.__sameDocument = true")  # gone after any reload
    yield page
    context.close()


def tiles(page) -> dict[tuple[str, str], tuple[str, str, str]]:
    return {(t["host"], t["device"]): (t["state"], t["user"], t["run"]) for t in page.eval_on_selector_all(
        ".tile", "ts => ts.map(t => ({host: t.dataset.host, device: t.dataset.device, state: t.dataset.state, user: t.dataset.user, run: t.dataset.run}))")}


def until(check, timeout: float = 120, every: float = 0.3, what: str = "the page to show it"):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {what}")
        time.sleep(every)


def cell(page, run_id: str, css: str) -> str | None:
    found = page.query_selector(f'#runs-body tr[data-run="{run_id}"] {css}')
    return found.inner_text() if found else None


def finished(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_the_lab_tiles_are_what_mnft_lab_json_says(lab, page):
    expected = lab.lab_json()
    rows = {(r["host"], r["device"]): (r["state"], r["user"] or "", r["run"] or "") for r in expected if not r["device"].startswith("#")}
    assert rows[("h2", "3")][0] == "outside"  # the program started by hand
    until(lambda: tiles(page) == rows, timeout=30, what=f"the tiles to be {rows}")
    outside = page.query_selector('.tile[data-host="h2"][data-device="3"]')
    assert "outside: root" in outside.inner_text() and "97%" in outside.inner_text()
    assert "in use outside mnft" in outside.get_attribute("title") and "memory 1/80 GiB" in page.get_attribute('.tile[data-host="h2"][data-device="3"] .meter.mem', "title")
    answered = page.inner_text('.host[data-host="h1"] .ago')
    assert re.fullmatch(r"answered \d+s ago", answered), answered
    assert page.problems == []


def test_a_run_started_while_the_page_is_open_appears_and_its_step_advances_and_its_curve_has_every_metric(lab, page):
    before = set(lab.run_ids())
    proc = lab.train("60", "0.25")
    try:
        run_id = until(lambda: next(iter(set(lab.run_ids()) - before), None), timeout=60, what="the run's record")
        first = int(until(lambda: (c := cell(page, run_id, ".step")) and c.isdigit() and c, timeout=150, what="its first step in the runs table"))
        later = int(until(lambda: (c := cell(page, run_id, ".step")) and c.isdigit() and int(c) > first and c, timeout=60, what="its step to advance"))
        assert later > first and page.evaluate("window.__sameDocument") is True  # no reload
        assert cell(page, run_id, ".job") == f"{HOSTILE_JOB}: steps.py 60 0.25"  # the job name as text, then what it ran
        held = until(lambda: {k: v for k, v in tiles(page).items() if v[2] == run_id} or None, timeout=30, what="its GPUs held in the lab")
        assert sorted(held) == [("h1", "0"), ("h1", "1"), ("h2", "0"), ("h2", "1")] and {v[:2] for v in held.values()} == {("held", "root")}
        until(lambda: "97%" in page.inner_text('.tile[data-host="h1"][data-device="0"]'), timeout=30, what="its ranks on their GPUs")
        page.set_viewport_size({"width": 1280, "height": 420})
        page.screenshot(path=str(REPO / "docs" / "board.png"), full_page=True)  # for docs/board.md: the lab and a run going on
        page.set_viewport_size({"width": 1440, "height": 900})

        page.click(f'#runs-body tr[data-run="{run_id}"] a')  # its page: a link within the page, not a reload
        page.wait_for_selector("#chart[data-points]")
        drawn = int(page.get_attribute("#chart", "data-points"))
        until(lambda: int(page.get_attribute("#chart", "data-points") or 0) > drawn, timeout=60, what="the live curve to grow")
        logs = until(lambda: page.query_selector('pre.log[data-host="h1"]'), timeout=30, what="h1's last lines")
        until(lambda: "<script>window.__pwned = 2</script><i>not italic</i> red" in logs.inner_text(), timeout=30, what="the hostile line as text")
        assert page.query_selector("pre.log i") is None and page.query_selector("#run script") is None

        code, out = finished(proc)
        assert code == 0, out[-3000:]
        page.wait_for_selector('#run-head .badge[data-state="succeeded"]', timeout=30000)
        metrics = [json.loads(line) for line in (lab.runs / run_id / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "loss" in m and m.get("event") is None]
        assert len(steps) == 60
        # the live curve has the 60 points too: wait for the page to have drawn the collected metrics.jsonl
        until(lambda: page.get_attribute("#chart", "data-points") == str(len(steps)) and "from metrics.jsonl" in page.inner_text("#curve-note"),
              timeout=30, what="the curve from metrics.jsonl")
        assert page.inner_text("#run-head h2").startswith(f"run {run_id}")
        assert HOSTILE_JOB in page.inner_text("#run-head .job") and page.inner_text("#run-head .command") == f"{HOSTILE_JOB}: steps.py 60 0.25"
        assert page.evaluate("window.__pwned") is None and page.evaluate("window.__sameDocument") is True
        assert page.query_selector_all(CONTROLS) == []
        assert "where the time went" in page.inner_text("#run-time").lower()
        page.screenshot(path=str(REPO / "docs" / "board-run.png"), full_page=True)
        page.click("nav.crumbs a")
        page.wait_for_selector(f'#runs-body tr[data-run="{run_id}"] .badge[data-state="succeeded"]')
        assert page.query_selector_all(CONTROLS) == []
        assert page.problems == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            finished(proc, 60)


def test_a_run_killed_on_one_host_shows_failed_with_the_named_cause(lab, page):
    before = set(lab.run_ids())
    proc = lab.train("2000", "0.2")
    try:
        run_id = until(lambda: next(iter(set(lab.run_ids()) - before), None), timeout=60, what="the run's record")
        page.goto(f"{lab.url}#/run/{run_id}")
        page.wait_for_selector('#run-hosts tr[data-host="h2"][data-state="running"]', timeout=150000)
        h2 = lab.cluster.hosts[1]
        worker = until(lambda: next((pid for pid, cmd in lab.cluster.processes(h2) if "steps.py" in cmd and "torch.distributed.run" not in cmd
                                     and "mnft/onhost/agent" not in cmd), None), timeout=30, what="h2's worker")
        os.kill(worker, signal.SIGKILL)  # a process of this test's run, in h2's namespace: its pid is the same here
        code, out = finished(proc)
        assert code == 1, out[-3000:]
        record = json.loads((lab.runs / run_id / "run.json").read_text())
        assert record["state"] == "failed" and record["diagnosis"]["kind"] == "killed", record.get("diagnosis")
        page.wait_for_selector('#run-head .badge[data-state="failed"]', timeout=30000)
        failure = page.wait_for_selector(".failure", timeout=30000)
        text = failure.inner_text()
        assert f"cause: {record['diagnosis']['cause']}" in text and f"fix: {record['diagnosis']['fix']}" in text
        assert "SIGKILL" in record["diagnosis"]["cause"] and "h2" in record["diagnosis"]["cause"]
        page.goto(lab.url)
        page.wait_for_selector(f'#runs-body tr[data-run="{run_id}"] .badge[data-state="failed"]', timeout=30000)
        assert page.problems == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            finished(proc, 60)


def test_nothing_on_the_board_can_change_anything_every_route_refuses_writes(lab, page):
    assert page.query_selector_all(CONTROLS) == []
    run_id = lab.run_ids()[-1] if lab.run_ids() else "20261127-000000-0000"
    for path in ("/", "/api/lab", "/api/runs", f"/api/runs/{run_id}", "/api/events", "/static/board.js", "/nowhere"):
        for method in WRITES:
            answer = lab.request(method, path)
            assert answer.status == 405, (method, path, answer.status)
            assert answer.getheader("allow") == "GET, HEAD" and answer.getheader("access-control-allow-origin") is None


def test_another_origin_or_host_is_refused(lab):
    assert lab.request("GET", "/api/lab").status == 200
    for headers in ({"Host": f"evil.example:{lab.port}"}, {"Host": "evil.example"}, {"Origin": "http://evil.example"},
                    {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}):
        for path in ("/api/lab", "/api/runs", "/api/events"):
            answer = lab.request("GET", path, headers)
            assert answer.status == 403, (headers, path, answer.status)
            assert answer.getheader("access-control-allow-origin") is None
    page = lab.request("GET", "/", {"Host": f"localhost:{lab.port + 1}"})  # an ssh -L with another local port
    assert page.status == 200
    csp = page.getheader("content-security-policy")
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "'unsafe-inline'" not in csp and "frame-ancestors 'none'" in csp


def test_a_host_that_stops_answering_is_shown_so_while_the_others_go_on_and_back_when_it_answers(lab, page):
    h2 = lab.cluster.hosts[1]
    lab.cluster.link_down(h2)
    try:
        card = until(lambda: page.query_selector('.host[data-host="h2"][data-state="slow"]'), timeout=30, what="h2 not answering")
        assert "not answering" in card.inner_text() and page.query_selector('.tile[data-host="h2"]')  # its last answer, dimmed
        for _ in range(3):  # h1 keeps answering every round while h2's question hangs
            time.sleep(2)
            assert re.fullmatch(r"answered [0-4]s ago", page.inner_text('.host[data-host="h1"] .ago')), page.inner_text('.host[data-host="h1"] .ago')
            assert int(re.fullmatch(r"answered (\d+)s ago", page.inner_text('.host[data-host="h2"] .ago')).group(1)) >= 10
    finally:
        lab.cluster.link_up(h2)
    until(lambda: page.query_selector('.host[data-host="h2"][data-state="ok"] .tile[data-device="3"][data-state="outside"]'), timeout=60,
          what="h2 answering again")
    assert page.problems == []
