"""rsync to and from the hosts: the argv (with OpenSSH verifying host keys exactly as mnft's own connections do),
the run with per-file progress, and what its exit says (ok, failed with the cause, unreachable, host key
rejected). Used by sync, the checkpoint copy and provision's relay.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from mnft.core import interrupts, limits
from mnft.core.errors import InputError
from mnft.hosts import fanin
from mnft.hosts.connection import login_of
from mnft.hosts.fleet import Status
from mnft.hosts.hostkeys import SYSTEM_KNOWN_HOSTS, known_hosts_files
from mnft.hosts.settings import Host, Inventory
from mnft.sync.targets import normalize_target

SSH_CONNECT_TIMEOUT = 10
RSYNC_IO_TIMEOUT = 120  # rsync --timeout: seconds without any data before a transfer is abandoned


@dataclass(frozen=True)
class SshSettings:
    """What rsync's ssh needs to verify hosts exactly like mnft's connection factory."""

    known_hosts: tuple[str, ...]
    global_known_hosts: str = str(SYSTEM_KNOWN_HOSTS)
    connect_timeout: int = SSH_CONNECT_TIMEOUT
    clear_known_hosts_command: bool = True  # OpenSSH >= 8.5 understands KnownHostsCommand (and `none`)

    @classmethod
    def for_inventory(cls, inventory: Inventory) -> "SshSettings":
        return cls(tuple(str(p) for p in known_hosts_files(inventory.known_hosts)), clear_known_hosts_command=ssh_accepts("KnownHostsCommand=none"))


_SSH_ACCEPTS: dict[str, bool] = {}


def ssh_accepts(option: str) -> bool:
    """Whether the installed OpenSSH accepts `-o option` (`ssh -G` parses the options and connects nowhere)."""
    if option not in _SSH_ACCEPTS:
        try:
            done = subprocess.run(["ssh", "-G", "-F", "none", "-o", option, "mnft-probe.invalid"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=10)
            _SSH_ACCEPTS[option] = done.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _SSH_ACCEPTS[option] = False
    return _SSH_ACCEPTS[option]


def _rsync_e_word(word: str) -> str:
    """Quote one word of rsync's -e command (rsync splits it itself: quotes, doubled to escape; no backslashes)."""
    if word and not any(c in word for c in " \t'\""):
        return word
    return "'" + word.replace("'", "''") + "'"


def _ssh_path(path: str) -> str:
    """A file path for ssh's -o/-i, which expand `%` tokens in them: a literal `%` is written `%%`."""
    return path.replace("%", "%%")


def ssh_command(host: Host, ssh: SshSettings) -> str:
    """rsync's -e: OpenSSH with mnft's host-key verification (the same known_hosts files), ~/.ssh/config honoured
    for the rest. Options given with -o win over ~/.ssh/config, so the config cannot weaken the verification:
    no DNS-published keys (VerifyHostKeyDNS), no KnownHostsCommand adding keys mnft's files do not hold."""
    for path in ssh.known_hosts:
        if any(c in path for c in "\"\\\n"):
            raise InputError(f"known_hosts path {path!r} contains a quote, backslash or newline: OpenSSH cannot be given it safely")
    files = " ".join(f'"{_ssh_path(p)}"' if (" " in p or "'" in p) else _ssh_path(p) for p in ssh.known_hosts)
    words = [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={files}",
        "-o", f"GlobalKnownHostsFile={_ssh_path(ssh.global_known_hosts)}",
        "-o", "VerifyHostKeyDNS=no",
        *(["-o", "KnownHostsCommand=none"] if ssh.clear_known_hosts_command else []),
        "-o", f"ConnectTimeout={ssh.connect_timeout}",
        "-o", "ServerAliveInterval=15",
        "-o", "ServerAliveCountMax=4",
    ]
    if host.port is not None:
        words += ["-p", str(host.port)]
    words += ["-l", login_of(host)]  # the user Fabric logs in as, never OpenSSH's own default (the local uid's name)
    if host.identity:
        words += ["-i", _ssh_path(os.path.expanduser(host.identity)), "-o", "IdentitiesOnly=yes"]
    return " ".join(_rsync_e_word(w) for w in words)


def remote_spec(host: Host, target: str) -> str:
    """rsync's destination. With -s the path reaches the remote rsync untouched by any shell, and a remote rsync
    starts in the home: `~/x` becomes the relative `x`. A local host gets its path expanded here."""
    norm = normalize_target(target)
    if host.is_local:
        return os.path.expanduser(norm).rstrip("/") + "/"
    path = norm[2:] if norm.startswith("~/") else norm
    address = f"[{host.address}]" if ":" in host.address else host.address
    return f"{address}:{path}/"


MKPATH_SINCE = (3, 2, 3)  # rsync's --mkpath (create the target's missing parents) is a receiver option


def supports_mkpath(version: str | None) -> bool:
    """Whether the host's rsync (as its probe reported it) understands --mkpath; an unknown version is tried."""
    parts = re.findall(r"\d+", version or "")
    return not parts or tuple(int(p) for p in parts[:3]) >= MKPATH_SINCE


LINK_DESTS = 20  # rsync takes at most 20 --link-dest directories


def rsync_argv(host: Host, src: Path, target: str, rules_file: str, ssh: SshSettings, *, delete: bool = True,
               checksum: bool = False, io_timeout: int = RSYNC_IO_TIMEOUT, rsync: str = "rsync", mkpath: bool = True,
               link_dest: Sequence[str] = (), read_only: bool = False) -> tuple[str, ...]:
    """rsync's argv for one host. link_dest: directories on the receiving host (absolute, or ~/…) whose identical
    files are hard-linked instead of copied (a code snapshot beside the last ones costs the changed files only);
    read_only: the files land without write permission (a snapshot that runs' directories link to)."""
    argv = [
        rsync,
        "-a",  # recursive; keep links, permissions, times
        "-s",  # --secluded-args (--protect-args before 3.2.6): paths never meet the remote shell
        *(["--mkpath"] if mkpath else []),  # older receivers create the last component only
        "--from0",
        f"--filter=merge {rules_file}",
        f"--timeout={io_timeout}",
        "--stats",
        "--out-format=%i %l %n",
    ]
    if delete:
        argv.append("--delete")
    if checksum:
        argv.append("--checksum")
    if read_only:
        argv.append("--chmod=Fa-w")
    argv += [f"--link-dest={link_path(host, d)}" for d in list(link_dest)[:LINK_DESTS]]
    if not host.is_local:
        argv += ["-e", ssh_command(host, ssh)]
    argv += [str(src).rstrip("/") + "/", remote_spec(host, target)]
    return tuple(argv)


def link_path(host: Host, directory: str) -> str:
    """A --link-dest directory as the receiving rsync reads it: absolute (a relative one is taken from the target;
    the controller passes the real paths the host's tree hash reported)."""
    path = os.path.expanduser(directory) if host.is_local else directory
    if not path.startswith("/"):
        raise InputError(f"{host.name}: --link-dest {directory!r} is not an absolute path")
    return path


def rules_file_bytes(rules: Sequence[str]) -> bytes:
    """The --filter merge file: `- PATTERN` per exclude, `+ PATTERN` per include, NUL-separated (--from0), so any
    path fits. Excluded paths are also protected from --delete on the receiver (rsync's default)."""
    return b"".join((b"" if r.startswith("+ ") else b"- ") + r.encode("utf-8", "surrogateescape") + b"\0" for r in rules)


# ssh could not reach or log in to the host. rsync's own "connection unexpectedly closed" (exit 12) is not one of
# these: the host was reached, and its rsync is missing, crashed or hit a full disk. That is a failure, with the cause.
_UNREACHABLE = re.compile(
    r"ssh: connect to host|Connection refused|Connection timed out|No route to host|Could not resolve|Name or service not known|"
    r"Network is unreachable|Permission denied \(|Connection closed by|Connection reset by|kex_exchange_identification"
)


_NO_RSYNC = re.compile(r"rsync: (command )?not found|rsync: No such file or directory")
_HOST_KEY = re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED|No .* host key is known")


@dataclass
class RsyncOutcome:
    exit_code: int | None
    files_changed: int = 0
    files_deleted: int = 0
    bytes_sent: int = 0
    bytes_done: int = 0
    stderr: str = ""
    error: str = ""


def parse_stats(text: str) -> int:
    match = re.search(r"^Total bytes sent: ([\d,.]+)", text, re.MULTILINE)
    return int(re.sub(r"[,.]", "", match.group(1))) if match else 0


def classify(exit_code: int | None, stderr: str) -> tuple[Status, str]:
    """(status, one-line error) for a finished rsync: OK, FAILED with the cause, UNREACHABLE or HOST_KEY_REJECTED."""
    if exit_code == 0:
        return Status.OK, ""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith("rsync error:")] or lines
    last = useful[-1] if useful else f"rsync exited with {exit_code}"
    if exit_code is None:
        return Status.FAILED, "rsync timed out"
    if _HOST_KEY.search(stderr):
        return Status.HOST_KEY_REJECTED, "host key verification failed (unknown or changed key): " + (useful[0] if useful else "")
    if exit_code == 255 or (exit_code == 12 and _UNREACHABLE.search(stderr)):
        return Status.UNREACHABLE, last
    if _NO_RSYNC.search(stderr):
        return Status.FAILED, f"rsync exit {exit_code}: rsync is not installed on the host ({_NO_RSYNC.search(stderr).group(0)})"
    problems = [ln for ln in useful if re.search(r"No space left|Permission denied|Read-only file system|Disk quota|unknown option|"
                                                 r"Killed|Segmentation fault|out of memory", ln)]
    causes = [ln for ln in useful if not re.search(r"connection unexpectedly closed|error in rsync protocol data stream", ln)]
    why = problems[0] if problems else (causes[-1] if causes else last)
    if exit_code == 12 and not problems:
        why = f"the host's rsync stopped (it crashed or its disk filled): {why}"
    return Status.FAILED, f"rsync exit {exit_code}: {why}"


def run_rsync(argv: Sequence[str], on_item: Callable[[int, bool], None] | None = None, timeout: float = 3600.0, *,
              attempts: int = fanin.ATTEMPTS, sleep: Callable[[float], None] = time.sleep) -> RsyncOutcome:
    """Run one rsync, reporting each finished file (its size, whether it was a deletion) as it goes. When the
    host's sshd dropped the connection before the banner (MaxStartups: nothing was sent), it is tried again with
    backoff; after `attempts` the error names the setting to raise."""
    outcome, tries = fanin.retry_drops(lambda: _run_rsync_once(argv, on_item, timeout), _dropped, attempts=attempts, sleep=sleep)
    if _dropped(outcome) and tries == attempts:  # classify() reports the last line: the setting to raise
        outcome.stderr = outcome.stderr.rstrip("\n") + "\n" + fanin.refusal(_destination(argv), attempts) + "\n"
    return outcome


def _dropped(outcome: RsyncOutcome) -> bool:
    return outcome.exit_code == 255 and fanin.is_drop(outcome.stderr)


def _destination(argv: Sequence[str]) -> str:
    """The host of rsync's last argument ("[addr]:path", "addr:path", "peer:path")."""
    target = str(argv[-1]) if argv else "the host"
    host = target.rsplit(":", 1)[0] if ":" in target else target
    return host.strip("[]").rsplit("@", 1)[-1] or "the host"


def _run_rsync_once(argv: Sequence[str], on_item: Callable[[int, bool], None] | None, timeout: float) -> RsyncOutcome:
    env = {**os.environ, "LC_ALL": "C"}
    interrupts.check()  # mnft is being interrupted: no new rsync
    # its own session: a terminal's Ctrl-C reaches mnft alone, and mnft ends rsync and its ssh as one group
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    with interrupts.track(proc):
        return _follow(proc, on_item, timeout)


def _follow(proc: subprocess.Popen, on_item: Callable[[int, bool], None] | None, timeout: float) -> RsyncOutcome:
    err: list[bytes] = []
    reader = threading.Thread(target=_read_messages, args=(proc.stderr, err), daemon=True)
    reader.start()
    out = RsyncOutcome(None)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_KEPT)  # what is not an item: the stats at its end
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # rsync and its ssh
        except (ProcessLookupError, PermissionError):
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            parts = line.split(" ", 2)
            if line.startswith("*deleting"):
                out.files_deleted += 1
                if on_item:
                    on_item(0, True)
            elif len(parts) == 3 and len(parts[0]) == 11 and parts[0][0] in "<>ch.":
                if parts[0][1] != "d":
                    out.files_changed += 1
                    size = int(parts[1]) if parts[1].isdigit() else 0
                    out.bytes_done += size
                    if on_item:
                        on_item(size, False)
            else:
                tail.append(line)
        code = proc.wait()
    except BaseException:  # an interrupt in this thread: the group goes with it
        _end(proc)
        raise
    finally:
        timer.cancel()
    reader.join(timeout=10)
    out.exit_code = None if timed_out.is_set() else code
    out.stderr = b"".join(err).decode(errors="replace")
    out.bytes_sent = parse_stats("\n".join(tail))
    return out


TAIL_KEPT = 200  # rsync's last lines that are not items (its --stats block is ~20)


def _read_messages(stream, into: list[bytes]) -> None:
    """rsync's stderr (its own, ssh's and the remote rsync's messages), read to its end: the first
    limits.HOST_OUTPUT_BYTES kept (where ssh and rsync say why they stop), the rest counted and said, never held."""
    kept = limits.read_at_most(stream, limits.HOST_OUTPUT_BYTES - 1)
    dropped = 0
    while chunk := stream.read(1 << 16):
        dropped += len(chunk)
    into.append(kept + (f"\n[{dropped} more bytes of messages not kept: HOST_OUTPUT_BYTES, a limit of mnft's input]\n".encode() if dropped else b""))


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL rsync's group (rsync and its ssh): our own child, not reaped yet."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()

