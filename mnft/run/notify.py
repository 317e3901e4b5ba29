"""Being told when a run ends: `--notify CMD` and `mnft wait RUN`.

`--notify CMD` (on `train` and `shell`; a job file's `notify:`; a user's default, `notify:` in mnft's user config)
runs CMD on the controller when a run starts after waiting in line (`--wait`) and when it ends, whatever the end
(succeeded, failed, resumable, stopped, idle-stopped, timed-out, interrupted, refused, lost). CMD is the user's own
shell line, run as `/bin/sh -c CMD`; mnft never puts a value into it: everything it tells is in MNFT_NOTIFY_*
environment variables (`environment`, pure). It runs in its own process group with its output captured, and is
killed (the whole group) after its timeout: a notify command that fails or hangs is a warning, never the run's
failure, and the run has ended (its record written, its GPUs free) before it starts.

`mnft wait RUN` blocks until a run (a detached one, or another terminal's, or a session) has ended, and exits with
its outcome; `--notify CMD` there tells a detached run's end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mnft.core.errors import ExitCode, InputError
from mnft.run import records

GOING = ("waiting", "checking", "syncing", "starting", "running", "handed-over", "supervised")  # a run not ended yet
WAIT_EVERY = 5.0  # seconds between two looks at the hosts
NOTIFY_TIMEOUT = 30.0  # seconds a notify command may take before it is killed (mnft's user config: notify.timeout)
VALUE_CHARS = 2000  # the most characters of one value (a reason, a cause): an environment is not a log
OUTPUT_TAIL = 400  # characters of a failed notify command's output shown in its warning


def exit_code(state: str | None) -> int:
    """A run's end as an exit status: 0 for a run that succeeded (or a session that ended by itself), 130 for one
    stopped or interrupted, 1 for anything else (failed, resumable, timed out, idle-stopped, lost, refused)."""
    if state in ("succeeded", "ended"):
        return ExitCode.OK
    if state in ("stopped", "interrupted"):
        return 130
    return ExitCode.FAILED


def wait(record: records.RunRecord, look: Callable[[records.RunRecord], None], every: float = WAIT_EVERY, sleep=time.sleep) -> str:
    """Look (status on the hosts, which writes a detached run's end into its record; or the record another
    controller keeps) until the run has ended; its final state."""
    while True:
        fresh = records.read_record(record.path / "run.json")
        record.data.update(fresh)
        if record.data.get("state") not in GOING:
            return record.data.get("state")
        look(record)
        if record.data.get("state") not in GOING:
            return record.data.get("state")
        sleep(every)


# ------------------------------------------------------------------------------------------------ --notify


@dataclass(frozen=True)
class Notify:
    command: str  # the user's shell line (never formatted: values go to its environment)
    timeout: float = NOTIFY_TIMEOUT
    source: str = "--notify"  # where it came from, for messages


def _command(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: a notify command is one shell line, e.g. 'echo \"$MNFT_NOTIFY_SUMMARY\" | mail -s mnft me@lab' (see docs/lab.md)")
    if "\x00" in value or "\n" in value.strip():
        raise InputError(f"{where}: {value[:60]!r}: a notify command is one line (no newline, no NUL)")
    return value.strip()


def settings(given: str | None, job_notify: str | None, config: Mapping[str, Any] | None, config_name: str = "~/.mnft.yaml") -> Notify | None:
    """Which notify command a run gets: --notify, else the job file's `notify:`, else the user's default (`notify:`
    in mnft's user config: a command, or {command, timeout}); its timeout from the config (default 30 s). None: no
    notify. Bad input is one line naming where it came from."""
    section = (config or {}).get("notify") if config is not None else None
    timeout, default = NOTIFY_TIMEOUT, None
    if section is not None:
        if isinstance(section, str):
            default = _command(section, f"{config_name}: notify")
        elif isinstance(section, Mapping):
            unknown = [str(k) for k in section if k not in ("command", "timeout")]
            if unknown:
                raise InputError(f"{config_name}: notify: unknown key {unknown[0]!r} (known: command, timeout)")
            if section.get("command") is not None:
                default = _command(section.get("command"), f"{config_name}: notify.command")
            if section.get("timeout") is not None:
                value = section.get("timeout")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                    raise InputError(f"{config_name}: notify.timeout: {value!r}: give seconds, more than 0 and at most 3600")
                timeout = float(value)
        else:
            raise InputError(f"{config_name}: notify: give a command, or command: and timeout: (see docs/lab.md)")
    if given is not None:
        return Notify(_command(given, "--notify"), timeout, "--notify")
    if job_notify is not None:
        return Notify(_command(job_notify, "the job file's notify"), timeout, "the job file's notify:")
    if default is not None:
        return Notify(default, timeout, f"{config_name}'s notify")
    return None


def _clean(value: Any) -> str:
    """A value as an environment variable holds it: text, no NUL, at most VALUE_CHARS characters."""
    text = "" if value is None else str(value)
    text = text.replace("\x00", "")
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + "…"


def outcome_of(data: Mapping[str, Any]) -> str:
    """The run's end as notify names it: its record's state (a run that never reached an end of its own, e.g. an
    error before its launch: failed)."""
    state = data.get("state")
    return "failed" if state in GOING or not state else str(state)


def program_exit(data: Mapping[str, Any]) -> int | None:
    """The exit status of the run's program: a session's; the failed host's; 0 on every host for a run that
    succeeded; None when no program ended by itself (stopped, refused, interrupted)."""
    if isinstance(data.get("exit_code"), int):
        return data["exit_code"]
    hosts = data.get("hosts") or {}
    failed = hosts.get(data.get("failed_host")) if data.get("failed_host") else None
    if isinstance(failed, Mapping) and isinstance(failed.get("exit_code"), int):
        return failed["exit_code"]
    codes = [h.get("exit_code") for h in hosts.values() if isinstance(h, Mapping)]
    if data.get("state") == "succeeded" and codes and all(c == 0 for c in codes):
        return 0
    return None


def environment(event: str, data: Mapping[str, Any], path: Path | str) -> dict[str, str]:
    """What a notify command is told, as MNFT_NOTIFY_* variables (pure: a run record in, the variables out).

    event: `started` (it waited in line and now has its GPUs) or `ended`."""
    kind = data.get("kind") if data.get("kind") in ("session", "sweep") else "run"
    run_id = str(data.get("run_id") or "")
    outcome = "started" if event == "started" else outcome_of(data)
    hosts = [str(h) for h in (data.get("hosts") or {})] or [str(h) for h in (data.get("devices") or {})]
    diagnosis = data.get("diagnosis") if isinstance(data.get("diagnosis"), Mapping) else {}
    reason = data.get("reason") or ""
    cause = diagnosis.get("cause") or (reason if outcome not in ("succeeded", "ended", "started") else "")
    fix = diagnosis.get("fix") or ""
    code = program_exit(data) if event == "ended" else None
    waited = None
    if isinstance(data.get("waited_s"), (int, float)):
        waited = round(float(data["waited_s"]), 1)
    label = (data.get("job") or {}).get("name") or (data.get("recipe") and f"recipe {data['recipe']}") or \
        " ".join(data.get("command") or []) or ""
    where = ",".join(hosts)
    summary = f"mnft {kind} {run_id}" + (f" ({label})" if label else "") + f": {outcome}" + (f" on {where}" if where else "") + \
        (f" (exit code {code})" if code not in (None, 0) else "") + (f": {cause}" if cause else "")
    if kind == "sweep" and outcome == "succeeded" and reason:  # a sweep is told once, its points' summary and best point included
        summary += f": {reason}"
    import json

    values = {
        "EVENT": event, "RUN": run_id, "KIND": kind, "OUTCOME": outcome, "EXIT_CODE": "" if code is None else str(code),
        "HOSTS": where, "FAILED_HOST": data.get("failed_host") or "", "REASON": reason, "CAUSE": cause, "FIX": fix,
        "LOG": str(path), "WAITED_S": "" if waited is None else str(waited), "SUMMARY": summary,
    }
    out = {f"MNFT_NOTIFY_{k}": _clean(v) for k, v in values.items()}
    out["MNFT_NOTIFY_MESSAGE_JSON"] = json.dumps({"text": out["MNFT_NOTIFY_SUMMARY"]})  # a chat webhook's body, quoted right
    return out


def argv(notify: Notify) -> list[str]:
    """The notify command as it runs: the user's line given whole to sh (their shell syntax, their config)."""
    return ["/bin/sh", "-c", notify.command]


@dataclass(frozen=True)
class Told:
    ok: bool
    warning: str | None = None  # why not: timed out, failed, could not start


def run(notify: Notify, variables: Mapping[str, str], base_env: Mapping[str, str] | None = None) -> Told:
    """Run the notify command with the variables, in its own process group, for at most notify.timeout seconds
    (then the whole group is killed). Never raises for the command's failure: a Told with the warning."""
    env = dict(os.environ if base_env is None else base_env)
    env = {k: v for k, v in env.items() if not k.startswith("MNFT_NOTIFY_")}  # only this run's values
    env.update(variables)
    # its output goes to a file, of which only the end is read: a command that prints without end costs disk, not memory
    with tempfile.TemporaryFile(prefix="mnft-notify-") as output:
        try:
            child = subprocess.Popen(argv(notify), stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        except OSError as exc:
            return Told(False, f"the notify command ({notify.source}) could not start: {exc}")
        try:
            child.wait(timeout=notify.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(child.pid)
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:  # something of it left the group: left to itself
                pass
            return Told(False, f"the notify command ({notify.source}) took more than {notify.timeout:g}s and was killed")
        except BaseException:
            _kill_group(child.pid)  # interrupted while it runs: it goes with mnft
            child.wait()
            raise
        output.seek(max(0, output.seek(0, os.SEEK_END) - OUTPUT_TAIL * 4))
        out = output.read(OUTPUT_TAIL * 4)
    if child.returncode != 0:
        said = out.decode("utf-8", "replace").strip()[-OUTPUT_TAIL:]
        return Told(False, f"the notify command ({notify.source}) exited with {child.returncode}" + (f": {said}" if said else ""))
    return Told(True)


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tell(notify: Notify | None, event: str, record: records.RunRecord, warn: Callable[[str], None],
         data: Mapping[str, Any] | None = None) -> Told | None:
    """Run the notify command (if any) for the event with the record's outcome (data: what to tell instead of the
    record's data); a failure is `warn`ed and noted in the record."""
    if notify is None:
        return None
    told = run(notify, environment(event, record.data if data is None else data, record.path))
    if told.warning:
        warn(f"warning: {told.warning} (the run's outcome is unchanged)")
    record.update(notified={**(record.data.get("notified") or {}), event: {"ok": told.ok, "warning": told.warning, "at": time.time()}})
    return told
