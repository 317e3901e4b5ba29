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
from mnft.gang import Gang, GangInterrupted, GangResult, agent_command, agent_payload
from mnft.inventory import Host, Inventory
from mnft.launch import LaunchOptions


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


class Display:
    """Live output: each line prefixed with host and rank; rank 0's metrics as a progress line."""

    def __init__(self, console: Console, width: int) -> None:
        self.console = console
        self.width = width
        self.last_metric: dict = {}

    def line(self, host: str, rank: int | None, text: str) -> None:
        label = f"{host} r{rank}" if rank is not None else f"{host}"
        self.console.print(Text.assemble((f"{label:<{self.width}}| ", "dim"), text), highlight=False, soft_wrap=True)

    status = None  # a rich Status line, on a terminal

    def metric(self, data: dict) -> None:
        if "step" in data:
            self.last_metric = data
            if self.status is not None and isinstance(data.get("loss"), (int, float)):
                self.status.update(
                    f"step {data['step']}  loss {data['loss']:.4f}  {data.get('tokens_per_s', 0):.0f} tokens/s  "
                    f"skipped {data.get('skipped_steps', 0)}"
                )
        elif data.get("event") == "summary":
            self.console.print(
                f"[bold]summary[/bold]: loss {data.get('initial_loss'):.4f} -> {data.get('final_loss'):.4f}, "
                f"{data.get('tokens_per_s', 0):.0f} tokens/s over {data.get('steps')} steps"
            )


def train(inventory: Inventory, options: TrainOptions, console: Console) -> int:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    lopts = options.launch
    job_id = None
    if options.resume_run is not None or lopts.resume:
        previous = runs.load(options.resume_run or None)
        job_id = previous.data.get("job_id", previous.run_id)
        lopts = replace(lopts, resume=True, recipe=previous.data.get("recipe", lopts.recipe))
    launching.parse_overrides(lopts.overrides)  # bad input fails before any host is touched
    env, secrets = launching.split_env(lopts.env, launching.environ())
    with Fleet(inventory) as fleet:
        report = checks.gather(fleet, replace(options.check, find_free_port=True))
        timings["check_s"] = round(time.monotonic() - t0, 3)
        bad = [h.name for h in inventory.hosts if report.status(h.name) != Status.OK.value]
        if bad and not options.force:
            from mnft.report import print_check

            print_check(report, as_json=False)
            details = "; ".join(
                f"{p.host}: {p.field}: {p.message}" for p in report.problems if p.severity == "error"
            ) or "; ".join(f"{n}: {report.outcomes[n].error}" for n in bad if report.outcomes[n].error)
            error = RunFailed(f"check failed on {', '.join(bad)} ({details}); fix it or pass --force")
            error.exit_code = report.exit_code()
            raise error
        if report.master_addr is None:
            raise RunFailed(f"cannot tell the master's address: {next((p.message for p in report.problems if p.field == 'master_addr'), 'unknown')}")
        run_id = launching.new_run_id()
        job_id = job_id or run_id
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
        code_hash = None
        if options.sync:
            t_sync = time.monotonic()
            code_hash = sync_code(inventory, options.src, fleet)
            timings["sync_s"] = round(time.monotonic() - t_sync, 3)
        record = runs.RunRecord.create(
            run_id,
            job_id=job_id,
            recipe=lopts.recipe,
            overrides=list(lopts.overrides),
            resume=lopts.resume,
            detach=lopts.detach,
            inventory=snapshot(inventory),
            facts=report.facts,
            master_addr=report.master_addr,
            rendezvous_port=port,
            code_hash=code_hash,
            hosts={p.host: {"node_rank": p.node_rank, **p.display(), "output_dir": p.output_dir, "metrics": p.metrics} for p in plans},
            timings=timings,
            state="starting",
        )
        console.print(f"run [bold]{run_id}[/bold]: {len(plans)} hosts, world size {inventory.world_size}, master {report.master_addr}:{port}")
        display = Display(console, max(len(h.name) for h in inventory.hosts) + 4)
        gang = Gang(fleet, plans, run_id, lopts, secrets, on_line=display.line, on_metric=display.metric)
        t_launch = time.monotonic()
        gang.start()
        timings["launch_s"] = round(time.monotonic() - t_launch, 3)
        for p in plans:
            record.set_host(p.host, state="running", started=gang.runs[p.host].started_at)
        if lopts.detach:
            record.update(state="running", timings=timings)
            console.print(f"detached: follow with `invoke logs -f {run_id}`, stop with `invoke stop {run_id}`")
            print(run_id)
            return ExitCode.OK
        try:
            with console.status("waiting for the first step…") as display.status:
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

    report = sync.sync_code(inventory, src or Path.cwd(), fleet=fleet)
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
    metrics = [p for p in record.path.glob("*/extra/metrics.jsonl")]
    if metrics:
        plot(metrics[0], record.path / "loss.png")
    if not quiet:
        for name, state in outcome.items():
            console.print(f"{name}: {state}")
    return outcome


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
    ax.plot(xs, [s["loss"] for s in steps], color="tab:blue", label="loss")
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
        hosts=[h for h in fleet.inventory.hosts if h.name in hosts],
    )


def status(record: runs.RunRecord, fleet: Fleet) -> dict[str, dict]:
    out = {}
    for result in query(record, fleet, "status"):
        if result.ok:
            out[result.host] = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            out[result.host] = {"state": result.status.value, "error": result.error}
    return out


def stop(record: runs.RunRecord, fleet: Fleet, grace: float = 10.0) -> dict[str, dict]:
    out = {}
    for result in query(record, fleet, "stop", str(grace)):
        if result.ok:
            out[result.host] = json.loads(result.stdout.strip().splitlines()[-1])
        else:
            out[result.host] = {"state": result.status.value, "error": result.error}
    stopped = all(isinstance(v.get("remaining"), list) and not v["remaining"] for v in out.values())
    record.update(state="stopped" if stopped else record.data.get("state"))
    return out


def merged_tail(record: runs.RunRecord, lines: int, console: Console) -> None:
    """The last lines of every host's collected output, prefixed with host and rank."""
    for name, info in record.data["hosts"].items():
        log = record.path / name / "run" / "output.log"
        if not log.is_file():
            console.print(f"[dim]{name}| (no output collected)[/dim]")
            continue
        offset = sum(h["slots"] for h in record.data["inventory"]["hosts"][: info["node_rank"]])
        from mnft.gang import RANK_PREFIX

        for text in log.read_text(errors="replace").splitlines()[-lines:]:
            match = RANK_PREFIX.match(text)
            label = f"{name} r{offset + int(match.group(1))}" if match else name
            console.print(Text.assemble((f"{label}| ", "dim"), match.group(2) if match else text), highlight=False, soft_wrap=True)
    steps = list(record.path.glob("*/extra/metrics.jsonl"))
    if steps:
        data, summary = read_metrics(steps[0])
        if summary:
            console.print(f"summary: loss {summary.get('initial_loss'):.4f} -> {summary.get('final_loss'):.4f}, {summary.get('tokens_per_s', 0):.0f} tokens/s")
        elif data:
            console.print(f"last step {data[-1]['step']}: loss {data[-1]['loss']:.4f}")
        console.print(f"plot: {record.path / 'loss.png'}")


def follow(record: runs.RunRecord, fleet: Fleet, console: Console) -> int:
    """Print every host's output as it comes until the run ends everywhere (Ctrl-C only stops following)."""
    import threading

    from mnft.gang import RANK_PREFIX, _parse

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
            elif stream == "stdout" and event.get("event") == "line":
                text = event.get("text", "")
                match = RANK_PREFIX.match(text)
                label = f"{host.name} r{offset + int(match.group(1))}" if match else host.name
                with lock:
                    console.print(Text.assemble((f"{label}| ", "dim"), match.group(2) if match else text), highlight=False, soft_wrap=True)
        from mnft.fleet import HostResult

        return HostResult(host.name, Status.OK)

    fleet.map(one, [h for h in fleet.inventory.hosts if h.name in hosts])
    bad = {n: c for n, c in codes.items() if c != 0}
    return ExitCode.FAILED if bad else ExitCode.OK
