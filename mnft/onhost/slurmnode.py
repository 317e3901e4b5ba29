"""mnft slurm node: the host side of a Slurm run's agents step. Standard library only; Python 3.8.

srun starts this script once per node (`--ntasks-per-node=1 --input=all`, through mnft.hosts.pyrun's bootstrap),
so every node reads the same stdin: this module's payload, then one JSON line holding every node's launch (the
launch plan of mnft.run.launch, in node_rank order), mnft's agent's payload (mnft.onhost.agent, base64) and the run
directory's mark.
It takes the launch at index SLURM_NODEID (node_rank = SLURM_NODEID) after checking that the plan put this node
there (SLURMD_NODENAME), checks that it sees the run directory the batch sees (a Slurm run needs a shared
filesystem), then runs the agent's `launch` with that spec and relays the rest of stdin to it (the batch's
heartbeats, "stop"); the agent's JSON events go to stdout, which srun brings back to the batch labelled with the
task number. Its exit code is the run's exit code on this node, so `srun --kill-on-bad-exit=1` ends the other
nodes' runs when one fails.

Modes (the JSON line's "mode"): "agents" as above; "script": run another host entry whose payload is in the line
(mnft's facts probe for the check step, the agent's `checkpoints DIR` listing) with its arguments, and the line's
"input" after its payload on its stdin, on every node; "command": run the command at SLURM_NODEID of the line's
list, the line's payload and "input" on its stdin (each node's own: the probe inside a job's image, `podman run …
IMAGE python3 …` built from that node's facts), and print its outcome as one JSON line.
Either way each line the child prints goes out in pieces of at most PIECE characters, each piece "+text" when
the line goes on and "|text" when it ends: srun cuts longer lines into several labelled ones, and the batch
joins the pieces back (mnft.slurm.plan.Pieces).

The warning signal before the time limit (SIGUSR2 unless the run says another) is ignored here and so in every
process started from here (an ignored signal stays ignored across exec): the agent, its keeper and torchrun
live on, and only a job that installs its own handler (mnft's recipes do: they save and stop) acts on it.

A run in a container image (podman, docker): Slurm's end of the step (scancel, the time limit, --kill-on-bad-exit)
signals the step's processes only, and the container is run by conmon or the daemon, outside them, while the
agent's own removal may be cut short by Slurm's SIGKILL. So SIGTERM here removes the container at once, by its
name, in a process outside the step (`removal_on_term`, `detached`).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from . import boot


def emit(event, **fields):
    fields["event"] = event
    sys.stdout.write("".join(piece + "\n" for piece in pieces(json.dumps(fields))))
    sys.stdout.flush()


def read_line(limit=64 << 20):
    """The JSON line after this module's payload: read from the same buffered stdin the bootstrap read the payload
    from (it may hold what follows); the relay reads on from that buffer too."""
    return sys.stdin.buffer.readline(limit).rstrip(b"\n")


def choose(launches, node_id, node_name):
    """The launch of this node: the one at SLURM_NODEID, which the plan must have made for this node's name.
    Returns (launch, None) or (None, why not)."""
    if not 0 <= node_id < len(launches):
        return None, "SLURM_NODEID %d is outside the plan's %d nodes" % (node_id, len(launches))
    launch = launches[node_id]
    if node_name and launch.get("node") != node_name:
        return None, ("the plan put %s at node_rank %d but SLURM_NODEID %d is %s: the allocation's node order is not "
                      "`scontrol show hostnames`'s" % (launch.get("node"), node_id, node_id, node_name))
    return launch, None


def sees_mark(mark):
    """Whether this node reads the mark the batch wrote in the run directory (the same filesystem)."""
    try:
        with open(mark["path"]) as fh:
            return fh.read(4096).strip() == mark["token"]  # anyone may write it: a mark is a short token
    except (OSError, KeyError, TypeError):
        return False


PIECE = 500  # characters per piece of a line (srun cuts its tasks' output at 1024 bytes; JSON lines are ASCII)


def pieces(line):
    """One output line as srun-safe pieces: "+…" while the line goes on, "|…" for its end."""
    line = line.rstrip("\n")
    parts = [line[i:i + PIECE] for i in range(0, len(line), PIECE)] or [""]
    return ["+" + part for part in parts[:-1]] + ["|" + parts[-1]]


def forward(src):
    """The child's stdout, line by line, in pieces to our stdout."""
    for raw in iter(src.readline, b""):
        text = raw.decode("utf-8", "replace")
        sys.stdout.write("".join(piece + "\n" for piece in pieces(text)))
        sys.stdout.flush()


def relay(dst):
    """The rest of stdin to the agent, until srun closes it (the batch ended the step or is gone)."""
    src = sys.stdin.buffer
    try:
        while True:
            chunk = src.read1(4096)
            if not chunk:
                break
            dst.write(chunk)
            dst.flush()
    except (OSError, ValueError):
        pass
    try:
        dst.close()
    except (OSError, ValueError):
        pass


def exit_code_of(run_dir, default):
    try:
        with open(os.path.join(os.path.expanduser(run_dir), "exit_code")) as fh:
            return int(fh.read(64).strip())
    except (OSError, ValueError):
        return default


def _payload(data, key="payload"):
    """A payload the line carries (base64: mnft.hosts.pyrun.payload's bytes), or b"" when it carries none."""
    import binascii

    return binascii.a2b_base64(data.get(key) or "")


def run_script(data):
    """Another host entry (its payload and arguments in the line), its output in pieces; its exit code."""
    child = subprocess.Popen([sys.executable, "-c", boot.BOOTSTRAP] + list(data.get("args") or []), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        child.stdin.write(_payload(data) + (data.get("input") or "").encode("utf-8"))
        child.stdin.close()
    except OSError:
        pass
    forward(child.stdout)
    return child.wait()


TERM_GRACE = 2  # seconds podman gives the container's processes between its SIGTERM and SIGKILL on scancel


def removal_on_term(container):
    """The command that removes this node's container when Slurm ends the step (scancel, the time limit, srun's
    --kill-on-bad-exit): the launch's own teardown (`podman rm --force --time T NAME`, `docker rm --force NAME`),
    with a grace short enough to end within Slurm's KillWait (30 s by default; then SIGKILL to every process of the
    step). None without a container, or where the runtime leaves none (apptainer: its processes are the step's)."""
    argv = list((container or {}).get("teardown") or ())
    if not argv:
        return None
    if "--time" in argv:
        argv[argv.index("--time") + 1] = str(TERM_GRACE)
    return argv


def detached(argv):
    """Start argv outside this step's process tree, not waited for: podman's conmon or docker's daemon runs the
    container, outside the step, so Slurm's end of the step never reaches it; its removal must not die with the
    step's processes when KillWait's SIGKILL comes (a shell that puts it in the background and exits: reparented,
    it is no longer a descendant of the step's tasks)."""
    try:
        subprocess.Popen(["/bin/sh", "-c", '"$@" </dev/null >/dev/null 2>&1 &', "sh"] + list(argv), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


OUTPUT_KEPT = 1 << 18  # characters kept of a command's stdout (its end: a probe's reply is its last line); JSON-escaped in
#                        the node's one line, it stays within what the batch joins back (plan.LINE_KEPT)
ERRORS_KEPT = 1 << 14  # of its stderr


def run_command(data, node_id):
    """The command at this node's SLURM_NODEID (the probe inside the image: each node's own command line), its input
    on its stdin: one line {"ran": {exit_code, stdout, stderr, error, seconds}} (None where this node has no command;
    exit_code None and error when it did not end in time or could not start). Exit 0: a node whose command failed
    is said in its line, and must not end the others' through --kill-on-bad-exit."""
    commands = data.get("commands") or []
    argv = commands[node_id] if 0 <= node_id < len(commands) else None
    if not argv:
        emit("ran", ran=None)
        return 0
    timeout = float(data.get("timeout") or 120)
    out = {"exit_code": None, "stdout": "", "stderr": "", "error": None, "seconds": None}
    start = time.monotonic()
    try:
        done = subprocess.run([str(a) for a in argv], input=_payload(data) + (data.get("input") or "").encode("utf-8"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout)
        out["exit_code"] = done.returncode
        out["stdout"] = done.stdout.decode("utf-8", "replace")[-OUTPUT_KEPT:]
        out["stderr"] = done.stderr.decode("utf-8", "replace")[-ERRORS_KEPT:]
    except subprocess.TimeoutExpired:
        out["error"] = "no answer within %gs" % timeout
    except (OSError, ValueError) as exc:
        out["error"] = "%s: %s" % (argv[0], exc)
    out["seconds"] = round(time.monotonic() - start, 4)
    emit("ran", ran=out)
    return 0


def main(argv=None):
    data = json.loads(read_line().decode("utf-8") or "{}")
    if data.get("mode") == "script":
        return run_script(data)
    if data.get("mode") == "command":
        try:
            node_id = int(os.environ.get("SLURM_NODEID", ""))
        except ValueError:
            emit("error", message="SLURM_NODEID is not set: this script runs as a task of an srun step")
            return 2
        return run_command(data, node_id)
    save_signal = getattr(signal, "SIG" + str(data.get("save_signal") or "USR2"), signal.SIGUSR2)
    signal.signal(save_signal, signal.SIG_IGN)  # inherited by the agent, its keeper, torchrun: the job's own to act on
    try:
        node_id = int(os.environ.get("SLURM_NODEID", ""))
    except ValueError:
        emit("error", message="SLURM_NODEID is not set: this script runs as a task of an srun step")
        return 2
    launch, why = choose(data.get("launches") or [], node_id, os.environ.get("SLURMD_NODENAME"))
    if launch is None:
        emit("error", message=why)
        return 2
    if data.get("mark") and not sees_mark(data["mark"]):
        emit("error", message="%s does not see %s as the batch wrote it: a Slurm run needs its run directory and workdir on a "
             "filesystem every node shares" % (launch.get("node"), data["mark"].get("path")))
        return 2
    removal = removal_on_term(launch["spec"].get("container"))
    if removal:
        signal.signal(signal.SIGTERM, lambda *_: detached(removal))
    agent = subprocess.Popen([sys.executable, "-c", boot.BOOTSTRAP, "launch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        agent.stdin.write(_payload(data, "agent") + json.dumps(launch["spec"]).encode() + b"\n")
        agent.stdin.flush()
    except OSError:
        pass
    threading.Thread(target=relay, args=(agent.stdin,), daemon=True).start()
    forward(agent.stdout)
    code = agent.wait()
    return exit_code_of(launch["spec"]["run_dir"], code or 1)


def leave(code):
    """Exit without the interpreter's shutdown: the relay thread may hold stdin's buffer, which shutdown would wait for."""
    sys.stdout.flush()
    os._exit(code)
