"""A Slurm run inside its allocation: what the batch script runs (`python -m mnft.slurm.allocation RUN_ID`), and
what `mnft train --slurm` runs in place inside `salloc`.

One attempt (attempt = SLURM_RESTART_COUNT + 1; a requeued job is the next attempt of the same run):

1. the nodes, in `scontrol show hostnames` order, become an inventory (node_rank = position = SLURM_NODEID);
   an earlier attempt's logs are kept apart (runs/<id>/attempt-<k>/);
2. check step: mnft's facts probe on every node in one srun step, judged by the check's rules (same versions as
   the master, torch present, disk, interface, the job's modules importable); a problem refuses the attempt;
3. the master's IPv4 from its facts (mnft's rule: never 127.x); on a resume (a requeued attempt, or --resume) the
   latest complete checkpoint by the job's resume rule;
4. the launch plan of the SSH path; one srun step runs mnft.onhost.slurmnode on every node, which runs mnft's agent with
   its node's launch; its events come back through srun (labelled by task = node), the heartbeats go out through
   srun's stdin (--input=all), so an agent that stops hearing the batch tears its run down;
5. the warning signal (sbatch --signal=B:SIG@N) makes the batch pass the signal to the job's processes (scancel
   --signal, every step, not the batch) until the step ends (mnft's recipes save at the end of the step and stop),
   then requeue the job (`scontrol requeue`) while SLURM_RESTART_COUNT < the run's max requeues; a job that does
   not stop in time is stopped by its agents (15 s before the limit), and resumes from its latest checkpoint;
6. every node's run directory (a shared filesystem: the batch reads it in place) into runs/<id>/<node>/, rank 0's
   metrics into runs/<id>/metrics.jsonl and loss.png, the outcome into run.json.
"""

from __future__ import annotations

import json
import os
import queue
import secrets as _secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.text import Text

from mnft.check.findings import CheckOptions, CheckReport, Need, Problem
from mnft.check.inimage import inside_command, merge
from mnft.check.rules import evaluate, master_address, verified_image_id
from mnft.core import limits
from mnft.core.errors import ExitCode, MnftError
from mnft.core.output import console as make_console
from mnft.hosts import pyrun
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.settings import Host, Inventory
from mnft.image.facts import runtime_setting
from mnft.run import launch, records, recover
from mnft.onhost import queries, runfiles
from mnft.run.control import job_of
from mnft.run.gang import TeardownNoise, _parse, failure_excerpt, split_ranks
from mnft.run.job import Job
from mnft.run.launch import HostLaunch, LaunchOptions
from mnft.run.rerun import snapshot
from mnft.run.train import runtimes_of
from mnft.slurm import cluster, plan

HEARTBEAT_EVERY = 2.0
RESEND_EVERY = 5.0  # seconds between passes of the warning signal to the job until its step ends
STOP_MARGIN = 15.0  # seconds before the time limit the agents stop a job that did not stop on the signal
STEP_START_TIMEOUT = 120.0
INSIDE_TIMEOUT = 120.0  # seconds the probe inside a job's image may take on a node (a container's start included)


class AttemptRefused(MnftError):
    exit_code = ExitCode.FAILED


@dataclass
class NodeRun:
    launch: HostLaunch
    state: str = "starting"  # starting | running | exited | stopped | failed-to-start
    exit_code: int | None = None
    error: str | None = None
    tail: list = field(default_factory=list)
    hidden: int = 0  # lines of its shutdown after another node failed: in its log, not on the terminal
    noise: TeardownNoise = field(default_factory=TeardownNoise)  # torchrun's teardown once its ranks finished: the same


@dataclass
class StepResult:
    code: int  # srun's exit code
    nodes: dict[str, NodeRun]
    saved_on_signal: bool


class Allocation:
    def __init__(self, record: records.RunRecord, console: Console, environ: dict[str, str] | None = None) -> None:
        self.record = record
        self.console = console
        self.environ = dict(os.environ if environ is None else environ)
        self.slurm = record.data["slurm"]
        self.options = plan.SlurmOptions(**{k: tuple(v) if k == "sbatch_args" else v for k, v in self.slurm["options"].items()})
        self.job: Job = job_of(record.data)
        self.signalled: float | None = None
        self.failed_first: str | None = None  # the first node whose torchrun failed: the others' teardown is noise
        self.report: CheckReport | None = None  # the attempt's check: a job in an image builds each node's runtime from it

    # ---------------------------------------------------------------------------------------------- attempt

    def run(self) -> int:
        record, data = self.record, self.record.data
        job_id, nodes = cluster.allocation(self.environ)
        attempt = int(self.environ.get("SLURM_RESTART_COUNT") or 0) + 1
        self.keep_earlier(attempt)
        template = Host(**self.slurm["template"])
        inventory = plan.allocation_inventory(nodes, template, int(self.slurm["port"]))
        resume = bool(data.get("resume")) or attempt > 1
        entry = {"number": attempt, "slurm_job": job_id, "hosts": nodes, "started": time.time(), "resumed": resume,
                 "checkpoint": None, "resumed_step": None}
        data.setdefault("attempts", []).append(entry)
        record.update(state="checking", attempt=attempt, slurm_job_id=job_id, launched=True, inventory=snapshot(inventory))
        self.say(f"run {record.run_id} attempt {attempt}: Slurm job {job_id} on {', '.join(nodes)}")
        t0 = time.monotonic()
        facts = self.check(inventory, entry)
        entry["check_s"] = round(time.monotonic() - t0, 3)
        master_addr, why = master_address(inventory, facts.get(inventory.master_name))
        if master_addr is None:
            return self.refuse(entry, f"cannot tell the master's address ({inventory.master_name}): {why}")
        latest = self.latest_checkpoint(inventory, entry) if resume else None
        env = dict(self.slurm.get("env") or {})
        env["MNFT_SAVE_SIGNAL"] = self.options.signal_name
        env["MNFT_SLURM_JOB_ID"] = job_id
        lopts = LaunchOptions(job=self.job, rdzv=data.get("rdzv") or "static", resume=resume, rdzv_timeout=int(self.slurm.get("rdzv_timeout") or 300))
        try:
            plans = launch.plan(inventory, master_addr=master_addr, port=int(self.slurm["port"]), run_id=record.run_id,
                                job_id=data["job_id"], options=lopts, ifaces={}, env=env, secret_names=(), latest_checkpoint=latest,
                                attempt=attempt, runtimes=runtimes_of(self.report, self.job))
        except MnftError as exc:
            return self.refuse(entry, str(exc))
        record.update(state="running", master_addr=master_addr, rendezvous_port=int(self.slurm["port"]), hosts={
            p.host: {"node_rank": p.node_rank, "rank_offset": p.rank_offset, **p.display(), "output_dir": p.output_dir,
                     "metrics": p.metrics, "collect": list(p.collect), "checkpoints": p.checkpoints,
                     **({"container": p.container} if p.container else {})} for p in plans})
        self.say(f"run {record.run_id}: {self.job.label} on {len(plans)} nodes, world size {inventory.world_size}, "
                 f"master {master_addr}:{self.slurm['port']}" + (f", resuming from {latest}" if latest else ", resuming" if resume else ""))
        result = self.train(inventory, plans, job_id)
        return self.finish(entry, plans, result, job_id, attempt)

    def say(self, text: str, style: str | None = None) -> None:
        self.console.print(Text(text, style=style or ""), soft_wrap=True)

    def refuse(self, entry: dict, why: str) -> int:
        entry.update(ended=time.time(), state="refused", reason=why)
        self.record.update(state="refused", reason=why)
        self.say(f"mnft: run {self.record.run_id} refused: {why}", "bold red")
        return int(ExitCode.FAILED)

    # ---------------------------------------------------------------------------------------------- check

    def script_step(self, inventory: Inventory, name: str, entry: str | None, args: list[str], input: str | None = None,
                    line: dict | None = None) -> tuple[dict[int, list[str]], str]:
        """A host-side script on every node in one srun step (input: on its stdin after its payload; line: another of
        mnft.onhost.slurmnode's lines instead): each task's whole lines, and srun's own output."""
        argv = plan.node_step(inventory.hosts[0].python, len(inventory.hosts), name)
        line = line if line is not None else plan.script_line(str(entry), args, input)
        message = pyrun.payload("slurmnode") + json.dumps(line).encode() + b"\n"
        try:
            done = subprocess.run(argv, input=message, capture_output=True, timeout=300, check=False)
        except subprocess.TimeoutExpired:
            raise AttemptRefused(f"the {name} step did not end within 300 s") from None
        if len(done.stdout) > limits.HOST_OUTPUT_BYTES * len(inventory.hosts):
            raise AttemptRefused(f"the {name} step printed {len(done.stdout)} bytes, more than {limits.size(limits.HOST_OUTPUT_BYTES)} a node "
                                 "(HOST_OUTPUT_BYTES)")
        joined, replies, own = plan.Pieces(), {}, []
        for raw in done.stdout.decode(errors="replace").splitlines():
            whole = joined.feed(raw)
            if whole is None:
                continue
            task, text = whole
            if task is None:
                own.append(text)
            else:
                replies.setdefault(task, []).append(text)
        return replies, "\n".join(own + done.stderr.decode(errors="replace").splitlines())

    def check(self, inventory: Inventory, entry: dict) -> dict[str, dict]:
        """The facts probe on every node in one step, judged by the check's rules; a problem refuses the attempt.
        A job in an image: the image's facts in that step too, then the probe inside the image (`check_image`)."""
        needs = tuple(Need(**n) for n in self.slurm.get("needs") or ())
        template = inventory.hosts[0]
        if self.job.image:
            facts, outcomes = self.check_image(inventory, [n.module for n in needs])
        else:
            replies, own = self.script_step(inventory, "mnft-check", "probe", plan.check_args(template.workdir, [n.module for n in needs]))
            facts, outcomes = {}, {}
            for host in inventory.hosts:
                lines = replies.get(host.rank, [])
                try:
                    facts[host.name] = json.loads(lines[-1])
                    if not isinstance(facts[host.name], dict):
                        raise ValueError("not a JSON object")
                    outcomes[host.name] = HostResult(host.name, Status.OK)
                except (ValueError, IndexError, RecursionError):
                    facts.pop(host.name, None)
                    error = lines[-1] if lines else (own.strip().splitlines()[-1:] or ["no output"])[0]
                    outcomes[host.name] = HostResult(host.name, Status.FAILED, error=f"the probe printed no facts: {error}")
        # a requeued attempt (or a resumed run) judges the image by the id the run's first check verified
        verified = recover.resumed_image_id(self.record.data, self.job.image)
        options = CheckOptions(network=False, code=False, modules=needs, image=self.job.image, image_id=verified)
        report = self.report = CheckReport(inventory, outcomes, facts)
        report.problems = evaluate(inventory, facts, report, options) + unseen_workdir(inventory, facts)
        (self.record.path / f"check-{entry['number']}.json").write_text(json.dumps(report.to_json(), indent=1, default=str))
        bad = [h.name for h in inventory.hosts if report.status(h.name) != Status.OK.value]
        for p in report.problems:
            if p.severity != "error":
                self.say(f"warning: {p.host}: {p.field}: {p.message}", "yellow")
        if bad:
            details = "; ".join(f"{p.host}: {p.field}: {p.message} (fix: {p.fix})" for p in report.problems if p.severity == "error")
            details = details or "; ".join(f"{n}: {outcomes[n].error}" for n in bad)
            self.refuse(entry, f"check failed on {', '.join(bad)} ({details})")
            raise AttemptRefused(f"check failed on {', '.join(bad)} ({details})")
        if self.job.image and verified is None:
            self.record.update(image={"ref": self.job.image, "id": verified_image_id(inventory, facts)})
        self.say(f"check: {len(inventory.hosts)} nodes ok")
        return facts

    def check_image(self, inventory: Inventory, modules: list[str]) -> tuple[dict[str, dict], dict[str, HostResult]]:
        """A job in an image, as `check --image` looks at a host over SSH (mnft.check.inimage), in two steps: every
        node's own facts and the image's there (the probe's image-facts mode, imagehost's facts read in a thread of
        it: runtime, as whom, CDI, GPUs, the image's id), then the probe's Python facts from inside the image on every
        node that has it (each node's command line built from its facts by inimage.inside_command, run by
        mnft.onhost.slurmnode at its SLURM_NODEID). Merged by inimage.merge, so the rules judge the image's Python, torch,
        CUDA, NCCL and the job's modules, and the image's own rules apply (runtime, image there, same id, CDI)."""
        image = str(self.job.image)
        template = inventory.hosts[0]
        request = json.dumps({"runtime": runtime_setting(template), "image": image}) + "\n"
        replies, own = self.script_step(inventory, "mnft-check", "probe", plan.image_check_args(template.workdir), input=request)
        seen = {host.name: image_facts_reply(replies.get(host.rank, []), own) for host in inventory.hosts}
        commands = [inside_command(host, seen[host.name][1], image, modules) if seen[host.name][0] is not None else None
                    for host in inventory.hosts]
        ran: dict[str, dict | None] = {}
        if any(commands):
            inside, own = self.script_step(inventory, "mnft-check-image", None, [], line=plan.command_line(commands, "", INSIDE_TIMEOUT, "probe"))
            ran = {host.name: inside_ran(inside.get(host.rank, []), own) for host, command in zip(inventory.hosts, commands) if command}
        facts, outcomes = {}, {}
        for host in inventory.hosts:
            host_facts, container, container_error = seen[host.name]
            if host_facts is None:
                outcomes[host.name] = HostResult(host.name, Status.FAILED, error=f"the probe printed no facts: {container_error}")
                continue
            facts[host.name] = merge(host_facts, container, image, ran.get(host.name), container_error)
            outcomes[host.name] = HostResult(host.name, Status.OK)
        return facts, outcomes

    # ---------------------------------------------------------------------------------------------- resume

    def latest_checkpoint(self, inventory: Inventory, entry: dict) -> str | None:
        """The newest complete checkpoint by the job's resume rule (mnft.run.checkpoints.choose) over what every
        node lists (the recipes find theirs themselves: layout mnft)."""
        from mnft.run import checkpoints

        rule = self.job.resume
        if rule.layout in ("none", "mnft"):
            return None
        template = inventory.hosts[0]
        values = launch.placeholders(inventory, template, master_addr="", port=0, run_id=self.record.run_id, job_id=self.record.data["job_id"])
        directory = launch.host_path(template, launch.fill(rule.checkpoints, values), self.record.data["job_id"])
        replies, _ = self.script_step(inventory, "mnft-checkpoints", "agent", ["checkpoints", directory])
        listings: dict[str, dict] = {}
        for task, lines in replies.items():
            if task < len(inventory.hosts) and lines:
                try:
                    listing = json.loads(lines[-1])
                except (ValueError, RecursionError):
                    continue
                if isinstance(listing, dict):
                    listings[inventory.hosts[task].name] = listing
        choice = checkpoints.choose(rule, listings)
        entry.update(checkpoint=choice.name, resumed_step=checkpoints.step_of(choice.name))
        self.record.save()
        if choice.name is None:
            self.say(f"no complete checkpoint in {directory}: the job starts from its beginning", "yellow")
        return choice.name

    # ---------------------------------------------------------------------------------------------- the agents' step

    def train(self, inventory: Inventory, plans: list[HostLaunch], job_id: str) -> StepResult:
        template = inventory.hosts[0]
        mark = self.record.path / "slurm-mark"
        token = _secrets.token_hex(8)
        mark.write_text(token + "\n")
        spec_options = LaunchOptions(job=self.job, detach=False)
        launches = [{"node": p.host, "spec": p.spec(launch.attempt_id(self.record.run_id, self.record.data["attempt"]), {}, spec_options)}
                    for p in plans]
        message = {"launches": launches, "agent": plan.payload64("agent"), "save_signal": self.options.signal_name,
                   "mark": {"path": str(mark.resolve()), "token": token}}
        argv = plan.node_step(template.python, len(plans), "mnft-train")
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        events: queue.Queue = queue.Queue()
        runs = {p.host: NodeRun(p) for p in plans}
        names = [p.host for p in plans]
        stop = threading.Event()
        lock = threading.Lock()

        def write(data: bytes) -> None:
            with lock:
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(data)
                    proc.stdin.flush()
                except (OSError, ValueError):
                    pass

        def reader() -> None:
            assert proc.stdout is not None
            joined = plan.Pieces()
            for raw in iter(lambda: proc.stdout.readline(limits.HOST_OUTPUT_BYTES), b""):  # a line without end read in bounded pieces
                whole = joined.feed(raw.decode("utf-8", "replace").rstrip("\n"))
                if whole is not None:
                    events.put(whole)
            events.put(None)

        def heartbeat() -> None:
            while not stop.wait(HEARTBEAT_EVERY):
                write(b"hb\n")

        write(pyrun.payload("slurmnode") + json.dumps(message).encode() + b"\n")
        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=heartbeat, daemon=True).start()
        previous = signal.signal(signal.SIGUSR2 if self.options.signal_name == "USR2" else getattr(signal, "SIG" + self.options.signal_name),
                                 self._on_warning)
        width = max(len(n) for n in names) + 4
        resent = 0.0
        stopped_agents = False
        try:
            while True:
                try:
                    item = events.get(timeout=0.5)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if item:
                    self._event(item, names, runs, width)
                if self.signalled is not None:
                    now = time.monotonic()
                    if now - resent >= RESEND_EVERY:  # until the job's handler is in place and its step ends
                        resent = now
                        subprocess.run(["scancel", f"--signal={self.options.signal_name}", job_id], capture_output=True, timeout=30, check=False)
                    if not stopped_agents and now - self.signalled > max(5.0, self.options.signal_seconds - STOP_MARGIN):
                        stopped_agents = True
                        self.say("the job did not stop on the signal: its agents stop it now (it resumes from its latest checkpoint)", "yellow")
                        write(b"stop\n")
        finally:
            signal.signal(signal.SIGUSR2 if self.options.signal_name == "USR2" else getattr(signal, "SIG" + self.options.signal_name), previous)
            stop.set()
            with lock:
                try:
                    assert proc.stdin is not None
                    proc.stdin.close()
                except (OSError, ValueError):
                    pass
        code = proc.wait()
        return StepResult(code, runs, self.signalled is not None)

    def _on_warning(self, signum, frame) -> None:
        if self.signalled is None:
            self.signalled = time.monotonic()
            self.say(f"Slurm's warning signal ({self.options.signal_name}): the job saves at the end of its step, then the job is requeued",
                     "bold yellow")

    def _event(self, item: tuple[int | None, str], names: list[str], runs: dict[str, NodeRun], width: int) -> None:
        task, text = item
        if task is None or task >= len(names):
            self.say(text)  # srun's own line
            return
        name = names[task]
        run = runs[name]
        event = _parse(text)
        kind = event.get("event")
        if kind == "line":
            for rank, piece in split_ranks(event.get("text", ""), run.launch.rank_offset):
                run.tail = (run.tail + [(rank, piece)])[-200:]
                if self.failed_first is not None and name != self.failed_first:  # srun ends the others: their
                    run.hidden += 1  # torchrun's SignalException tracebacks stay in their logs, as over SSH
                    continue
                if run.noise.hides(rank, piece):
                    continue
                label = f"{name} r{rank}" if rank is not None else name
                self.console.print(Text(f"{label:<{width}}| {piece}"), soft_wrap=True, highlight=False)
        elif kind == "started":
            run.state = "running"
        elif kind == "exit":
            run.state, run.exit_code = "exited", int(event.get("code", 1))
            if run.exit_code != 0 and self.failed_first is None:
                self.failed_first = name
            if said := run.noise.note(f"{self.record.path}/{name}/run/output.log", run.exit_code):
                self.say(f"{name}: {said}", "dim")
        elif kind == "stopped":
            run.state = "stopped"
            try:
                run.exit_code = int(event.get("exit_code")) if event.get("exit_code") is not None else None
            except (TypeError, ValueError):
                run.exit_code = None
        elif kind == "error":
            run.state, run.error = "failed-to-start", event.get("message")
            self.say(f"{name}: {run.error}", "bold red")

    # ---------------------------------------------------------------------------------------------- the end

    def finish(self, entry: dict, plans: list[HostLaunch], result: StepResult, job_id: str, attempt: int) -> int:
        record = self.record
        for name, run in result.nodes.items():
            record.set_host(name, state=run.state, exit_code=run.exit_code, error=run.error,
                            last_lines=[t for _, t in run.tail[-8:]])
        failed = next((n for n, r in result.nodes.items() if r.exit_code not in (0, None) or r.state == "failed-to-start"), None)
        if failed is None and any(r.exit_code is None for r in result.nodes.values()):
            failed = next(n for n, r in result.nodes.items() if r.exit_code is None)
        entry.update(ended=time.time(), srun_exit=result.code)
        self.collect(plans)
        restarts = int(self.environ.get("SLURM_RESTART_COUNT") or 0)
        if result.saved_on_signal and failed is None or result.saved_on_signal and self.options.requeue:
            entry["state"] = "saved"
            if self.options.requeue and restarts < self.options.max_requeues:
                entry["decision"] = f"requeued (restart {restarts + 1} of at most {self.options.max_requeues})"
                record.update(state="requeued", reason=f"saved on Slurm's warning signal before the time limit; {entry['decision']}")
                self.say(f"run {record.run_id}: saved on the warning signal; requeueing Slurm job {job_id}", "bold yellow")
                cluster.run(["scontrol", "requeue", job_id])
                return int(ExitCode.OK)
            why = "saved on Slurm's warning signal; " + ("--requeue not given" if not self.options.requeue else
                                                           f"no requeue left ({restarts} of {self.options.max_requeues})")
            record.update(state="stopped", reason=why + f": continue with mnft train --slurm --resume-run {record.run_id}")
            self.say(f"run {record.run_id} stopped: {why}", "bold yellow")
            return int(ExitCode.FAILED)
        if failed is None and result.code == 0:
            entry["state"] = "succeeded"
            record.update(state="succeeded", reason="every node finished", ended=time.time())
            self.say(f"run {record.run_id} finished on every node; logs in {record.path}", "green")
            return int(ExitCode.OK)
        run = result.nodes.get(failed) if failed else None
        reason = (f"{failed}: " + (run.error or f"torchrun exited with code {run.exit_code}") if run is not None
                  else f"the agents' step failed (srun exit {result.code})")
        if self.options.requeue:  # the same causes as over SSH decide a restart (mnft.run.recover), within --max-restarts
            cause, decision = self.classify(failed, run)
            entry.update(cause=cause.to_json(), decision=decision.why, counted=decision.counted if decision.restart else None)
            if decision.restart and restarts < self.options.max_requeues:
                entry.update(state="failed", reason=reason)
                record.update(state="requeued", reason=f"attempt {attempt} failed: {cause.detail}; requeued ({decision.why})")
                self.say(f"run {record.run_id} attempt {attempt} failed: {cause.detail}; requeueing Slurm job {job_id} ({decision.why})", "bold yellow")
                cluster.run(["scontrol", "requeue", job_id])
                return int(ExitCode.OK)
            reason += f" ({decision.why})" if not decision.restart else f" (no requeue left: {restarts} of {self.options.max_requeues})"
        entry.update(state="failed", reason=reason)
        record.update(state="failed", reason=reason, failed_host=failed, ended=time.time())
        self.say(f"run {record.run_id} failed: {reason}", "bold red")
        for _, text in (run.tail[-8:] if run is not None else []):
            self.say(f"  {failed}| {text}")
        for name, other in result.nodes.items():
            if other.hidden:
                self.say(f"{name}: stopped with the gang ({other.hidden} line(s) of its shutdown in {record.path}/{name}/run/output.log)", "dim")
        return int(ExitCode.FAILED)

    def classify(self, failed: str | None, run: "NodeRun | None") -> tuple[recover.Cause, recover.Decision]:
        """Why the attempt failed, as the SSH path tells it (mnft.run.recover.classify over the failed node's tail), and
        whether to restart it by the same rules, this run's earlier attempts counted."""
        summary = self.record.data.get("summary") or {}
        tail = [text for _, text in run.tail] if run is not None else []
        _, trace = failure_excerpt(list(run.tail)) if run is not None else (None, [])
        loss = summary.get("last_loss")
        seen = recover.Seen(failed_host=failed, host_state="lost" if run is None or run.exit_code is None and run.state != "failed-to-start"
                            else run.state, exit_code=run.exit_code if run is not None else None, tail=tuple(tail), traceback=tuple(trace),
                            first_step=summary.get("last_step") is not None, last_step=summary.get("last_step"),
                            last_loss=float(loss) if isinstance(loss, (int, float)) else None, resume_codes=self.job.resume.exit_codes)
        cause = recover.classify(seen)
        history = [recover.Attempt(int(a.get("number") or 0), tuple(a.get("hosts") or ()), recover.Cause(**a["cause"]), bool(a.get("counted")))
                   for a in (self.record.data.get("attempts") or [])[:-1] if isinstance(a.get("cause"), dict)]
        return cause, recover.should_restart(recover.Policy(max_restarts=self.options.max_requeues), history, cause)

    def collect(self, plans: list[HostLaunch]) -> None:
        collect_run(self.record, self.say, plans)

    def keep_earlier(self, attempt: int) -> None:
        """Before attempt k: attempt k-1's logs collected (a node failure ended its batch before it could) and
        moved to runs/<id>/attempt-<k-1>/, as the SSH path keeps a failed attempt's."""
        from mnft.run.logs import attempt_dir

        data = self.record.data
        earlier = [a for a in data.get("attempts") or [] if a.get("number", 0) < attempt]
        if not earlier or not data.get("hosts"):
            return
        last = earlier[-1]
        if last.get("ended") is None:  # ended by Slurm (node failure, requeue): its run directories are still there
            last.update(ended=time.time(), state=last.get("state") or "ended by Slurm (node failure or requeue)")
            launches = [_launch_of(name, info) for name, info in data["hosts"].items()]
            self.collect(launches)
        dest = attempt_dir(self.record, last["number"])
        dest.mkdir(exist_ok=True)
        for name in data["hosts"]:
            if (self.record.path / name).is_dir():
                shutil.rmtree(dest / name, ignore_errors=True)
                shutil.move(str(self.record.path / name), str(dest / name))
        self.record.save()


def image_facts_reply(lines: list[str], own: str) -> tuple[dict | None, dict | None, str | None]:
    """A node's answer in the check step of a job in an image (the probe's image-facts mode): (its own facts, the
    image's facts, why the image's are missing); its facts None (and why, third) when it printed none."""
    host_facts, container, error, got_container = None, None, None, False
    for text in lines:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        if "facts" in data:
            host_facts = data["facts"] if isinstance(data["facts"], dict) else None
        if "container" in data:
            container, error, got_container = data["container"], data.get("container_error"), True
    if host_facts is None:
        last = lines[-1] if lines else (own.strip().splitlines()[-1:] or ["no output"])[0]
        return None, None, last
    if not got_container:
        error = "the probe sent no facts of the image"
    return host_facts, container, error


def inside_ran(lines: list[str], own: str) -> dict:
    """A node's answer in the step that runs the probe inside the image: what inimage.inside_reply reads (the
    command's exit code and output), or why there is none."""
    for text in reversed(lines):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict) and isinstance(data.get("ran"), dict):
            return data["ran"]
    last = lines[-1] if lines else (own.strip().splitlines()[-1:] or ["no output"])[0]
    return {"exit_code": None, "error": f"the node did not say how the probe inside the image ended: {last}"}


def unseen_workdir(inventory: Inventory, facts: dict[str, dict]) -> list[Problem]:
    """A node on which the run's workdir does not exist (the probe measured the disk of a parent: mnft.onhost.probe
    `_disk`): it does not see the filesystem the login node synced the code to, and nothing mnft could sync would
    reach it. Said in the check, before anything starts, with what to do under Slurm."""
    problems = []
    for host in inventory.hosts:
        disk = (facts.get(host.name) or {}).get("disk") or {}
        if disk.get("workdir") and disk.get("path") and disk["path"] != disk["workdir"]:
            problems.append(Problem(host.name, "workdir", f"{disk['workdir']} does not exist on this node: the nodes do not see the "
                                    "login node's workdir (it is not on a filesystem every node shares)",
                                    "set `workdir:` (in the --hosts inventory) to a directory on the shared filesystem, e.g. /shared/$USER/mnft; "
                                    "see docs/slurm.md"))
    return problems


def collect_run(record: records.RunRecord, say, launches: list[HostLaunch] | None = None) -> None:
    """Every node's run directory (on the shared filesystem) into runs/<id>/<node>/, the job's metrics files
    under <node>/extra/<i>/, then rank 0's metrics and loss.png (mnft.run.logs). launches: the attempt's (default:
    the ones the record holds)."""
    from mnft.run import logs

    if launches is None:
        launches = [_launch_of(name, info) for name, info in (record.data.get("hosts") or {}).items() if info.get("run_dir")]
    for p in launches:
        dest = record.path / p.host
        source = Path(os.path.expanduser(p.run_dir))
        if source.is_dir():
            shutil.copytree(source, dest / "run", dirs_exist_ok=True, ignore=shutil.ignore_patterns(runfiles.PAYLOAD_NAME, "secrets.json"))
        for index, pattern in enumerate(p.collect):
            for path, name in queries._extra_files(pattern):
                target = dest / "extra" / str(index) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    shutil.copyfile(path, target)
                except OSError:
                    continue
    try:
        metrics = logs.run_metrics(record)
        if metrics.steps:
            logs.plot(metrics.steps, record.path / "loss.png", f"{record.run_id}: loss", logs.restarts(record.data))
        record.update(summary={"last_step": metrics.steps[-1].get("step") if metrics.steps else None,
                               "last_loss": metrics.steps[-1].get("loss") if metrics.steps else None, "source": metrics.source})
    except Exception as exc:  # noqa: BLE001 - metrics that cannot be read must not hide the run's outcome
        say(f"metrics were not collected: {exc}", "yellow")


def _launch_of(name: str, info: dict) -> HostLaunch:
    """Enough of a recorded host launch to collect its run directory again."""
    return HostLaunch(host=name, node_rank=int(info.get("node_rank", 0)), rank_offset=int(info.get("rank_offset", 0)), slots=1,
                      argv=(), env={}, secret_names=(), cwd=info.get("cwd", ""), run_dir=info["run_dir"], output_dir=info.get("output_dir", ""),
                      metrics=info.get("metrics"), collect=tuple(info.get("collect") or ()))


def main(argv: list[str] | None = None) -> int:
    """`python -m mnft.slurm.allocation RUN_ID`: the batch script's one command."""
    args = sys.argv[1:] if argv is None else argv
    console = make_console()
    if len(args) != 1:
        console.print("usage: python -m mnft.slurm.allocation RUN_ID", highlight=False)
        return int(ExitCode.BAD_INPUT)
    try:
        record = records.load(args[0])
        return Allocation(record, console).run()
    except AttemptRefused:
        return int(ExitCode.FAILED)
    except MnftError as exc:
        console.print(Text(f"mnft: {exc}"), soft_wrap=True)
        return int(exc.exit_code)


if __name__ == "__main__":
    sys.exit(main())
