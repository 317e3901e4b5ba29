"""`mnft shell`: an interactive session on leased GPUs (docs/lab.md, "Interactive sessions").

It takes G free GPUs on one host (`--host`, else the first host of the inventory where they are free; the
fastest-linked G there, as a run's are picked) under a lease of its own (command `shell`), records itself as a
run record of kind `session` (so `mnft stop SESSION` and `mnft status SESSION` work on it as on a run), and opens a
terminal there (mnft.hosts.terminal) on the same verified connection as every other command. On the host the
session's keeper (mnft.onhost.agent `session`) runs the login shell, or the command after `--`, in the inventory's
workdir with CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER set to the leased GPUs; it holds the leases and ends every
process of the session when it ends. A second channel (`watch`) carries this controller's heartbeats: when they
stop (the controller or its network gone), the host ends the session within the dead-man time.

With `--image REF` the keeper's program is the host's container runtime running the shell (or the command) inside
the lab's image, exactly as train runs a job in one (mnft.image.runtime): the runtime and the image's id are read
from the host as `check --image` reads them (mnft.image.facts, judged by check's own image rules), the container
is given the session's GPUs (CUDA_VISIBLE_DEVICES as it numbers them), the workdir mounted at its own path and
used as the working directory, the session's environment by name, the user's uid; it is named after the session
(mnft-<session>-<host>) and removed by that name at every end (the keeper's, `stop`'s and the dead-man's).
"""

from __future__ import annotations

import json
import posixpath
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from mnft.check.rules import image_problems
from mnft.core.errors import InputError
from mnft.hosts import leases, pyrun
from mnft.hosts.command import Command
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host, Inventory
from mnft.hosts.terminal import forward, interact, open_terminal
from mnft.image import facts as image_facts
from mnft.image import runtime as containers
from mnft.run import notify as notifying
from mnft.run import records
from mnft.run.gang import agent_command, agent_payload
from mnft.run.launch import KEEPER_ENV, new_run_id
from mnft.run.rerun import snapshot

IDLE_REASON = "its GPUs were idle for"  # how the keeper's reason begins (mnft.onhost.watches.IdleWatch)
# the host user's own shell, as a login shell; a POSIX one (sh, bash, zsh, ksh, dash) then puts the environment a run gets
# first on PATH (MNFT_PATH_FIRST: the login profile sets PATH anew) and goes on as an interactive shell (its rc file read)
LOGIN_SHELL = ("/bin/sh", "-c", 'case "${SHELL##*/}" in sh|bash|zsh|ksh|dash) exec "${SHELL}" -l -c '
               '\'[ -n "$MNFT_PATH_FIRST" ] && PATH="$MNFT_PATH_FIRST:$PATH" && export PATH; exec "$SHELL" -i\';; '
               '*) exec "${SHELL:-/bin/sh}" -l;; esac')
# in an image the host's $SHELL may not exist: its bash where it has one, else its sh, as a login shell
IMAGE_LOGIN_SHELL = ("/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l")
IMAGE_ENV = ("TERM",)  # the terminal's kind (ssh's pty request) goes in with the session's own variables: colours


@dataclass(frozen=True)
class ShellOptions:
    gpus: int = 1
    host: str | None = None
    wait: float | None = None  # seconds to wait in line (inf: as long as it takes); None: do not wait
    time: float | None = None  # seconds the session may last
    idle_stop: float | None = None  # end it once its GPUs have all been idle this long
    forward: int | None = None  # a port on the host carried to this machine
    argv: tuple[str, ...] = ()  # the command instead of a shell
    notify: notifying.Notify | None = None  # --notify CMD: told when it starts after waiting in line and when it ends
    image: str | None = None  # --image REF: the session runs inside the lab's container image
    src: str | None = None  # the code the session opens in (as train's --src; default the repository around the cwd)
    code: bool = True  # place the code as train places a run's; False: the inventory's workdir as it is (--no-code)


def outcome(code: int | None, reason: str | None) -> str:
    """A session's end as its record names it: ended (its program exited: the shell's exit), stopped (mnft stop),
    timed-out (--time), idle-stopped (--idle-stop), lost (the controller's connection gone)."""
    why = reason or ""
    if why.startswith("stopped"):
        return "stopped"
    if "--time" in why:
        return "timed-out"
    if why.startswith(IDLE_REASON):  # --idle-stop, or the lab's idle_stop
        return "idle-stopped"
    if why:
        return "lost"
    return "ended"


def spec_for(session_id: str, host: Host, argv: tuple[str, ...], devices: list[int], paths: list[str], options: ShellOptions,
             runtime: containers.Runtime | None = None, cwd: str | None = None) -> dict:
    """What the host's keeper runs (mnft.onhost.agent `session`): pure, tested with data. With a runtime (--image),
    the program is the runtime's interactive `run` of it in the image (in_image)."""
    run_dir = host.workdir.rstrip("/") + f"/runs/{session_id}/{host.name}"
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "MNFT_SESSION": session_id}
    program, container = list(argv or LOGIN_SHELL), None
    if runtime is not None and options.image:
        program, env, container = in_image(runtime, options.image, session_id, host, argv, devices, env, cwd)
    spec = {"run_id": session_id, "tag": f"{session_id}@{host.name}", "run_dir": run_dir, "cwd": cwd or host.workdir, "argv": program,
            "env": env, "leases": paths, "devices": devices, "time": options.time, "idle_stop": options.idle_stop,
            "deadman": leases.DEADMAN, "kind": "session"}
    if container is None and "/" in host.python:  # the environment a run gets (a provisioned host's ~/mnft-env): first on PATH
        spec["path_first"] = posixpath.dirname(host.python)
    if container is not None:
        spec["container"] = container
    return spec


def in_image(rt: containers.Runtime, image: str, session_id: str, host: Host, argv: tuple[str, ...], devices: list[int],
             env: dict[str, str], cwd: str | None = None) -> tuple[list[str], dict[str, str], dict]:
    """A session's program inside the image, as train's in_image wraps a job's (mnft.run.launch): the runtime's
    `run -i -t` (podman/docker; apptainer's exec in the keeper's terminal) of the command or the image's login
    shell, with the session's GPUs (numbered as the container sees them), the workdir mounted at its own path and
    used as the working directory, the environment by name, as the user, the image by the id the host's facts
    gave. Returns the argv, the environment the runtime client gets (and passes in), and the container's record
    (what the keeper's, stop's and the dead-man's teardown remove by name)."""
    name = containers.container_name(session_id, host.name)
    inside_env = containers.container_env(rt, env, tuple(devices))
    spec = containers.Container(image=rt.runs(image), name=name, mounts=(host.workdir,), devices=tuple(devices) or None,
                                env_names=tuple(sorted(set(inside_env) | set(KEEPER_ENV) | set(IMAGE_ENV))), workdir=cwd or host.workdir,
                                labels=(("mnft.run", session_id), ("mnft.host", host.name)))
    wrapped = containers.run_argv(rt, spec, list(argv or IMAGE_LOGIN_SHELL), tty=True)
    record = {"runtime": rt.kind, "path": rt.path, "name": name, "image": image, "image_id": rt.image_id,
              "mounts": list(containers.mounts(spec.mounts, rt.home)), "teardown": containers.teardown_argv(rt.kind, rt.path, name)}
    return wrapped, inside_env, record


def image_runtime(fleet: Fleet, host: Host, image: str) -> containers.Runtime:
    """The host's container runtime and the image's id there, read and judged as `check --image` reads and judges
    them (mnft.image.facts, check's image rules); else one line naming the host, what is wrong and the fix."""
    results, found = image_facts.gather(fleet, [host], image, timeout=image_facts.FACTS_TIMEOUT)
    facts = found.get(host.name)
    if facts is None:
        raise InputError(f"{host.name}: the image's facts could not be read: {results[host.name].error or 'no answer'}")
    problems = [p for p in image_problems(fleet.inventory.only([host.name]), {host.name: {"container": facts}}, image) if p.severity == "error"]
    if problems:
        raise InputError(f"{host.name}: {problems[0].message}" + (f" ({problems[0].fix})" if problems[0].fix else ""))
    return containers.Runtime.from_facts(facts)


def candidates(inventory: Inventory, host: str | None) -> list[Host]:
    if host is None:
        return list(inventory.hosts)
    try:
        return [inventory.host(host)]
    except KeyError:
        raise InputError(f"--host {host}: not a host of {inventory.path or 'the inventory'} "
                         f"(its hosts: {', '.join(h.name for h in inventory.hosts)})") from None


def take(fleet: Fleet, hosts: list[Host], session_id: str, options: ShellOptions, shows: str, console: Console,
         waited: list | None = None) -> tuple[leases.Leases, Host]:
    """The session's GPUs on the first host where they are free (each host tried in turn); with --wait, in line on
    the first host; else HostBusy naming every host's holders."""
    refusals = []
    for host in hosts:
        held = leases.Leases("shell", session_id, leases.Scope(gpus=options.gpus, directory=None), shows=shows)
        try:
            held.take(fleet, [host])
        except leases.HostBusy as exc:
            refusals.append(str(exc).removesuffix("; nothing was changed on any host"))
            continue
        if host.name in held.devices:
            return held, host
        held.release()  # unreachable, or its lease script failed: named by the take; the next host
        refusals.append(f"{host.name}: no lease could be taken there")
    if options.wait is not None and hosts:
        host = hosts[0]

        def told(name: str, reply: dict) -> None:
            if waited is not None:
                waited.append(time.time())
            ahead = len(reply.get("ahead") or [])
            console.print(f"{name}: waiting in line, position {ahead + 1}", highlight=False, soft_wrap=True)

        held = leases.Leases("shell", session_id, leases.Scope(gpus=options.gpus, directory=None, wait=options.wait), on_wait=told, shows=shows)
        held.take(fleet, [host])
        if host.name in held.devices:
            return held, host
        held.release()
    raise leases.HostBusy("; ".join(refusals or ["no host to take GPUs on"]) + " (--wait to wait in line; `mnft lab` shows the lab)")


class Heartbeat:
    """This controller's heartbeats to the host's dead-man (`agent watch`), every leases.HEARTBEAT_EVERY seconds."""

    def __init__(self, process) -> None:
        self.process = process
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True, name="mnft-session-heartbeat")
        self.thread.start()

    def _beat(self) -> None:
        while not self.stop.wait(leases.HEARTBEAT_EVERY):
            try:
                self.process.write(b"hb\n")
            except Exception:  # noqa: BLE001 - the channel is gone: the host ends the session itself
                return

    def close(self) -> None:
        self.stop.set()
        try:
            self.process.close_stdin()
        except Exception:  # noqa: BLE001
            pass


def shell(inventory: Inventory, options: ShellOptions, console: Console) -> int:
    """Take the GPUs, open the session, give its exit status (see the module docstring)."""
    hosts = candidates(inventory, options.host)
    if options.gpus < 0:
        raise InputError(f"--gpus {options.gpus}: give a number of GPUs, 0 or more")
    if options.image is not None:
        containers.check_ref(options.image, "--image")
    session_id = new_run_id()
    shows = shlex.join(options.argv) if options.argv else None
    record = records.RunRecord.create(session_id, kind="session", command=list(options.argv) or None, inventory=snapshot(inventory), hosts={},
                                      state="waiting" if options.wait is not None else "starting", launched=False,
                                      options={"gpus": options.gpus, "time": options.time, "idle_stop": options.idle_stop, "forward": options.forward,
                                               "image": options.image})
    warn = lambda text: console.print(text, style="yellow", highlight=False, soft_wrap=True)  # noqa: E731
    try:
        with Fleet(inventory) as fleet:
            waited: list[float] = []
            t_asked = time.time()
            try:
                held, host = take(fleet, hosts, session_id, options, shows, console, waited)
            except leases.HostBusy as exc:
                record.update(state="refused", reason=str(exc))
                raise
            if waited:
                record.update(waited_s=round(time.time() - t_asked, 1), devices={host.name: [d.get("index") for d in held.devices.get(host.name, [])]})
                notifying.tell(options.notify, "started", record, warn)
            try:
                return _session(fleet, held, host, record, options, console, inventory)
            finally:
                held.release()
    finally:  # the session's end told once its GPUs are free, whatever ended it
        going = record.data.get("state") in notifying.GOING
        notifying.tell(options.notify, "ended", record, warn, dict(record.data) if going else None)


def session_code(fleet: Fleet, inventory: Inventory, host: Host, record: records.RunRecord, options: ShellOptions,
                 console: Console) -> tuple[str | None, object | None]:
    """The code you have now, placed on the session's host as train places a run's (mnft.sync.snapshot: fixed here,
    its snapshot on the host, a directory of its own there, outputs/<session>): the session's working directory, and
    the fixed tree (released when the session ends). None where there is no project to place (a home directory, a
    tree refused as a run's would be): the session opens in the workdir as it is, and says so."""
    from mnft.sync import snapshot as code

    if not options.code:
        return None, None
    try:
        fixed = code.fix(Path(options.src) if options.src else None)
    except InputError as exc:
        if options.src:
            raise
        console.print(f"note: no code placed ({exc}): the session opens in {host.workdir}", style="yellow", highlight=False, soft_wrap=True)
        return None, None
    try:
        placed = code.place(inventory.only([host.name]), fixed.tree, record.run_id, fleet=fleet)
        if (why := placed.failure()) is not None:
            raise InputError(why)
    except BaseException as exc:
        fixed.release()
        record.update(state="failed", reason=f"{host.name}: the code was not placed: {exc}")
        raise
    where = code.job_dir(host, record.run_id)
    record.update(code={"hash": fixed.tree.digest, "source": str(fixed.source), "job_dir": where})
    return where, fixed


def _session(fleet: Fleet, held: leases.Leases, host: Host, record: records.RunRecord, options: ShellOptions, console: Console,
             inventory: Inventory) -> int:
    devices = [d["index"] for d in held.devices.get(host.name, []) if isinstance(d.get("index"), int)]
    runtime = None
    if options.image:
        try:
            runtime = image_runtime(fleet, host, options.image)
        except InputError as exc:
            record.update(state="failed", reason=str(exc))
            raise
    cwd, fixed = session_code(fleet, inventory, host, record, options, console)
    try:
        return _opened(fleet, held, host, record, options, console, devices, runtime, cwd)
    finally:
        if fixed is not None:
            fixed.release()


def _opened(fleet: Fleet, held: leases.Leases, host: Host, record: records.RunRecord, options: ShellOptions, console: Console,
            devices: list[int], runtime: containers.Runtime | None, cwd: str | None) -> int:
    spec = spec_for(record.run_id, host, options.argv, devices, held.paths.get(host.name, []), options, runtime, cwd)
    prepared = fleet.run_one(host, agent_command(fleet, host.name, "session-prepare"), agent_payload() + json.dumps(spec).encode() + b"\n", 60)
    reply = pyrun.reply(prepared, "the agent")
    if reply is None or not reply.get("run_dir"):
        record.update(state="failed", reason=f"{host.name}: the session could not be prepared: {prepared.error}")
        raise InputError(f"{host.name}: the session could not be prepared: {prepared.error}")
    if reply.get("note"):
        console.print(f"{host.name}: note: {reply['note']}", style="yellow", highlight=False, soft_wrap=True)
    watcher = fleet.start(host, agent_command(fleet, host.name, "watch", reply["run_dir"]))
    watcher.write(agent_payload())
    beat = Heartbeat(watcher)
    record.update(state="running", launched=True, started=time.time(), devices={host.name: devices},
                  hosts={host.name: {"run_dir": reply["run_dir"], "state": "running", "node_rank": 0, "devices": devices,
                                     **({"container": spec["container"]} if spec.get("container") else {})}})
    gpus = ", ".join(str(d) for d in devices) or "none"
    inside = f" in {options.image} ({spec['container']['runtime']})" if spec.get("container") else ""
    where = f" in {cwd} (your code as of now)" if cwd else ""
    console.print(f"session {record.run_id} on {host.name}: GPU {gpus} (CUDA_VISIBLE_DEVICES={','.join(map(str, devices))}){inside}{where}; "
                  f"`mnft stop {record.run_id}` ends it", highlight=False, soft_wrap=True)
    listener = None
    if options.forward:
        listener, port = forward(fleet.connection(host), options.forward)
        console.print(f"{host.name}:{options.forward} is forwarded to http://127.0.0.1:{port}", highlight=False, soft_wrap=True)
    command = Command.of(*[str(a) for a in reply["argv"]]).render()  # the host's Python, from the session's copy of the agent
    try:
        code = interact(open_terminal(fleet.connection(host), command))
    finally:
        if listener is not None:
            listener.close()
        beat.close()
    ended = fleet.run_one(host, agent_command(fleet, host.name, "status", reply["run_dir"]), agent_payload(), 30)
    state = pyrun.reply(ended, "the agent") or {}
    reason = state.get("reason")
    how = outcome(code, reason)
    record.update(state=how, exit_code=code, reason=reason, ended=time.time(),
                  hosts={host.name: dict(record.data["hosts"][host.name], state="exited", exit_code=code)})
    if reason:
        console.print(f"session {record.run_id} ended: {reason}", style="yellow", highlight=False, soft_wrap=True)
    return code
