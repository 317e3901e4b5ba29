"""`invoke train`, `logs`, `status`, `stop`: the launch sequence and the run's life afterwards.

train: check (refuse on a mismatch unless forced) -> sync -> a free rendezvous port on the master -> plan one
torchrun per host -> start all in parallel under gang supervision -> collect logs. The run record
(runs/<id>/run.json) is written as it goes.
"""

from __future__ import annotations

import base64
import io
import json
import tarfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from mnft import check as checks
from mnft import launch as launching
from mnft import runs
from mnft.check import CheckOptions
from mnft.errors import ExitCode, MnftError
from mnft.fleet import Fleet, Status
from mnft.gang import Gang, GangError, GangInterrupted, GangResult, agent_command, agent_payload
from mnft.inventory import Host, Inventory
from mnft.launch import LaunchOptions
from mnft.report import fmt_loss


class RunFailed(MnftError):
    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class TrainOptions:
    launch: LaunchOptions
    check: CheckOptions = CheckOptions()
    force: bool = False
    src: Path | None = None
    sync: bool = True
    dry_run: bool = False
    resume_run: str | None = None


# ------------------------------------------------------------------------------------------------ inventory snapshot


def snapshot(inventory: Inventory) -> dict[str, Any]:
    return {
        "path": str(inventory.path) if inventory.path else None,
        "format": inventory.format,
        "master": inventory.master_name,
        "known_hosts": str(inventory.known_hosts) if inventory.known_hosts else None,
        "rendezvous_port": inventory.rendezvous_port,
        "hosts": [h.settings() for h in inventory.hosts],
    }


def from_snapshot(data: dict[str, Any]) -> Inventory:
    return Inventory(
        Path(data["path"]) if data.get("path") else None,
        data["format"],
        tuple(Host(**h) for h in data["hosts"]),
        data["master"],
        Path(data["known_hosts"]) if data.get("known_hosts") else None,
        data["rendezvous_port"],
    )


# ------------------------------------------------------------------------------------------------ port


def chosen_port(report: checks.CheckReport) -> int:
    """The rendezvous port the check found free on the master (it searched past a taken one)."""
    if not report.port_free:
        raise RunFailed(f"no free rendezvous port on the master from {report.port}: {report.port_error}; stop what holds it (ss -ltnp) or set rendezvous_port")
    return report.port


# ------------------------------------------------------------------------------------------------ train


def progress_text(data: dict) -> str:
    return (f"step {data['step']}  loss {data['loss']:.4f}  {data.get('tokens_per_s', 0):.0f} tokens/s  "
            f"skipped {data.get('skipped_steps', 0)}")


class Display:
    """Live output: each line prefixed with host and rank; rank 0's metrics as a progress line.

    On a terminal the progress line is a rich status line updated in place. Without one (CI, nohup, a pipe) a
    plain `progress: …` line is printed for the first step, then every `every_steps` steps or `every_s` seconds,
    whichever comes first, and for the last step.
    """

    status = None  # a rich Status line, on a terminal

    def __init__(self, console: Console, width: int, every_steps: int = 50, every_s: float = 30.0, clock=time.monotonic) -> None:
        self.console = console
        self.width = width
        self.last_metric: dict = {}
        self.every_steps, self.every_s, self.clock = every_steps, every_s, clock
        self._printed_at: float | None = None
        self._printed_step: int | None = None

    def line(self, host: str, rank: int | None, text: str) -> None:
        label = f"{host} r{rank}" if rank is not None else f"{host}"
        self.console.print(Text.assemble((f"{label:<{self.width}}| ", "dim"), text), highlight=False, soft_wrap=True)

    def metric(self, data: dict) -> None:
        if "step" in data:
            self.last_metric = data
            if not isinstance(data.get("loss"), (int, float)):
                return
            if self.status is not None:
                self.status.update(progress_text(data))
            elif not self.console.is_terminal:
                now, step = self.clock(), int(data["step"])
                due = (
                    self._printed_at is None
                    or step - (self._printed_step or 0) >= self.every_steps
                    or now - self._printed_at >= self.every_s
                    or (data.get("max_steps") is not None and step >= data["max_steps"])
                )
                if due:
                    self._printed_at, self._printed_step = now, step
                    self.console.print("progress: " + progress_text(data), highlight=False, soft_wrap=True)
        elif data.get("event") == "summary":
            self.console.print(
                f"[bold]summary[/bold]: loss {fmt_loss(data.get('initial_loss'))} -> {fmt_loss(data.get('final_loss'))}, "
                f"{data.get('tokens_per_s', 0):.0f} tokens/s over {data.get('steps')} steps"
            )


# ------------------------------------------------------------------------------------------------ resume


def launched(data: dict) -> bool:
    """A record of a run that was started on the hosts (not one refused by the check or stopped by sync)."""
    return bool(data.get("launched", data.get("state") in ("running", "succeeded", "failed", "stopped")))


@dataclass(frozen=True)
class Reuse:
    run_id: str
    hosts: str | None
    overrides: tuple[str, ...]
    env: tuple[str, ...]
    env_files: tuple[str, ...]
    notes: tuple[str, ...]


NOT_REUSED = frozenset({"overwrite", "resume"})  # they decide how a run starts, and a resume starts from its checkpoint


def reuse_previous(previous: dict, *, hosts: str | None, overrides: tuple[str, ...], env: tuple[str, ...],
                   env_files: tuple[str, ...]) -> Reuse:
    """--resume: the previous run's hosts file, overrides and env names, unless given again (explicit flags win;
    overrides merge by key). Pure: the previous run.json's data in, the values to use and what was reused out."""
    notes = []
    if hosts is None and (previous.get("inventory") or {}).get("path"):
        hosts = previous["inventory"]["path"]
        notes.append(f"--hosts {hosts}")
    explicit = {o.partition("=")[0] for o in overrides} | NOT_REUSED
    kept = tuple(o for o in previous.get("overrides") or () if o.partition("=")[0] not in explicit)
    if kept:
        notes.append("--set " + " --set ".join(kept))
    named = {e.partition("=")[0] for e in env}
    kept_env = tuple(e for e in previous.get("env_specs") or () if e.partition("=")[0] not in named)
    if kept_env:
        notes.append("--env " + " --env ".join(kept_env))
    kept_files = tuple(f for f in previous.get("env_files") or () if f not in env_files)
    if kept_files:
        notes.append("--env-file " + " --env-file ".join(kept_files))
    dropped = [o for o in previous.get("overrides") or () if o.partition("=")[0] in NOT_REUSED]
    if dropped:
        notes.append("(not " + " ".join(dropped) + ": a resume continues from the latest checkpoint)")
    return Reuse(previous["run_id"], hosts, kept + tuple(overrides), kept_env + tuple(env), kept_files + tuple(env_files), tuple(notes))


def previous_run(run_id: str | None) -> runs.RunRecord:
    """The run --resume continues: that one, or the latest that was started on the hosts."""
    return runs.load(run_id) if run_id else runs.load(None, launched)


# ------------------------------------------------------------------------------------------------ train


def train(inventory: Inventory, options: TrainOptions, console: Console) -> int:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    lopts = options.launch
    job_id = previous = None
    if options.resume_run is not None or lopts.resume:
        previous = previous_run(options.resume_run)
        job_id = previous.data.get("job_id", previous.run_id)
        lopts = replace(lopts, resume=True, recipe=previous.data.get("recipe", lopts.recipe))
    launching.parse_overrides(lopts.overrides)  # bad input fails before any host is touched
    env, secrets = launching.split_env(lopts.env, launching.environ(), lopts.env_files)
    run_id = launching.new_run_id()
    job_id = job_id or run_id
    record = None
    if not options.dry_run:  # the record exists from the start: a refused or failed launch is recorded too
        record = runs.RunRecord.create(
            run_id, job_id=job_id, recipe=lopts.recipe, overrides=list(lopts.overrides), env_specs=list(lopts.env),
            env_files=list(lopts.env_files), rdzv=lopts.rdzv, resume=lopts.resume, resumed_from=previous.run_id if previous else None,
            detach=lopts.detach, inventory=snapshot(inventory), hosts={}, timings=timings, state="checking", launched=False,
        )
    with Fleet(inventory) as fleet:
        report = checks.gather(fleet, replace(options.check, find_free_port=True))
        timings["check_s"] = round(time.monotonic() - t0, 3)
        bad = [h.name for h in inventory.hosts if report.status(h.name) != Status.OK.value]
        problems = [{"host": p.host, "field": p.field, "severity": p.severity, "message": p.message} for p in report.problems]
        if record is not None:
            record.update(facts=report.facts, check={"ok": not bad, "failed_hosts": bad, "problems": problems, "forced": bool(bad and options.force)}, timings=timings)
        if bad and not options.force:
            from mnft.report import print_check

            print_check(report, as_json=False)
            details = "; ".join(
                f"{p.host}: {p.field}: {p.message}" for p in report.problems if p.severity == "error"
            ) or "; ".join(f"{n}: {report.outcomes[n].error}" for n in bad if report.outcomes[n].error)
            error = RunFailed(f"check failed on {', '.join(bad)} ({details}); fix it or pass --force")
            error.exit_code = report.exit_code() or ExitCode.FAILED  # a host whose probe failed has no "problem" rows
            if record is not None:
                record.update(state="refused", reason=str(error))
            raise error
        if report.master_addr is None:
            error = RunFailed(f"cannot tell the master's address: {next((p.message for p in report.problems if p.field == 'master_addr'), 'unknown')}")
            if record is not None:
                record.update(state="refused", reason=str(error))
            raise error
        ifaces = {name: reach.iface for name, reach in report.reach.items()}
        port = chosen_port(report)
        plans = launching.plan(
            inventory, master_addr=report.master_addr, port=port, run_id=run_id, job_id=job_id,
            options=lopts, ifaces=ifaces, env=env, secret_names=tuple(sorted(secrets)),
        )
        if options.dry_run:
            for p in plans:
                shown = p.display()
                console.print(f"[bold]{p.host}[/bold] (node_rank {p.node_rank}, cwd {shown['cwd']})")
                console.print("  env: " + " ".join(f"{k}={v}" for k, v in shown["env"].items()), highlight=False, soft_wrap=True)
                console.print("  " + shown["command"], highlight=False, soft_wrap=True)
            return ExitCode.OK
        assert record is not None
        record.update(
            master_addr=report.master_addr, rendezvous_port=port, state="syncing" if options.sync else "starting",
            hosts={p.host: {"node_rank": p.node_rank, **p.display(), "output_dir": p.output_dir, "metrics": p.metrics} for p in plans},
        )
        code_hash = None
        if options.sync:
            t_sync = time.monotonic()
            try:
                code_hash = sync_code(inventory, options.src, fleet)
            except Exception as exc:
                timings["sync_s"] = round(time.monotonic() - t_sync, 3)
                record.update(state="sync-failed", reason=str(exc), sync={"ok": False, "error": str(exc)}, timings=timings)
                raise
            timings["sync_s"] = round(time.monotonic() - t_sync, 3)
        record.update(code_hash=code_hash, sync={"ok": True} if options.sync else None, state="starting", timings=timings)
        console.print(f"run [bold]{run_id}[/bold]: {len(plans)} hosts, world size {inventory.world_size}, master {report.master_addr}:{port}")
        display = Display(console, max(len(h.name) for h in inventory.hosts) + 4)
        gang = Gang(fleet, plans, run_id, lopts, secrets, on_line=display.line, on_metric=display.metric)
        t_launch = time.monotonic()
        try:
            gang.start()
        except GangError as exc:
            timings["launch_s"] = round(time.monotonic() - t_launch, 3)
            for name, run in gang.runs.items():
                record.data["hosts"][name].update(state=run.state, error=run.error or None, started=run.started_at,
                                                  last_lines=list(run.tail)[-8:])
            record.update(state="failed", launched=True, reason=str(exc), timings=timings)
            raise
        timings["launch_s"] = round(time.monotonic() - t_launch, 3)
        for p in plans:
            record.data["hosts"][p.host].update(state="running", started=gang.runs[p.host].started_at)
        record.update(state="running", launched=True, timings=timings)
        if lopts.detach:
            console.print(f"detached: follow with `invoke logs -f {run_id}`, stop with `invoke stop {run_id}`")
            print(run_id)
            return ExitCode.OK
        try:
            with (console.status("waiting for the first step…") if console.is_terminal else nullcontext()) as display.status:
                result = gang.wait()
        except GangInterrupted as exc:
            try:
                finish(record, exc.result, timings, t0, fleet, console)
            except RunFailed:
                pass
            raise KeyboardInterrupt from None
        return finish(record, result, timings, t0, fleet, console)


def sync_code(inventory: Inventory, src: Path | None, fleet: Fleet) -> str | None:
    from mnft import sync

    report = sync.sync_code(inventory, src, fleet=fleet)  # None: the repository; configured excludes as `invoke sync`
    if not report.ok:
        raise RunFailed(f"sync failed: {report.summary()}")
    return report.local_hash


def finish(record: runs.RunRecord, result: GangResult, timings: dict, t0: float, fleet: Fleet, console: Console) -> int:
    if result.first_step_at is not None:
        timings["first_step_s"] = round(result.first_step_at - record.data["created"], 3)
    timings["total_s"] = round(time.monotonic() - t0, 3)
    for name, run in result.hosts.items():
        record.set_host(name, state=run.state, exit_code=run.exit_code, ended=run.ended_at, error=run.error or None,
                        last_lines=list(run.tail)[-8:], leftover_pids=result.leftovers.get(name, []))
    record.update(state="succeeded" if result.ok else "failed", reason=result.reason, failed_host=result.failed_host, timings=timings)
    try:
        collect(record, fleet, console, quiet=True)
        summarize(record)
    except Exception as exc:  # noqa: BLE001 - a failed collection must not hide the run's outcome
        console.print(f"[yellow]log collection failed: {exc}[/yellow]")
    if result.leftovers:
        console.print(f"[bold red]processes of the run survived on: {result.leftovers}[/bold red]")
    if result.ok:
        console.print(f"[green]run {record.run_id} finished on every host[/green] ({timings['total_s']:.1f}s); logs in {record.path}")
        return ExitCode.OK
    lines = ""
    if result.failed_host:
        tail = list(result.hosts[result.failed_host].tail)[-8:]
        lines = "\n".join(f"  {result.failed_host}| {t}" for t in tail)
    console.print(f"[bold red]run {record.run_id} failed: {result.reason}[/bold red]; every host's run was stopped\n{lines}")
    raise RunFailed(f"run {record.run_id} failed: {result.reason} (logs: {record.path})")


# ------------------------------------------------------------------------------------------------ logs, status, stop


def collect(record: runs.RunRecord, fleet: Fleet, console: Console, quiet: bool = False) -> dict[str, str]:
    """Copy every host's run directory into runs/<id>/<host>/, plot loss.png; outcome per host."""
    hosts = record.data["hosts"]

    def command(host: Host):
        info = hosts[host.name]
        extras = [info["metrics"]] if info.get("metrics") else []
        return agent_command(fleet, host.name, "pack", info["run_dir"], *extras)

    results = fleet.run(command, stdin=agent_payload(), hosts=[h for h in fleet.inventory.hosts if h.name in hosts])
    outcome = {}
    for result in results:
        if not result.ok:
            outcome[result.host] = f"{result.status.value}: {result.error}"
            continue
        data = json.loads(result.stdout.strip().splitlines()[-1])
        dest = record.path / result.host
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data["tar"])), mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
        outcome[result.host] = "ok"
    metrics = rank0_metrics(record)
    if metrics:
        plot(metrics, record.path / "loss.png")
    if not quiet:
        for name, state in outcome.items():
            console.print(f"{name}: {state}")
    return outcome


def rank0_metrics(record: runs.RunRecord) -> Path | None:
    """The collected metrics.jsonl of rank 0: on the master (static), on whichever host rank 0 ran (c10d)."""
    found = [p for p in record.path.glob("*/extra/metrics.jsonl") if p.stat().st_size]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_metrics(path: Path) -> tuple[list[dict], dict | None]:
    steps, summary = [], None
    for line in path.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if "step" in data and "loss" in data:
            steps.append(data)
        elif data.get("event") == "summary":
            summary = data
    return steps, summary


def plot(metrics: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, _ = read_metrics(metrics)
    if not steps:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [s["step"] for s in steps]
    ax.plot(xs, [float(s["loss"]) for s in steps], color="tab:blue", label="loss")  # "nan"/"inf" as written
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [s.get("tokens_per_s", 0) for s in steps], color="tab:orange", alpha=0.7, label="tokens/s")
    ax2.set_ylabel("trained tokens/s", color="tab:orange")
    ax.set_title(f"{metrics.parent.parent.parent.name}: loss and throughput")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def query(record: runs.RunRecord, fleet: Fleet, mode: str, *args: str):
    hosts = record.data["hosts"]
    return fleet.run(
        lambda host: agent_command(fleet, host.name, mode, hosts[host.name]["run_dir"], *args),
        stdin=agent_payload(),
        hosts=[h for h in fleet.inventory.hosts if h.name in hosts and hosts[h.name].get("run_dir")],
    )


def write_back(record: runs.RunRecord, states: dict[str, dict]) -> None:
    """A detached run's end, as status/logs see it on the hosts, goes into its record: per host state and exit
    code, and the run's state once every host has ended (succeeded only if every host exited 0)."""
    changed = False
    for name, st in states.items():
        if st.get("state") in ("exited", "killed") and name in record.data["hosts"]:
            info = record.data["hosts"][name]
            if (info.get("state"), info.get("exit_code")) != (st["state"], st.get("exit_code")):
                info.update(state=st["state"], exit_code=st.get("exit_code"), ended=st.get("ended"))
                changed = True
    every_host = set(states) >= set(record.data["hosts"])  # a host not heard from may still be running
    ended = every_host and all(st.get("state") in ("exited", "killed") for st in states.values())
    if ended and record.data.get("state") in ("running", "starting"):
        ok = all(st.get("state") == "exited" and st.get("exit_code") == 0 for st in states.values())
        bad = next((n for n, st in states.items() if not (st.get("state") == "exited" and st.get("exit_code") == 0)), None)
        record.data.update(state="succeeded" if ok else "failed", failed_host=bad,
                           reason="every host finished" if ok else f"{bad}: {states[bad].get('state')} (exit code {states[bad].get('exit_code')})")
        changed = True
    if changed:
        record.save()


def status(record: runs.RunRecord, fleet: Fleet) -> dict[str, dict]:
    out = {}
    for result in query(record, fleet, "status"):
        if result.ok:
            out[result.host] = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            out[result.host] = {"state": result.status.value, "error": result.error}
    write_back(record, out)
    return out


def collected_states(record: runs.RunRecord) -> dict[str, dict]:
    """Per host state from the collected run directories (exit_code written by the keeper)."""
    out = {}
    for name in record.data["hosts"]:
        run = record.path / name / "run"
        if not run.is_dir():
            continue
        code = (run / "exit_code").read_text().strip() if (run / "exit_code").is_file() else None
        ended = (run / "ended").read_text().strip() if (run / "ended").is_file() else None
        out[name] = {"state": "exited", "exit_code": int(code), "ended": float(ended) if ended else None} if code else {"state": "unknown"}
    return out


def stop(record: runs.RunRecord, fleet: Fleet, grace: float = 10.0) -> dict[str, dict]:
    out = {}
    for result in query(record, fleet, "stop", str(grace)):
        if result.ok:
            out[result.host] = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            out[result.host] = {"state": result.status.value, "error": result.error}
    stopped = all(isinstance(v.get("remaining"), list) and not v["remaining"] for v in out.values())
    if stopped:
        for name in out:
            info = record.data["hosts"].get(name, {})
            if info.get("state") in ("running", "starting"):
                info["state"] = "stopped"
    record.update(state="stopped" if stopped and record.data.get("state") in ("running", "starting") else record.data.get("state"),
                  stop={n: {k: v.get(k) for k in ("killed", "remaining", "gpus_held", "gpus_other", "error")} for n, v in out.items()})
    return out


def summarize(record: runs.RunRecord) -> dict:
    """runs/<id>/summary.json: the run's outcome per host and its training numbers (from the collected logs)."""
    states = collected_states(record)
    hosts = {name: {"node_rank": info.get("node_rank"), "state": states.get(name, {}).get("state", info.get("state")),
                    "exit_code": states.get(name, {}).get("exit_code", info.get("exit_code"))}
             for name, info in record.data["hosts"].items()}
    summary: dict[str, Any] = {"run_id": record.run_id, "job_id": record.data.get("job_id"), "recipe": record.data.get("recipe"),
                               "state": record.data.get("state"), "hosts": hosts, "timings": record.data.get("timings")}
    metrics = rank0_metrics(record)
    if metrics:
        steps, final = read_metrics(metrics)
        summary["metrics_host"] = metrics.parent.parent.name
        if steps:
            summary.update(first_step=steps[0]["step"], last_step=steps[-1]["step"], last_loss=steps[-1]["loss"],
                           skipped_steps=steps[-1].get("skipped_steps"))
        if final:
            summary.update({k: final.get(k) for k in ("initial_loss", "final_loss", "tokens_per_s", "steps", "wall_s")})
    (record.path / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def print_summary(summary: dict, record: runs.RunRecord, console: Console) -> None:
    codes = ", ".join(f"{n} {h['state']}" + (f" ({h['exit_code']})" if h.get("exit_code") is not None else "") for n, h in summary["hosts"].items())
    console.print(f"run {summary['run_id']}: {summary.get('state')}; {codes}", highlight=False)
    if summary.get("final_loss") is not None:
        console.print(f"summary: loss {fmt_loss(summary['initial_loss'])} -> {fmt_loss(summary['final_loss'])}, {summary.get('tokens_per_s') or 0:.0f} tokens/s "
                      f"over {summary.get('steps')} steps", highlight=False)
    elif summary.get("last_step") is not None:
        console.print(f"last step {summary['last_step']}: loss {fmt_loss(summary['last_loss'])}", highlight=False)
    if (record.path / "loss.png").is_file():
        console.print(f"plot: {record.path / 'loss.png'}", highlight=False)
    console.print(f"summary: {record.path / 'summary.json'}", highlight=False)


def merged_tail(record: runs.RunRecord, lines: int, console: Console) -> None:
    """The last lines of every host's collected output, prefixed with host and rank, host after host (output.log
    carries no timestamps, so lines of different hosts cannot be put in time order), then the summary."""
    from mnft.gang import split_rank

    for name, info in record.data["hosts"].items():
        log = record.path / name / "run" / "output.log"
        if not log.is_file():
            console.print(f"[dim]{name}| (no output collected)[/dim]")
            continue
        offset = sum(h["slots"] for h in record.data["inventory"]["hosts"][: info["node_rank"]])
        for text in log.read_text(errors="replace").splitlines()[-lines:]:
            rank, text = split_rank(text, offset)
            label = f"{name} r{rank}" if rank is not None else name
            console.print(Text.assemble((f"{label}| ", "dim"), text), highlight=False, soft_wrap=True)
    write_back(record, collected_states(record))
    print_summary(summarize(record), record, console)


def follow(record: runs.RunRecord, fleet: Fleet, console: Console) -> int:
    """Print every host's output as it arrives until the run ends everywhere (Ctrl-C only stops following):
    lines of all hosts interleaved in arrival order. Ends when each host's run recorded its exit code or no
    process of the run is left there (a keeper killed with SIGKILL records none)."""
    import threading

    from mnft.fleet import HostResult
    from mnft.gang import _parse, split_rank

    hosts = record.data["hosts"]
    codes: dict[str, int | None] = {}
    lock = threading.Lock()

    def one(host: Host):
        info = hosts[host.name]
        offset = sum(h["slots"] for h in record.data["inventory"]["hosts"][: info["node_rank"]])
        process = fleet.start(host, agent_command(fleet, host.name, "tail", info["run_dir"], "20", "--follow"))
        process.write(agent_payload())
        for stream, line in process.stream():
            event = _parse(line)
            if event.get("event") == "exit":
                codes[host.name] = event.get("code")
                if event.get("reason"):
                    with lock:
                        console.print(f"[yellow]{host.name}: {event['reason']}[/yellow]")
            elif stream == "stdout" and event.get("event") == "line":
                rank, text = split_rank(event.get("text", ""), offset)
                label = f"{host.name} r{rank}" if rank is not None else host.name
                with lock:
                    console.print(Text.assemble((f"{label}| ", "dim"), text), highlight=False, soft_wrap=True)
        return HostResult(host.name, Status.OK)

    fleet.map(one, [h for h in fleet.inventory.hosts if h.name in hosts and hosts[h.name].get("run_dir")])
    write_back(record, {n: ({"state": "exited", "exit_code": c} if c is not None else {"state": "killed", "exit_code": None}) for n, c in codes.items()}
               if len(codes) == len(hosts) else {})
    bad = {n: c for n, c in codes.items() if c != 0}
    return ExitCode.FAILED if bad or len(codes) < len(hosts) else ExitCode.OK


def gpu_verdict(result: dict[str, dict], code: int, console: Console | None) -> int:
    """After `stop`: a GPU still held by a process of the run fails the stop; one held by another process is a
    warning (the GPUs are not free for the next run)."""
    held = {n: r["gpus_held"] for n, r in result.items() if r.get("gpus_held")}
    other = {n: r["gpus_other"] for n, r in result.items() if r.get("gpus_other")}
    if console is not None:
        for name, apps in held.items():
            console.print(f"[bold red]{name}: a GPU is still held by the run: {', '.join(apps)}[/bold red]", highlight=False)
        for name, apps in other.items():
            console.print(f"[yellow]{name}: warning: GPUs held by other processes (not this run's): {', '.join(apps)}[/yellow]", highlight=False)
        for name, r in result.items():
            if r.get("gpu_error"):
                console.print(f"[yellow]{name}: warning: could not ask the GPUs: {r['gpu_error']}[/yellow]", highlight=False)
    if held and code == ExitCode.OK:
        return ExitCode.FAILED
    return code
