"""What the board knows now, shared by every page that is open: one poller thread asks the hosts, pages only read.

Each round (every EVERY seconds, or as soon as the previous one is done when asking takes longer) the poller:
- asks the lab, as `mnft lab` does (mnft.hosts.lab.look, then mnft.hosts.lab.rows): every host's devices, free /
  held / in use outside mnft, and the line. Each host on its own connection kept open, and only when its last
  question was answered: a host slow to answer (shown not answering after SLOW seconds, with its last answer if
  it ever answered) or not answering (shown unreachable once its connection attempt ends, asked again on a new
  connection) never holds up the others. The time of each host's last answer is kept;
- reads the hosts' usage logs every USAGE_EVERY seconds, on the side (never waited for), summed as `mnft lab
  --usage` sums them (mnft.hosts.usage): the last week's GPU-hours per user and host and the idle share;
- reads the runs of this controller's runs/ (mnft.board.runs: a run's row is read again only when its files change
  or while it goes on; a sweep's when its record or one of its points' files change, and the rows of its points
  nested under it) and adds the runs of other controllers the lab shows;
- asks the hosts of a run going on, as `mnft status` does (mnft.run.control.status), when its page is open or when
  no supervisor of it is alive here (a detached run: its hosts are the only ones who know its step).
The lab and the runs' questions go out side by side. Each result is kept as the JSON the page receives, with a
version that changes when the JSON does: the event stream of every page sends what changed (mnft.board.app).

`stop` (the server's shutdown begins: Ctrl-C) ends the event streams and the poller's waits at once; the questions
still out to hosts run on daemon threads (mnft.core.threads) and are abandoned: a host that hangs never holds up
the board's exit.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future, wait
from typing import Any, Callable

from mnft.board import runs as runs_of
from mnft.core.errors import MnftError
from mnft.core.threads import DaemonPool
from mnft.hosts import leases
from mnft.hosts.connection import Timeouts
from mnft.hosts.lab import device_count, free_count, rows, since
from mnft.hosts.settings import Inventory
from mnft.run import sweep as sweeps

EVERY = 2.5  # seconds between two rounds of questions to the hosts
SLOW = 10.0  # seconds a host may take to answer before it is shown as not answering (its last answer kept)
SLICE = 0.1  # seconds between two looks at `stop` while the poller waits for answers
USAGE_EVERY = 300.0  # seconds between two readings of the hosts' usage logs (the last week's use changes slowly)
USAGE_DAYS = 7.0  # the board's usage covers the last week, as `mnft lab --usage` does by default
RUN_FLEETS = 8  # runs whose hosts are asked side by side at most
SUPERVISED_EVERY = 10.0  # seconds between two refreshes of a detached run's (or sweep's) records from its supervisor on the lab


def dumps(value: Any) -> str:
    """Compact JSON for the page: no NaN or Infinity (JSON.parse refuses them), every non-ASCII character escaped."""
    return json.dumps(_finite(value), separators=(",", ":"), default=str)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Published:
    """A JSON document and its version (it changes with the text)."""

    def __init__(self) -> None:
        self.version = 0
        self.text = "null"

    def set(self, value: Any) -> bool:
        text = dumps(value)
        if text == self.text:
            return False
        self.text, self.version = text, self.version + 1
        return True


class Board:
    """The lab and the runs, as every open page sees them; `start` the poller, `close` it."""

    def __init__(self, inventory: Inventory, look: Callable[[], dict[str, dict]] | None = None, timeouts: Timeouts | None = None,
                 every: float = EVERY, status: Callable | None = None, slow: float = SLOW,
                 usage: Callable[[float], dict[str, dict]] | None = None, usage_every: float = USAGE_EVERY) -> None:
        self.inventory = inventory
        self.timeouts = timeouts or Timeouts(connect=10.0, command=30.0)
        self.every = every
        self.slow = slow
        self._look = look  # None: the hosts' own answer (mnft.hosts.lab.look over a fleet kept open)
        self._status = status  # None: mnft.run.control.status over the run's own inventory
        self._usage = usage  # None: the hosts' usage logs, as `mnft lab --usage` reads them (mnft.hosts.usage.ask)
        self.usage_every = usage_every
        self._usage_due = 0.0  # monotonic time of the next reading
        self._usage_out: Future | None = None
        self._fleets: dict[str, Any] = {}  # host -> its fleet (one connection, kept open)
        self._asking: dict[str, float] = {}  # host -> when its question went out, until it answers
        self._run_fleets: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.lab = Published()
        self.runs = Published()
        self.usage = Published()  # the last week's GPU-hours per user and host, as `mnft lab --usage` sums them
        self.answered: dict[str, float] = {}  # host -> when it last answered
        self.asked_s: float | None = None
        self.rows: list[dict] = []
        self.views: dict[str, dict] = {}
        self._rows_cache: dict[str, tuple[tuple, dict]] = {}  # run id -> (its files' stamp, its row)
        self._metrics = runs_of.MetricsCache()  # a sweep's points' step records, read again when their files change
        self._sweep_dirs: dict[str, list[Any]] = {}  # sweep id -> its points' directories, for its page's stamp
        self._details: dict[str, tuple[Any, Published]] = {}  # run id -> (what it was read from, its page)
        self.answers: dict[str, tuple[float, dict]] = {}  # run id -> (when, host -> its status answer)
        self.watching: Counter[str] = Counter()  # run id -> pages open on it
        self.rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = DaemonPool(max_workers=RUN_FLEETS + 1, thread_name_prefix="mnft-board")
        self._refreshing: dict[str, Future] = {}  # run id -> its supervisor's records being brought here
        self._refresh_due: dict[str, float] = {}
        self._hosts_pool = DaemonPool(max_workers=max(1, min(64, len(inventory.hosts))), thread_name_prefix="mnft-board-host")
        self._publish_lab(started=True)
        self.refresh_runs()

    # -------------------------------------------------------------------------------------------- the poller

    def start(self) -> "Board":
        self._thread = threading.Thread(target=self._loop, name="mnft-board-poller", daemon=True)
        self._thread.start()
        return self

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """The board is ending: the event streams end, the poller stops waiting for the hosts (what it asked is
        abandoned)."""
        self._stop.set()

    def close(self) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)  # it only waits in slices of SLICE, looking at `stop`
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hosts_pool.shutdown(wait=False, cancel_futures=True)
        for fleet in [*self._fleets.values(), *self._run_fleets.values()]:
            fleet.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.round()
            except Exception as exc:  # noqa: BLE001 - a bug in one round must not end the board: said, tried again
                import traceback

                traceback.print_exception(exc)
            self._stop.wait(max(0.2, self.every - (time.monotonic() - started)))

    def round(self) -> None:
        """One round: the lab and the going runs' hosts asked side by side, then the runs' rows read again."""
        going = self._runs_to_ask()
        lab = self._pool.submit(self._ask_lab)
        made_up = self._look is not None and self._usage is None  # a made-up lab (tests, bench) has no usage logs to read
        if not made_up and time.monotonic() >= self._usage_due and (self._usage_out is None or self._usage_out.done()):
            self._usage_due = time.monotonic() + self.usage_every  # not waited for: a slow log never holds up the lab
            self._usage_out = self._pool.submit(self.read_usage)
        if self._look is None:  # the real lab: detached runs and sweeps brought up to date from their supervisors, not waited for
            for run_id in self._supervised_due():
                self._refreshing[run_id] = self._pool.submit(self._refresh_supervised, run_id)
        asked = {run_id: self._pool.submit(self._ask_run, run_id) for run_id in going}
        if not self._wait([lab, *asked.values()]):
            return  # stopping: what is still out is abandoned
        lab.result()
        for run_id, future in asked.items():
            answer = future.result()
            if answer is not None:
                with self.lock:
                    self.answers[run_id] = (time.time(), answer)
        for run_id in [r for r in self.answers if r not in going]:
            self.answers.pop(run_id, None)
            fleet = self._run_fleets.pop(run_id, None)
            if fleet is not None:
                fleet.close()
        self.refresh_runs()
        self.rounds += 1

    # -------------------------------------------------------------------------------------------- the lab

    def _ask_lab(self) -> None:
        """Each host asked as `mnft lab` asks it (mnft.hosts.lab.look), on its own connection kept open, unless its
        last question is still out: a host slow to answer or not answering never holds up the others. The answers
        in by the end of the round's wait are published; a later one with the next round."""
        started = time.monotonic()
        if self._look is not None:  # made up (tests, bench/board.py): the whole lab at once
            for name, view in self._look().items():
                self._keep(name, view)
        else:
            asked = []
            for host in self.inventory.hosts:
                with self.lock:
                    if host.name in self._asking:
                        continue
                    self._asking[host.name] = time.time()
                asked.append(self._hosts_pool.submit(self._ask_host, host))
            self._wait(asked, timeout=max(1.0, self.every))
        self.asked_s = time.monotonic() - started
        self._publish_lab()

    def _wait(self, futures: list[Future], timeout: float | None = None) -> bool:
        """Wait for the futures (at most `timeout` seconds) in slices, looking at `stop` between them: whether the
        board goes on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = set(futures)
        while pending and not self._stop.is_set():
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            if left <= 0:
                break
            pending = wait(pending, timeout=left).not_done
        return not self._stop.is_set()

    def _ask_host(self, host) -> None:
        from mnft.hosts.fleet import Fleet
        from mnft.hosts.lab import look

        fleet = None
        try:
            fleet = self._fleets.get(host.name)
            if fleet is None:
                fleet = self._fleets[host.name] = Fleet(self.inventory.only([host.name]), self.timeouts)
            view = look(fleet, [host]).get(host.name) or {"error": "no answer", "status": "failed"}
        except MnftError as exc:  # e.g. the known_hosts file became unreadable
            view = {"error": str(exc), "status": "failed"}
        except Exception as exc:  # noqa: BLE001 - a bug: said on the board's terminal, the host shown failed, asked again
            import traceback

            traceback.print_exception(exc)
            view = {"error": f"internal error (a bug in mnft): {type(exc).__name__}: {exc}", "status": "failed"}
        if view.get("error") and not view.get("devices") and fleet is not None:
            self._fleets.pop(host.name, None)  # a fleet remembers a host unreachable: the next question opens a new one
            fleet.close()
        self._keep(host.name, view)
        with self.lock:
            self._asking.pop(host.name, None)

    def _keep(self, name: str, view: dict) -> None:
        with self.lock:
            self.views = {**self.views, name: view}
            if not (view.get("error") and not view.get("devices")):
                self.answered[name] = time.time()

    def _publish_lab(self, started: bool = False) -> None:
        """The lab's JSON: `devices` is `mnft lab --json`'s (mnft.hosts.lab.rows), each with the since and memory
        figures the page draws; `hosts` each host's last answer, its state and the whole-host lease when held."""
        now = time.time()
        with self.lock:
            views, asking = self.views, dict(self._asking)
        table = [] if started else rows(self.inventory, views)
        devices = []
        for row in table:
            item = row.to_json()
            view = views.get(row.host) or {}
            device = next((d for d in view.get("devices") or [] if str(d.get("index") if d.get("index") is not None else "cpu") == row.device), {})
            used, total = device.get("memory_used_mib"), device.get("memory_total_mib")
            item.update(since_text=since(row.since, now) if row.since else "", memory_used_mib=used if isinstance(used, int) else None,
                        memory_total_mib=total if isinstance(total, int) else None, model=leases.shown(device.get("name"), 40))
            devices.append(item)
        hosts = []
        for host in self.inventory.hosts:
            view = views.get(host.name)
            down = view is None or bool(view.get("error") and not view.get("devices"))
            slow = host.name in asking and now - asking[host.name] > self.slow
            # a host that never answered is "asking" only until it is slow: then not answering, as one that did
            state = ("slow" if slow else "asking") if view is None else (view.get("status") or "failed") if down else "slow" if slow else "ok"
            hosts.append({"name": host.name, "answered": self.answered.get(host.name), "state": state,
                          "asking_since": asking.get(host.name) if slow else None,
                          "error": leases.shown(view.get("error"), 200) if view and down else None,
                          "whole_host": leases.describe(view.get("holder")) if view and view.get("held") else None,
                          "free": free_count(view or {}), "devices": device_count(view or {})})
        self.rows = devices
        with self.lock:
            self.lab.set({"inventory": str(self.inventory.path) if self.inventory.path else "the embedded local inventory",
                          "now": now, "asked_s": None if started else round(self.asked_s or 0, 3), "round": self.rounds,
                          "hosts": hosts, "devices": devices})

    # -------------------------------------------------------------------------------------------- usage

    def read_usage(self) -> None:
        """The last USAGE_DAYS of the hosts' usage logs, summed as `mnft lab --usage` sums them (mnft.hosts.usage:
        the same functions), published; a host that did not answer is named, its use not counted."""
        from mnft.hosts import usage as usage_logs

        start = time.time() - USAGE_DAYS * 86400
        try:
            if self._usage is not None:  # made up (tests)
                read = self._usage(start)
            else:
                from mnft.hosts.fleet import Fleet

                with Fleet(self.inventory, self.timeouts) as fleet:
                    read = usage_logs.ask(fleet, self.inventory.hosts, start)
        except MnftError as exc:
            read = {h.name: {"error": str(exc)} for h in self.inventory.hosts}
        errors = {h: leases.shown(str(v.get("error") or v.get("refused")), 200) for h, v in read.items() if "lines" not in v}
        summary = usage_logs.summarise({h: v["lines"] for h, v in read.items() if "lines" in v}, start)
        with self.lock:
            self.usage.set(dict(summary, errors=errors, days=USAGE_DAYS, since=start, now=time.time()))

    # -------------------------------------------------------------------------------------------- the runs

    def _runs_to_ask(self) -> list[str]:
        """Runs going on whose hosts the round asks: those whose page is open, and those no supervisor here follows."""
        out = []
        for run_id, (_, row) in list(self._rows_cache.items()):
            if row.get("kind") == sweeps.KIND:
                continue  # a sweep has no hosts of its own: its points are runs, asked as such
            if row.get("state") in runs_of.GOING and not row.get("slurm") and (self.watching[run_id] > 0 or not row.get("supervised")):
                out.append(run_id)
        return out[:RUN_FLEETS * 4]

    def _supervised_due(self) -> list[str]:
        """Runs and sweeps going on under a supervisor on the lab whose records are due to be brought here (a sweep's
        points come with their sweep); at most one refresh of each at a time."""
        now, out = time.monotonic(), []
        for run_id, (_, row) in list(self._rows_cache.items()):
            busy = self._refreshing.get(run_id)
            going = row.get("state") in runs_of.GOING or row.get("state") in ("handed-over", "supervised")
            if row.get("supervisor") and not row.get("sweep") and going and now >= self._refresh_due.get(run_id, 0.0) and (busy is None or busy.done()):
                self._refresh_due[run_id] = now + SUPERVISED_EVERY
                out.append(run_id)
        return out

    def _refresh_supervised(self, run_id: str) -> None:
        """`mnft status`'s refresh of one supervised run (mnft.run.supervisor.refresh): its files change, its row is read again."""
        from mnft.run import records, supervisor

        try:
            supervisor.refresh(records.load(run_id))
        except MnftError:  # a damaged record: its page says what the record says
            pass

    def _ask_run(self, run_id: str) -> dict | None:
        """The run's hosts' answer to `mnft status` (host -> state, last metric, last lines), or None."""
        from mnft.hosts.fleet import Fleet
        from mnft.run import control, records
        from mnft.run.rerun import from_snapshot

        try:
            record = records.load(run_id)
            if self._status is not None:
                return self._status(record)
            fleet = self._run_fleets.get(run_id)
            if fleet is None:
                fleet = self._run_fleets[run_id] = Fleet(from_snapshot(record.data.get("inventory"), f"{record.path}/run.json"), self.timeouts)
            answer = control.status(record, fleet, lines=runs_of.LOG_LINES)
        except MnftError:  # a damaged record or inventory snapshot: its page says what the record says
            return None
        if any(a.get("state") in ("unreachable", "host-key-rejected") for a in answer.values()):
            self._run_fleets.pop(run_id).close()
        return answer

    def refresh_runs(self) -> None:
        """Every run's row (read again where its files changed, or while it goes on; a sweep's where its record or
        one of its points' files changed) and the others' runs the lab shows, newest first; a sweep's points
        nested under its row (`points`), in point order."""
        now = time.time()
        found = runs_of.run_dirs()
        rows_now = []
        for run_id, path in found.items():
            stamp = runs_of.stamp(path)
            cached = self._rows_cache.get(run_id)
            answered = self.answers.get(run_id)
            if cached is not None and cached[1].get("kind") == sweeps.KIND:
                stamp = (stamp, self._points_stamp(cached[1], found))
                fresh = cached[0] == stamp
            else:
                fresh = cached is not None and cached[0] == stamp and not (cached[1].get("state") in runs_of.GOING or cached[1].get("supervised") or answered)
            if not fresh:
                row = runs_of.summary(run_id, path, answered[1] if answered else None, now, metrics_of=self._metrics)
                if row.get("kind") == sweeps.KIND:
                    stamp = (runs_of.stamp(path), self._points_stamp(row, found))
                self._rows_cache[run_id] = (stamp, row)
            rows_now.append(self._rows_cache[run_id][1])
        for gone in [r for r in self._rows_cache if r not in found]:
            del self._rows_cache[gone]
        self._metrics.keep({str(p) for p in found.values()})
        every = runs_of.others(self.rows, set(found), now) + nest_points(rows_now)
        every.sort(key=lambda r: (r.get("created") or 0, r.get("id") or ""), reverse=True)
        with self.lock:
            self.runs.set({"now": now, "root": str(runs_of.records.runs_root()), "runs": every})

    def _points_stamp(self, row: dict, found: dict) -> tuple:
        """What changes when a sweep's row may: each of its points' files."""
        return tuple(runs_of.stamp(found[p]) if p in found else None for p in row.get("point_ids") or [])

    def detail(self, run_id: str) -> Published:
        """The run's page (read again when its files or its hosts' answer changed; a sweep's page also when one of
        its points' files changed)."""
        from mnft.run import records

        path = records.path_of(run_id) or records.runs_root() / run_id  # here, else where the user's index says
        answered = self.answers.get(run_id)

        def key_now() -> tuple:
            points = tuple(runs_of.stamp(p) for p in self._sweep_dirs.get(run_id) or [])
            return (runs_of.stamp(path), answered[0] if answered else None, int(time.time() // 10), points)

        key = key_now()
        with self.lock:
            known = self._details.get(run_id)
        if known is not None and known[0] == key:
            return known[1]
        page = known[1] if known is not None else Published()
        if (path / "run.json").is_file():
            value = runs_of.detail(run_id, path, answered[1] if answered else None, answered[0] if answered else None, metrics_of=self._metrics)
        else:
            value = self._their_run(run_id)
        if value.get("kind") == sweeps.KIND and run_id not in self._sweep_dirs:
            self._sweep_dirs[run_id] = [records.path_of(p) or records.runs_root() / p for p in value.get("point_ids") or []]
            key = key_now()  # its first reading: the points' stamps from now on
        with self.lock:
            page.set(value)
            self._details[run_id] = (key, page)
        return page

    def _their_run(self, run_id: str) -> dict:
        """A run this controller has no record of: what the lab shows of it (its leases on the hosts)."""
        seen = next((r for r in runs_of.others(self.rows, set()) if r["id"] == run_id), None)
        if seen is None:
            return {"id": run_id, "mine": False, "state": "unknown", "missing": True}
        held = [{"host": r["host"], "device": r["device"], "state": r["state"], "user": r.get("user"), "command": r.get("command"),
                 "since": r.get("since"), "since_text": r.get("since_text"), "detail": r.get("detail")}
                for r in self.rows if r.get("run") == run_id]
        return {**seen, "leases": held}

    def watch(self, run_id: str | None, delta: int) -> None:
        if run_id:
            with self.lock:
                self.watching[run_id] += delta
                if self.watching[run_id] <= 0:
                    del self.watching[run_id]
                    self._details.pop(run_id, None)
                    self._sweep_dirs.pop(run_id, None)


def nest_points(rows: list[dict]) -> list[dict]:
    """The rows with each sweep's points under its row (`points`, in point order) instead of beside it: a sweep of
    100 points is one entry of the list. A point whose sweep's record is not here stays a row of its own (its
    `sweep` names the sweep)."""
    owner = {pid: row["id"] for row in rows if row.get("kind") == sweeps.KIND for pid in row.get("point_ids") or []}
    under: dict[str, list[dict]] = {}
    top = []
    for row in rows:
        sweep_id = owner.get(row.get("id"))
        if sweep_id is not None and (row.get("sweep") or {}).get("id") == sweep_id:
            under.setdefault(sweep_id, []).append(row)
        else:
            top.append(row)
    out = []
    for row in top:
        if row.get("kind") == sweeps.KIND:
            order = {pid: i for i, pid in enumerate(row.get("point_ids") or [])}
            row = dict(row, points=sorted(under.get(row["id"], []), key=lambda r: order.get(r["id"], 0)))
        out.append(row)
    return out
