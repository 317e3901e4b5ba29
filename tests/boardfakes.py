"""A lab and its runs made up for `mnft board` without hosts: lab views as mnft.onhost.leasehost's `lab` answers them,
run directories as `mnft train` and `mnft logs` leave them (run.json, summary.json, metrics.jsonl, a host's
collected output.log), and a board served from a thread. Used by tests/test_board.py and bench/board.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mnft.run.job import Job

CHROMIUM = "/usr/bin/chromium"  # Debian's (apt-get install chromium); Playwright drives it, its own download is never used
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"><b>bold</b>'


def require_browser() -> None:
    """Playwright and Debian's chromium, or a skip saying which is missing (a failure under MNFT_REQUIRE_CLUSTER=1:
    CI installs both)."""
    why = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "playwright is not installed (pip install playwright; its own browser download is not needed)"
    if why is None and not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        why = "Debian's chromium is not installed (apt-get install chromium)"
    if why:
        if os.environ.get("MNFT_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"{why}, although MNFT_REQUIRE_CLUSTER=1")
        pytest.skip(why)


def inventory(path: Path, hosts: int, names: list[str] | None = None):
    """An inventory of `hosts` hosts nobody connects to (the board's look is faked)."""
    from mnft.hosts.inventory import load

    names = names or [f"h{i}" for i in range(1, hosts + 1)]
    path.write_text("hosts:\n" + "".join(f"  {n}: {{address: 10.77.{i // 250}.{i % 250 + 1}}}\n" for i, n in enumerate(names)))
    return load(str(path))


def lab_views(names: list[str], gpus: int = 4, seed: int = 3, now: float | None = None, down: tuple[str, ...] = ()) -> dict[str, dict]:
    """host -> its lab view: a mix of free, held (by a few users' runs, as /proc/locks proves) and outside devices,
    a line of waiting runs on some hosts; hosts in `down` did not answer."""
    rng = random.Random(seed)
    now = now or time.time()
    users = ("alice", "bob", "carol", "dave")
    views = {}
    for k, name in enumerate(names):
        if name in down:
            views[name] = {"error": "SSH error: NoValidConnectionsError: Unable to connect to port 22", "status": "unreachable"}
            continue
        devices = []
        for index in range(gpus):
            device = {"index": index, "uuid": f"GPU-{k}-{index}", "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
                      "memory_used_mib": 0, "utilization": 0, "processes": []}
            roll = rng.random()
            if roll < 0.5:
                user = users[(k + index // 2) % len(users)]
                run = f"20261127-{10 + k % 12:02d}{index // 2:02d}00-{k:04x}"
                device.update(state="held", memory_used_mib=rng.randrange(1000, 80000), utilization=rng.randrange(40, 100),
                              holder={"command": "train", "run_id": run, "user": user, "login": user, "controller": "ctl", "pid": 4000 + k,
                                      "started": now - rng.randrange(60, 30000), "taken": now - rng.randrange(60, 30000)},
                              lockers=[f"{user} pid {5000 + k}"])
            elif roll < 0.58:
                device.update(state="outside", memory_used_mib=900, utilization=97,
                              processes=[{"pid": 4242 + k, "user": "erin", "used_mib": 900}])
            else:
                device.update(state="free")
            devices.append(device)
        line = []
        if k % 9 == 4:
            line.append({"user": "frank", "login": "frank", "run_id": f"20261127-120000-{k:04x}", "command": "train", "queued": now - 90, "want": 2})
        views[name] = {"host": name, "now": now, "held": False, "holder": None, "devices": devices, "workdirs": [], "line": line}
    return views


def write_run(root: Path, run_id: str, *, hosts: list[str], state: str = "succeeded", job_name: str | None = None, steps: int = 60,
              created: float | None = None, attempts: int = 1, diagnosis: dict | None = None, output: list[str] | None = None,
              reason: str | None = None, hosts_extra: dict | None = None) -> Path:
    """A run directory as `train` and `logs` leave it: run.json (with its attempts and where the time went),
    summary.json, metrics.jsonl (`steps` records over `attempts` attempts) and, given `output`, rank 0's collected
    output.log on the first host."""
    created = created or time.time() - 3600
    path = root / run_id
    path.mkdir(parents=True)
    job = Job(entry=("train.py",), name=job_name)
    per = max(1, steps // attempts)
    entries, kept = [], []
    for a in range(1, attempts + 1):
        resumed = (a - 1) * per if a > 1 else None  # each later attempt resumes from the checkpoint at the previous one's end
        first, last = (resumed or 0) + 1, a * per + 5 if a < attempts else steps  # a failed attempt trained 5 steps past it
        entry = {"number": a, "hosts": hosts, "started": created + 10 + (a - 1) * 100, "ended": created + 90 + (a - 1) * 100,
                 "state": "succeeded" if a == attempts and state == "succeeded" else "failed", "resumed_step": resumed,
                 "steps": [first, last], "steps_lost": 5 if a < attempts else 0}
        if a < attempts:
            entry["cause"] = {"kind": "killed", "detail": f"{hosts[-1]}: a worker was killed (SIGKILL)"}
            entry["diagnosis"] = {"kind": "killed", "cause": f"{hosts[-1]}: rank 1 was killed by SIGKILL", "fix": "see what killed it (dmesg)"}
        entries.append(entry)
        kept += [{"step": s, "loss": round(3.0 / (1 + s / 20) + 0.01 * (s % 3), 4), "tokens_per_s": 1200.0 + s, "attempt": a}
                 for s in range(first, min(last, a * per) + 1 if a < attempts else last + 1)]
    if diagnosis and entries:
        entries[-1]["diagnosis"] = diagnosis
    spent = {"wall_s": 100.0 * attempts, "kept_s": 70.0 * attempts, "goodput": 0.7, "steps_lost": 5 * (attempts - 1),
             "attempts": [{"number": e["number"], "state": e["state"], "launch_s": 12.0, "steps_s": 75.0, "checkpoint_s": 3.0,
                           "lost_s": 2.0 if e["number"] < attempts else None, "steps_lost": e["steps_lost"], "detection_s": 4.0 if e["state"] == "failed" else None,
                           "finish_s": 3.0 if e["state"] == "succeeded" else None, "restart_s": 6.0 if e["number"] < attempts else None,
                           "kept_s": 70.0} for e in entries]}
    data = {"run_id": run_id, "job_id": run_id, "created": created, "job": job.to_record(), "recipe": None, "overrides": [],
            "inventory": {"path": None, "format": "mnft", "master": hosts[0], "known_hosts": None, "rendezvous_port": 29500,
                          "hosts": [{"name": h, "address": "10.0.0.1", "slots": 2} for h in hosts]},
            "hosts": {h: {"node_rank": i, "state": "exited", "exit_code": 0 if state == "succeeded" else (0 if i == 0 else -9),
                          "run_dir": f"/root/mnft/runs/{run_id}/{h}", **((hosts_extra or {}).get(h) or {})} for i, h in enumerate(hosts)},
            "state": state, "reason": reason or ("every host finished" if state == "succeeded" else f"{hosts[-1]}: killed"),
            "launched": True, "attempts": entries, "attempt": attempts, "detach": False, "ended": created + 100 * attempts,
            "time": spent, "diagnosis": diagnosis, "devices": {h: [0, 1] for h in hosts}}
    (path / "run.json").write_text(json.dumps(data, indent=2))
    if kept:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        (path / "summary.json").write_text(json.dumps({"run_id": run_id, "state": state, "last_step": kept[-1]["step"], "last_loss": kept[-1]["loss"],
                                                       "final_loss": kept[-1]["loss"], "tokens_per_s": kept[-1]["tokens_per_s"], "time": spent}))
    if output is not None:
        log = path / hosts[0] / "run" / "output.log"
        log.parent.mkdir(parents=True)
        log.write_text("".join(f"[default0]:{line}\n" for line in output))
    return path


def write_runs(root: Path, count: int, hosts: list[str], seed: int = 5) -> list[str]:
    """`count` runs of a busy lab: most succeeded, some failed with a diagnosis, some restarted."""
    rng = random.Random(seed)
    ids = []
    start = time.time() - count * 600
    for i in range(count):
        run_id = time.strftime("%Y%m%d-%H%M%S", time.localtime(start + i * 600)) + f"-{i:04x}"
        chosen = rng.sample(hosts, k=min(len(hosts), rng.choice((1, 2, 2, 4, 8))))
        failed = i % 7 == 3
        write_run(root, run_id, hosts=chosen, state="failed" if failed else "succeeded", job_name=f"sft-{rng.choice(('llama', 'qwen', 'gr00t'))}-{i}",
                  steps=rng.randrange(20, 400), created=start + i * 600, attempts=2 if i % 11 == 5 else 1,
                  diagnosis={"kind": "cuda-oom", "cause": f"{chosen[-1]}: rank 3 ran out of GPU memory", "fix": "a smaller batch"} if failed else None)
        ids.append(run_id)
    return ids


class Served:
    """A board (mnft.board.state.Board over a faked look) served by uvicorn from a thread on 127.0.0.1."""

    def __init__(self, board, origins=None) -> None:
        from mnft.board.app import Origins, bind, create_app, server

        self.board = board
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.server = server(create_app(board, origins or Origins.serving("127.0.0.1", self.port)), board.stop)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Served":
        self.board.start()
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.board.close()
        self.sock.close()


@contextmanager
def open_page(chromium, served: "Served", height: int):
    """The board's page in chromium, drawn, with what the browser reported as a problem in `page.problems`."""
    context = chromium.new_context(viewport={"width": 1366, "height": height})
    page = context.new_page()
    page.problems = []
    page.on("pageerror", lambda exc: page.problems.append(f"page error: {exc}"))
    page.on("console", lambda msg: page.problems.append(f"console {msg.type}: {msg.text}") if msg.type in ("error", "warning") else None)
    page.served = served
    page.goto(served.url)
    page.wait_for_selector("html[data-drawn]", timeout=30000)
    try:
        yield page
    finally:
        context.close()
