"""A run's status and stop as tables (a row per host) or JSON, and the exit code each implies."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text

from mnft.core.errors import ExitCode
from mnft.core.output import clip_end, console, fmt_loss, plain, print_json
from mnft.hosts.leases import describe as describe_holder

LAST_LINE_WIDTH = 60  # the status table's last-line column: the line's end, cut at a word (core.output.clip_end)


def print_status(record, states: dict[str, dict], as_json: bool, live: dict | None = None) -> int:
    """A row per host; returns the exit code: 0 healthy (running, exited 0, or stopped by `mnft stop` everywhere), 1
    not, 4 unreachable.
    live: what the run's attached supervisor says (its attempt, when restarting: healthy while it recovers)."""
    ending = {key: record.data[key] for key in ("diagnosis", "warnings") if record.data.get(key)}
    code = code_of(record.data)
    if as_json:
        print_json({"run": record.run_id, "hosts": states, **({"supervisor": live} if live else {}), **ending, **({"code": code} if code else {}),
                    **({"supervised_by": record.data["supervisor"]} if record.data.get("supervisor") else {})})
    else:
        job = record.data.get("job") or {}
        label = job.get("name") or (f"recipe {record.data.get('recipe')}" if record.data.get("recipe") else " ".join(job.get("entry") or ["?"]))
        table = Table(title=plain(f"run {record.run_id} ({label}, {len(states)} hosts)"))
        for col in ("host", "node_rank", "state", "exit code", "processes", "step", "loss", "since", "last line"):
            table.add_column(col)
        for name, st in states.items():
            metric = st.get("last_metric") or {}
            since = st.get("ended") or st.get("started")
            state = st.get("state", "?")
            style = {"running": "green", "stopped": "yellow", "exited": "green" if st.get("exit_code") == 0 else "red"}.get(state, "magenta")
            table.add_row(
                plain(name),
                str(record.data["hosts"][name]["node_rank"]),
                Text(state, style=style),
                str(st.get("exit_code")) if st.get("exit_code") is not None else "-",
                str(st.get("processes", "-")),
                ("~" if metric.get("step_about") else "") + str(metric["step"]) if metric.get("step") is not None else "-",
                plain(fmt_loss(metric.get("loss"))),
                f"{time.time() - since:.0f}s ago" if since else plain(st.get("error") or "-"),
                plain(clip_end(st.get("last_line") or "", LAST_LINE_WIDTH) or "-"),
            )
        console().print(table)
        if record.data.get("supervisor"):
            console().print(plain(supervisor_line(record.data)))
            if record.data.get("state") == "supervisor-lost":
                console().print(plain(f"run {record.run_id}: supervisor-lost: {record.data.get('reason')}", "bold red"))
        if code:
            console().print(plain(code_line(code)))
        if live and live.get("max_restarts"):
            console().print(plain(f"attempt {live.get('attempt')}/{live['max_restarts'] + 1}: {live.get('state')}"
                                  + (f" ({live['note']})" if live.get("note") else ""), "yellow" if (live.get("attempt") or 1) > 1 else ""))
        for name, st in states.items():
            if st.get("container"):
                box = st["container"]
                there = {True: "present", False: "gone"}.get(box.get("present"), "not known")
                console().print(plain(f"{name}: in image {box.get('image')} ({box.get('runtime')} container {box.get('name')}: {there})"))
            if st.get("lease") is not None:
                held = st.get("devices") or []
                what = "its CPUs" if held == [None] else "GPU " + ", ".join(str(d) for d in held)
                console().print(plain(f"{name}: {what} held by {describe_holder(st['lease'])}"))
            if st.get("meaning"):
                console().print(plain(f"{name}: exit code {st.get('exit_code')}: {st['meaning']}", "yellow"))
            if st.get("straggler"):
                console().print(plain(f"straggler {name}: {st['straggler']['why']} — see docs/perf.md", "bold yellow"))
        if ending.get("diagnosis"):
            console().print(Text.assemble(("cause: ", "bold red"), ending["diagnosis"]["cause"], "\n", ("fix:   ", "bold"), ending["diagnosis"]["fix"]))
        if record.data.get("time"):
            console().print(time_table(record.data["time"]))
        for warning in ending.get("warnings") or ():
            console().print(Text.assemble(("warning: ", "bold yellow"), warning["cause"], "\n", ("fix:   ", "bold"), warning["fix"]))
    if any(st.get("state") in ("unreachable", "host-key-rejected") for st in states.values()):
        return ExitCode.UNREACHABLE
    if record.data.get("state") == "supervisor-lost":
        return ExitCode.FAILED
    healthy = all(st.get("state") in ("running", "stopped") or (st.get("state") == "exited" and st.get("exit_code") == 0) for st in states.values())
    recovering = bool(live) and live.get("state") in ("waiting", "starting", "running")
    return ExitCode.OK if healthy or recovering else ExitCode.FAILED


def code_of(data: dict) -> dict | None:
    """The code a run runs, as its record names it: the tree hash, where it came from, the job's directory."""
    code = dict(data.get("code") or {})
    if data.get("code_hash") and not code.get("hash"):
        code["hash"] = data["code_hash"]
    if not code.get("hash"):
        return None
    code.setdefault("job", data.get("job_id"))
    return code


def code_line(code: dict) -> str:
    """"code 1a2b3c4d5e6f from /home/a/proj (120 files), in ~/mnft/outputs/J on each host"."""
    where = f", in {code['job_dir']} on each host" if code.get("job_dir") else ""
    files = f" ({code['files']} files)" if code.get("files") else ""
    return f"code {str(code['hash'])[:12]}" + (f" from {code['src']}" if code.get("src") else "") + files + where


def ended_note(record, result: dict[str, dict]) -> str | None:
    """"run X already ended on h1, h2: nothing to stop" when nothing of the run was alive on any host."""
    if result and all(r.get("ended") for r in result.values()):
        return f"run {record.run_id} already ended on {', '.join(result)}: nothing to stop"
    return None


def print_stop(record, result: dict[str, dict], as_json: bool) -> int:
    note = ended_note(record, result)
    if as_json:
        print_json({"run": record.run_id, "hosts": result, **({"note": note} if note else {})})
    elif note:
        console().print(plain(note))
    else:
        table = Table(title=plain(f"stop run {record.run_id}"))
        for col in ("host", "killed", "remaining", "gpus held"):
            table.add_column(col)
        for name, r in result.items():
            if "remaining" not in r:
                table.add_row(plain(name), Text(r.get("state", "?"), style="magenta"), plain(r.get("error", "")), "")
                continue
            killed = ", ".join(map(str, r["killed"])) or ("already ended" if r.get("ended") else "-")
            table.add_row(plain(name), killed, Text(", ".join(map(str, r["remaining"])) or "none", style="red" if r["remaining"] else "green"), ", ".join(map(str, r.get("gpus_held") or [])) or "-")
        console().print(table)
    if any("remaining" not in r for r in result.values()):
        return ExitCode.UNREACHABLE
    return ExitCode.FAILED if any(r["remaining"] for r in result.values()) else ExitCode.OK


TIME_COLUMNS = (("launch", "launch_s"), ("steps", "steps_s"), ("checkpoints", "checkpoint_s"), ("lost", "lost_s"),
                ("detection", "detection_s"), ("finish", "finish_s"), ("restart", "restart_s"), ("kept", "kept_s"))


def time_table(time_data: dict) -> Table:
    """Where the run's wall time went (mnft.run.goodput), a row per attempt and the total, with the goodput."""
    ratio = time_data.get("goodput")
    queue = time_data.get("queue_s")
    title = (f"where the time went: {time_data.get('wall_s', 0):.1f}s wall" + (f", goodput {ratio:.0%}" if ratio is not None else "")
             + (f" (after {queue:.1f}s waiting in line, counted in neither)" if isinstance(queue, (int, float)) and queue else ""))
    unknown = time_data.get("unknown")
    table = Table(title=plain(title), caption=plain(str(unknown)) if unknown else None)
    table.add_column("attempt")
    for name, _ in TIME_COLUMNS:
        table.add_column(name, justify="right")
    table.add_column("steps lost", justify="right")

    def cell(value) -> str:
        return f"{value:.1f}s" if isinstance(value, (int, float)) else "-"

    def cells(row: dict) -> list[str]:
        out = [cell(row.get(key)) for _, key in TIME_COLUMNS]
        out[[key for _, key in TIME_COLUMNS].index("checkpoint_s")] += saved_count(row, time_data)
        return out

    for a in time_data.get("attempts") or []:
        table.add_row(f"{a['number']} ({a.get('state') or '?'})", *cells(a), str(a["steps_lost"]) if a.get("steps_lost") is not None else "-")
    if len(time_data.get("attempts") or []) > 1:
        table.add_row("total", *cells(time_data), str(time_data.get("steps_lost", "-")))
    return table


def saved_count(row: dict, time_data: dict) -> str:
    """" (8)": the checkpoints an attempt (or the run) saved, beside their time; " (10000+)" when the directory held
    more than were listed; nothing when its checkpoints directory was not listed."""
    count = row.get("checkpoints")
    if isinstance(count, bool) or not isinstance(count, int):
        return ""
    return f" ({count}{'+' if time_data.get('checkpoints_more') else ''})"


# ------------------------------------------------------------------------------------------------ `mnft runs`


def runs_rows(found: dict) -> list[dict]:
    """A row per run of the user's (run id -> record directory, mnft.run.records.every_run), newest first: its id,
    the directory it was started from, its job, state, hosts and since when; a damaged record is a row that says so."""
    from mnft.core.errors import InputError
    from mnft.run import records
    from mnft.run.control import job_of

    rows = []
    for run_id, path in found.items():
        repo = str(path.parent.parent)  # runs/<id> of the directory train was started in (a record from before `started_in`)
        try:
            data = records.read_record(path / "run.json")
        except InputError as exc:
            rows.append({"id": run_id, "repo": repo, "record": str(path), "job": "?", "state": "unreadable", "hosts": [], "since": None, "reason": str(exc)})
            continue
        try:
            label = job_of(data).label
        except Exception:  # noqa: BLE001 - a damaged record's job is shown as unknown, never a failed list
            label = "?"
        hosts = data.get("hosts") if isinstance(data.get("hosts"), dict) else {}
        if not hosts and isinstance(data.get("inventory"), dict):
            names = [h.get("name") for h in data["inventory"].get("hosts") or [] if isinstance(h, dict)]
        else:
            names = list(hosts)
        created = data.get("created")
        row = {"id": run_id, "repo": str(data.get("started_in") or repo), "record": str(path), "job": label,
               "state": str(data.get("state") or "?"), "hosts": [str(n) for n in names],
               "since": created if isinstance(created, (int, float)) and not isinstance(created, bool) else None}
        sweep = data.get("sweep") if isinstance(data.get("sweep"), dict) else {}
        if data.get("kind") == "sweep":  # one row for the whole sweep; its points are rows of their own in --json
            from mnft.run.sweep import summary

            row["points"] = summary([p for p in sweep.get("points") or [] if isinstance(p, dict)])
            row["hosts"] = []
        elif isinstance(sweep.get("id"), str):
            row["sweep"] = sweep["id"]
        rows.append(row)
    rows.sort(key=lambda r: r["id"], reverse=True)
    return rows


def print_runs(rows: list[dict], as_json: bool, now: float | None = None) -> int:
    """The user's runs as a table (id, repo, job, state, hosts, since) or JSON."""
    if as_json:
        print_json({"runs": rows})
        return ExitCode.OK
    if not rows:
        from mnft.core.output import command

        console().print(plain(f"no runs recorded yet (start one with {command('train')})"))
        return ExitCode.OK
    now = time.time() if now is None else now
    sweeps = {r["id"] for r in rows if "points" in r}
    folded = len([r for r in rows if r.get("sweep") in sweeps])
    rows = [r for r in rows if r.get("sweep") not in sweeps]  # a sweep's points: in its row (`mnft status SWEEP` lists them)
    table = Table(title=plain(f"your runs ({len(rows)}" + (f"; and {folded} point(s) of the sweeps shown" if folded else "") + ")"))
    for col in ("id", "repo", "job", "state", "hosts", "since"):
        table.add_column(col)
    style = {"running": "green", "succeeded": "green", "failed": "red", "unreadable": "magenta"}
    for r in rows:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["since"])) if r["since"] else "-"
        job = r["job"] + (f" (sweep: {r['points']})" if "points" in r else "")
        table.add_row(plain(r["id"]), plain(r["repo"]), plain(job), Text(r["state"], style=style.get(r["state"], "yellow")),
                      plain(", ".join(r["hosts"]) or "-"), since)
    console().print(table)
    return ExitCode.OK


def supervisor_line(data: dict, now: float | None = None) -> str:
    """Where a detached run's supervisor lives, since when, and whether it is alive (as the last look found it)."""
    where = data.get("supervisor") or {}
    since = where.get("since")
    age = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
    alive = where.get("alive")
    said = {True: "alive", False: "ended" if (where.get("exit") or data.get("state") != "supervisor-lost") else "gone"}.get(alive, "not reached")
    if alive is None and where.get("error"):
        said += f" ({where['error']})"
    return f"supervisor: {where.get('host')} pid {where.get('pid')}{age}: {said}"


def print_supervised(record, as_json: bool) -> int:
    """A detached run its supervisor has not started on the hosts yet: its state (in line, checking) and supervisor."""
    data = record.data
    if as_json:
        print_json({"run": record.run_id, "state": data.get("state"), "reason": data.get("reason"), "supervised_by": data.get("supervisor")})
    else:
        console().print(plain(f"run {record.run_id}: {data.get('state')}" + (f" ({data['reason']})" if data.get("reason") else "")))
        console().print(plain(supervisor_line(data)))
    going = data.get("state") in ("waiting", "checking", "syncing", "starting", "handed-over", "supervised")
    return ExitCode.OK if going and (data.get("supervisor") or {}).get("alive") else ExitCode.FAILED
