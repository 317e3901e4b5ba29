"""A started run, afterwards: `invoke status` and `invoke stop` (by run id, on every host of the run), and what they
learn written back into the run record (a detached run has no controller to record its end)."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.text import Text

from mnft.core import limits
from mnft.core.errors import ExitCode, InputError
from mnft.core.output import command
from mnft.hosts import leases, pyrun
from mnft.hosts.fleet import Fleet
from mnft.run import records
from mnft.run.gang import agent_command, agent_payload, split_rank, split_ranks
from mnft.run.job import Job, from_record, recipe_job
from mnft.run.scrape import for_job_output


def job_of(data: dict) -> Job:
    """The job a run record ran (a record from before jobs: its recipe and overrides)."""
    if data.get("job"):
        return from_record(data["job"])
    return replace(recipe_job(data.get("recipe") or "lora"), extra_args=tuple(data.get("overrides") or ()))


def rank_offset(data: dict, host: str) -> int:
    """Global rank of the host's local rank 0 under static rendezvous (its position in the inventory)."""
    return sum(h["slots"] for h in data["inventory"]["hosts"][: data["hosts"][host]["node_rank"]])


def query(record: records.RunRecord, fleet: Fleet, mode: str, *args: str, only: set[str] | None = None):
    hosts = record.data["hosts"]
    return fleet.run(
        lambda host: agent_command(fleet, host.name, mode, hosts[host.name]["run_dir"], *args),
        stdin=agent_payload(),
        hosts=[h for h in fleet.inventory.hosts if h.name in hosts and hosts[h.name].get("run_dir") and (only is None or h.name in only)],
    )


def runs_lease(run_id: str, named) -> bool:
    """Whether a lease naming `named` is this run's (any attempt of it)."""
    return isinstance(named, str) and bool(named) and (run_id == named or run_id.startswith(named + "-a") or named.startswith(run_id + "-a"))


ENDED = ("exited", "killed", "stopped")  # a host's states of a run that ended there (stopped: by `mnft stop`)


def write_back(record: records.RunRecord, states: dict[str, dict]) -> None:
    """A detached run's end, as status/logs see it on the hosts, goes into its record: per host state and exit
    code, and the run's state once every host has ended (succeeded only if every host exited 0)."""
    changed = False
    for name, st in states.items():
        if st.get("state") in ENDED and name in record.data["hosts"]:
            info = record.data["hosts"][name]
            if (info.get("state"), info.get("exit_code")) != (st["state"], st.get("exit_code")):
                info.update(state=st["state"], exit_code=st.get("exit_code"), ended=st.get("ended"))
                changed = True
    every_host = set(states) >= set(record.data["hosts"])  # a host not heard from may still be running
    ended = every_host and all(st.get("state") in ENDED for st in states.values())
    if ended and record.data.get("state") in ("running", "starting"):
        ok = all(st.get("state") == "exited" and st.get("exit_code") == 0 for st in states.values())
        bad = next((n for n, st in states.items() if not (st.get("state") == "exited" and st.get("exit_code") == 0)), None)
        idle = next(((n, st["reason"]) for n, st in states.items() if st.get("reason")), None)  # its keeper ended it (idle GPUs)
        stopped = next((st["stopped_by"] for st in states.values() if st.get("state") == "stopped"), None)
        if stopped is not None:  # `mnft stop` ended it (its hosts marked it before any signal): on purpose, not failed
            record.data.update(state="stopped", failed_host=None, reason=f"stopped by `{stopped}`")
        elif idle is not None:
            record.data.update(state="idle-stopped", failed_host=idle[0], reason=f"{idle[0]}: {idle[1]}")
        elif ok:
            record.data.update(state="succeeded", failed_host=None, reason="every host finished")
        else:
            code = states[bad].get("exit_code")
            meaning = exit_meaning(job_of(record.data), code)
            record.data.update(state="resumable" if meaning else "failed", failed_host=bad,
                               reason=f"{bad}: {states[bad].get('state')} (exit code {code}{': ' + meaning if meaning else ''})")
        changed = True
    if changed:
        record.save()


def exit_meaning(job: Job, code: int | None) -> str | None:
    """What the job says an exit code means: its "stopped on its own timer, resume me" codes (VILA's 124)."""
    if code is not None and code in job.resume.exit_codes:
        return f"the job stopped on its own and asks to be resumed ({command('train --resume')})"
    return None


def last_metric(data: dict, host: str, state: dict) -> dict | None:
    """The last training step a host's agent saw: in the metrics file's lines, else in rank 0's output lines."""
    job = job_of(data)
    if job.metrics.format == "none":
        return None
    parse = for_job_output(job.metrics.format, job.metrics.regex)
    for line in reversed(state.get("metric_lines") or []):
        found = parse(line)
        if found and "loss" in found:
            return found
    offset = rank_offset(data, host) if host in data.get("hosts", {}) and data.get("inventory") else 0
    bar = None  # HF's training bar, newer than the record: the step of a record that carries none, about
    for line in reversed(state.get("output_lines") or []):
        for rank, text in reversed(split_ranks(line, offset)):
            if rank == 0:
                found = parse(text)
                if found and found.get("event") == "progress" and bar is None:
                    bar = found
                elif found and "loss" in found:
                    return dict(found, step=bar["step"], step_about=True) if found.get("step") is None and bar else found
    return None


LIVE_FRESH_S = 30.0  # live.json older than this: its supervisor is gone (killed without cleaning up)


def supervisor(record: records.RunRecord, now: float | None = None) -> dict | None:
    """What the run's attached supervisor (`invoke train` still running) says now: its attempt, hosts and the
    stragglers it names over a sustained window (mnft.run.train.Live); None without one."""
    import time

    try:  # written whole (renamed into place) by the supervisor; read within limits
        live = limits.read_json(record.path / "live.json", limits.STATE_BYTES, "supervisor's state (live.json)", "STATE_BYTES", missing=None)
    except limits.TooLarge:
        raise
    except InputError:
        return None  # unreadable or not JSON (a supervisor killed mid-write): none to believe
    if not isinstance(live, dict) or (now or time.time()) - float(live.get("updated") or 0) > LIVE_FRESH_S:
        return None
    return live


def status(record: records.RunRecord, fleet: Fleet, lines: int = 0) -> dict[str, dict]:
    """Each host's state, its last metrics, the devices the run holds there (mnft.hosts.leases), and whether it is the gang's
    straggler: as the run's supervisor names
    them when one is attached (sustained over several samples), else from the hosts' samples now (mnft.run.straggler,
    over the ranks' recent steps and the hosts' utilisation). lines: also the host's last output lines, each as
    [global rank or None, text] (`mnft board`)."""
    from mnft.run import straggler

    out = {}
    queried = query(record, fleet, "status")
    views = leases.lab(fleet, [fleet.inventory.host(name) for name in queried.by_host])  # who holds each host's devices now
    for result in queried:
        state = pyrun.reply(result, "the agent")  # a reply that is not JSON fails the host, in one line
        if state is not None:
            metric = last_metric(record.data, result.host, state)
            state.pop("metric_lines", None)
            output = state.pop("output_lines", None) or []
            state["last_metric"] = metric
            state["last_line"] = split_rank(output[-1], 0)[1] if output else None
            if state.get("state") == "stopped":  # its last lines are its shutdown (torchrun's SIGTERM traceback): in its log
                state["last_line"] = f"stopped by `{state.get('stopped_by')}` (its shutdown is in the host's output.log)"
            if lines:
                offset = rank_offset(record.data, result.host)
                state["lines"] = [list(piece) for line in output for piece in split_ranks(line, offset)][-lines:]
            meaning = exit_meaning(job_of(record.data), state.get("exit_code"))
            if meaning:
                state["meaning"] = meaning
            out[result.host] = state
        else:
            out[result.host] = {"state": result.status.value, "error": result.error}
        mine = [d for d in (views.get(result.host) or {}).get("devices") or []
                if d.get("state") == "held" and runs_lease(record.run_id, (d.get("holder") or {}).get("run_id"))]
        if mine:
            out[result.host]["lease"] = mine[0].get("holder") or {}
            out[result.host]["devices"] = [d.get("index") for d in mine]
    live = supervisor(record)
    if live is not None:
        for found in live.get("stragglers") or []:
            if found.get("host") in out:
                out[found["host"]]["straggler"] = found
        return out  # the supervisor records the run's end itself (and between attempts every host has ended)
    for found in straggler.find({h: st["sample"] for h, st in out.items() if st.get("sample")}):
        out[found.host]["straggler"] = found.to_json()
    write_back(record, out)
    return out


def stop(record: records.RunRecord, fleet: Fleet, grace: float = 10.0) -> dict[str, dict]:
    """Each host's agent stops the run (only what is provably the run's: mnft.onhost.runprocs.terminate). A run ended on
    every host is left as recorded: stopping it is a no-op that says so (mnft.run.report.print_stop)."""
    import getpass
    import os
    import socket

    records.request_stop(record, f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}")
    out: dict[str, dict] = {}
    lingering: set[str] | None = None  # the first round asks every host
    asked: dict[str, int] = {}  # host -> the rounds it was asked in
    for _ in range(STOP_ROUNDS):
        session = ("session",) if record.data.get("kind") == "session" else ()  # its reason written before any signal
        for result in query(record, fleet, "stop", str(grace), *session, only=lingering):
            reply = pyrun.reply(result, "the agent")
            if result.host in out:  # asked again: what it killed before still counts, what remains is now
                out[result.host] = again(out[result.host], reply) if reply is not None else dict(out[result.host], error=result.error)
            else:
                out[result.host] = reply if reply is not None else {"state": result.status.value, "error": result.error}
        for name in (lingering if lingering is not None else out):
            asked[name] = asked.get(name, 0) + 1
        lingering = {n for n, v in out.items() if isinstance(v.get("remaining"), list) and v["remaining"]}
        if not lingering:
            break
    for name, rounds in asked.items():
        out[name]["asked"] = rounds
    stopped = all(isinstance(v.get("remaining"), list) and not v["remaining"] for v in out.values())
    if out and all(v.get("ended") for v in out.values()):  # nothing of the run was alive anywhere: a no-op
        return out
    if stopped:
        for name, v in out.items():
            info = record.data["hosts"].get(name, {})
            if info.get("state") in ("running", "starting") and not v.get("ended"):
                info["state"] = "stopped"
    record.update(state="stopped" if stopped and record.data.get("state") in ("running", "starting") else record.data.get("state"),
                  stop={n: {k: v.get(k) for k in ("killed", "remaining", "gpus_held", "gpus_other", "error", "ended", "asked")} for n, v in out.items()})
    return out


# rounds of `agent stop` on a host whose killed processes are not gone yet: 64 torchrun trees SIGKILLed on 2 busy
# cores can take longer to be freed than one round's settle (mnft.onhost.runprocs.KILL_SETTLE); each round kills again
# whatever of the run is left and waits for it. A process SIGKILLed is going: stop waits for it rather than calling
# it remaining, and says remaining only of what outlived every round.
STOP_ROUNDS = 4


def again(first: dict, later: dict) -> dict:
    """A host's stop reply after it was asked again: every pid killed in either round, what remains after the later
    one (a later round that found the run ended has killed nothing more: the host's run did not end by itself)."""
    killed = list(dict.fromkeys([*(first.get("killed") or []), *(later.get("killed") or [])]))
    return dict(later, killed=killed, ended=bool(first.get("ended")) and bool(later.get("ended")))


def gpu_verdict(result: dict[str, dict], code: int, console: Console | None) -> int:
    """After `stop`: a GPU still held by a process of the run fails the stop; one held by another process is a
    warning (the GPUs are not free for the next run)."""
    held = {n: r["gpus_held"] for n, r in result.items() if r.get("gpus_held")}
    other = {n: r["gpus_other"] for n, r in result.items() if r.get("gpus_other")}
    if console is not None:
        for name, apps in held.items():
            console.print(Text(f"{name}: a GPU is still held by the run: {', '.join(apps)}", style="bold red"))
        for name, apps in other.items():
            console.print(Text(f"{name}: warning: GPUs held by your other processes (not this run's): {', '.join(apps)}", style="yellow"))
        for name, r in result.items():
            if r.get("gpu_error"):
                console.print(Text(f"{name}: warning: could not ask the GPUs: {r['gpu_error']}", style="yellow"))
    if held and code == ExitCode.OK:
        return ExitCode.FAILED
    return code
