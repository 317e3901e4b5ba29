"""The one connection factory: a verified SSH connection (Fabric/paramiko) or the local machine.

Both kinds start a shell command string (rendered by `mnft.hosts.command`) and give back a `Process` with the same
interface: write stdin, read lines as they come, wait with a timeout, close. SSH connections (and each ProxyJump
hop) are given the keys trusted for the name they dial (mnft.hosts.hostkeys.TrustedKeys, read once per command)
and refuse unknown, changed or revoked host keys.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import fabric
import paramiko

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.output import command
from mnft.hosts import fanin
from mnft.hosts.hostkeys import RejectUnknownHostKey, TrustedKeys, UnknownHostKey, fingerprint, known_name
from mnft.hosts.settings import Host

# paramiko's transport thread logs what it raises (e.g. "Error reading SSH protocol banner" from a port that is
# not SSH) with a traceback through Python's last-resort handler; mnft reports the same failure as one row
# (unreachable: …). A handler here keeps the last resort quiet; an application that configures logging still
# receives paramiko's records.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

# Closing an SSH channel does not stop a command that has no pty, and sshd refuses 'signal' requests without
# privilege separation: a remote command the controller gave up on would run on forever. So a command run with a
# timeout is stopped by the host itself, this long after the controller's own timeout (the controller's clock
# starts after it sent the command's input; a slow link must not make the host stop first).
REMOTE_GRACE = 10.0
REMOTE_KILL_AFTER = 5  # seconds from the host's SIGTERM to SIGKILL


def bounded(command: str, timeout: float, grace: float = REMOTE_GRACE) -> str:
    """The command for a remote shell, under the host's coreutils `timeout` (which signals its whole process
    group: the command's children too; a child that started its own session, such as a run's keeper, is not
    touched). A host without `timeout` runs the command unbounded, as before."""
    inner = shlex.quote(command)
    limit = max(1, math.ceil(timeout + grace))
    return (f"command -v timeout >/dev/null 2>&1 && exec timeout -k {REMOTE_KILL_AFTER} {limit} sh -c {inner}"
            f" || exec sh -c {inner}")


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    command: float = 120.0

    def __post_init__(self) -> None:
        for name, flag in (("connect", "--connect-timeout"), ("command", "--timeout")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise InputError(f"{flag}: {value!r} must be a number of seconds > 0")


class Unreachable(Exception):
    """The host could not be reached or authenticated (DNS, refused, timeout, auth, lost connection)."""


class HostKeyRejected(Exception):
    """The host's key is unknown or changed."""


class CommandTimeout(Exception):
    pass


class OutputTooLarge(Exception):
    """A command printed more than the controller keeps (limits.HOST_OUTPUT_BYTES on stdout or on stderr, or in
    one line): the host's result is a failure with this one line, never a part of what it said."""


@dataclass
class Completed:
    exit_code: int
    stdout: str
    stderr: str


class Process:
    """A running command: stdout/stderr are read by background threads, line by line, into a queue (for readline,
    json_reply and stream; `lines=False`: nobody reads them so, as for Connection.run) and kept for wait()'s
    Completed (`keep`; a consumer of a long stream sets it False: nothing is kept beyond the queue).

    Bounded (limits.HOST_OUTPUT_BYTES, whatever the host prints): each stream's kept text, one line, and the lines
    queued and not yet read. Past one, `overflow` says so in one line and wait() raises OutputTooLarge; the command
    is ended when what it prints can no longer be read whole (a line too long, the queue full, or nothing read
    but what is kept); a stream consumer sees its streams end."""

    def __init__(self, lines: bool = True) -> None:
        self.lines: "queue.Queue[tuple[str, str | None]]" = queue.Queue()
        self._queue_lines = lines
        self.keep = True
        self.overflow: str | None = None
        self._out: list[str] = []
        self._err: list[str] = []
        self._kept = {"stdout": 0, "stderr": 0}
        self._queued = 0  # bytes of the lines queued and not yet taken
        self._count = threading.Lock()
        self._readers: list[threading.Thread] = []
        self.stdout_ended = False  # json_reply saw stdout end (a later call would only wait)

    # -- implemented by the two kinds
    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def _wait_exit(self, timeout: float | None) -> int | None:
        raise NotImplementedError

    def terminate(self) -> None:
        raise NotImplementedError

    # -- shared
    def _reader(self, stream: str, chunks) -> None:
        limit = limits.HOST_OUTPUT_BYTES
        buf = bytearray()
        try:
            for chunk in chunks:
                start = len(buf)
                buf += chunk
                end = buf.find(b"\n", start)
                while end >= 0:
                    line = bytes(buf[: end + 1])
                    del buf[: end + 1]
                    if not self._line(stream, line.decode(errors="replace")):
                        return
                    end = buf.find(b"\n")
                if len(buf) > limit:
                    self._overflowed(f"printed a line of more than {limits.size(limit)} on {stream}", end_it=True)
                    return
        finally:
            if buf and self.overflow is None:
                self._line(stream, buf.decode(errors="replace"))
            self.lines.put((stream, None))

    def _line(self, stream: str, text: str) -> bool:
        """Keep and queue one line, within the limits; False once past one (the stream is then read no more)."""
        limit, n = limits.HOST_OUTPUT_BYTES, len(text)
        if self.keep and self.overflow is None:
            if self._kept[stream] + n > limit:
                self._overflowed(f"printed more than {limits.size(limit)} on {stream}", end_it=not self._queue_lines)
                if not self._queue_lines:
                    return False
            else:
                (self._out if stream == "stdout" else self._err).append(text)
                self._kept[stream] += n
        if self._queue_lines:
            with self._count:
                full = self._queued + n > limit
                if not full:
                    self._queued += n
            if full:  # nobody reads the lines this fast: they cannot all be had
                self._overflowed(f"printed more than {limits.size(limit)} not yet read on {stream}", end_it=True)
                return False
            self.lines.put((stream, text))
        return True

    def _overflowed(self, what: str, end_it: bool) -> None:
        if self.overflow is None:
            self.overflow = f"{what} (HOST_OUTPUT_BYTES, a limit of mnft's input, see docs/security.md)"
        if end_it:
            try:
                self.terminate()
            except Exception:  # noqa: BLE001 - ending it is a courtesy: its output is refused either way
                pass

    def _take(self, timeout: float | None) -> tuple[str, str | None]:
        item = self.lines.get(timeout=timeout)
        if item[1] is not None:
            with self._count:
                self._queued -= len(item[1])
        return item

    def _start_readers(self, stdout_chunks, stderr_chunks) -> None:
        for name, chunks in (("stdout", stdout_chunks), ("stderr", stderr_chunks)):
            thread = threading.Thread(target=self._reader, args=(name, chunks), daemon=True)
            thread.start()
            self._readers.append(thread)

    def readline(self, timeout: float) -> tuple[str, str | None] | None:
        """The next (stream, line) pair; line None means that stream ended; None on timeout."""
        try:
            return self._take(timeout)
        except queue.Empty:
            return None

    def json_reply(self, timeout: float) -> tuple[dict | None, list[str]]:
        """The first JSON object the command prints on stdout (a line starting with "{"), and the lines it printed
        on stderr until then (stripped, blank ones left out); None when stdout ends or timeout passes first."""
        deadline = time.monotonic() + timeout
        said: list[str] = []
        while time.monotonic() < deadline:
            item = self.readline(timeout=max(0.0, deadline - time.monotonic()))
            if item is None:
                break
            stream, line = item
            if line is None:
                if stream == "stdout":
                    self.stdout_ended = True
                    break
                continue
            if stream == "stderr":
                if line.strip():
                    said.append(line.strip())
            elif line.lstrip().startswith("{"):
                try:
                    data = json.loads(line)
                except (ValueError, RecursionError):
                    return None, said + [f"printed a line that is not JSON: {limits.shown(line.strip())}"]
                return (data if isinstance(data, dict) else None), said
        return None, said

    def stream(self) -> Iterator[tuple[str, str]]:
        """Every line as it arrives, until both streams end."""
        ended = 0
        while ended < 2:
            stream, line = self._take(None)
            if line is None:
                ended += 1
            else:
                yield stream, line

    def wait(self, timeout: float | None = None) -> Completed:
        """The exit code and what the command printed; CommandTimeout after `timeout`, OutputTooLarge when it
        printed more than the controller keeps."""
        code = self._wait_exit(timeout)
        if code is None:
            self.terminate()
            if self.overflow is not None:  # ended for saying too much, and slow to end: that is why it failed
                raise OutputTooLarge(self.overflow)
            raise CommandTimeout(f"timed out after {timeout:g}s")
        for thread in self._readers:
            thread.join(timeout=5)
        if self.overflow is not None:
            raise OutputTooLarge(self.overflow)
        return Completed(code, "".join(self._out), "".join(self._err))

    def communicate(self, stdin: bytes | None = None, timeout: float | None = None) -> Completed:
        if stdin:
            self.write(stdin)
        self.close_stdin()
        return self.wait(timeout)


class _LocalProcess(Process):
    def __init__(self, command: str, env: dict[str, str] | None = None, lines: bool = True) -> None:
        super().__init__(lines)
        self.popen = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: terminate() reaches every child
            env=env,
        )
        self._start_readers(iter(lambda: self.popen.stdout.read1(65536), b""), iter(lambda: self.popen.stderr.read1(65536), b""))

    def write(self, data: bytes) -> None:
        try:
            self.popen.stdin.write(data)
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass  # the command ended without reading all its input: its exit status says why

    def close_stdin(self) -> None:
        try:
            self.popen.stdin.close()
        except (BrokenPipeError, ValueError):  # ValueError: a flush racing another thread's close
            pass

    def _wait_exit(self, timeout):
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _channel_chunks(recv, channel: paramiko.Channel):
    while True:
        try:
            data = recv(65536)
        except (socket.timeout, OSError, EOFError, paramiko.SSHException):
            return
        if not data:
            return
        yield data


class _SshProcess(Process):
    def __init__(self, channel: paramiko.Channel, command: str, lines: bool = True) -> None:
        super().__init__(lines)
        self.channel = channel
        channel.exec_command(command)
        self._start_readers(_channel_chunks(channel.recv, channel), _channel_chunks(channel.recv_stderr, channel))

    def write(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except (OSError, EOFError, paramiko.SSHException):
            if not self._transport_alive():
                raise Unreachable("connection lost while sending the command's input") from None
            # The command ended without reading all its input (e.g. "python: not found"): its exit status says why.

    def close_stdin(self) -> None:
        try:
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass

    def _transport_alive(self) -> bool:
        transport = self.channel.get_transport()
        return transport is not None and transport.is_active()

    def _wait_exit(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_ = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if self.channel.status_event.wait(slice_):
                break
            if not self._transport_alive():
                raise Unreachable("connection lost while the command ran")
            if deadline is not None and time.monotonic() >= deadline:
                return None
        if self.channel.exit_status == -1 and not self._transport_alive():
            raise Unreachable("connection lost while the command ran")
        return self.channel.recv_exit_status()

    def terminate(self) -> None:
        self.channel.close()


class Connection:
    """One open session to one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def start(self, command: str, lines: bool = True) -> Process:
        """Start a command; lines=False: its lines are not queued (nobody reads them as they come)."""
        raise NotImplementedError

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> Completed:
        return self.start(command, lines=False).communicate(stdin, timeout)

    def close(self) -> None:
        pass


class LocalConnection(Connection):
    """A `connection: local` host: its commands run here, each in its own process group. Closing it does what
    closing an SSH connection does to the commands still running on a host: their stdin ends (mnft's host
    scripts that outlive a command, such as a lease's holder or an installer, end on that EOF)."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self._started: list[_LocalProcess] = []
        self._lock = threading.Lock()

    def start(self, command: str, lines: bool = True) -> Process:
        process = _LocalProcess(command, lines=lines)
        with self._lock:
            self._started = [p for p in self._started if p.popen.poll() is None] + [process]
        return process

    def close(self) -> None:
        with self._lock:
            started, self._started = self._started, []
        for process in started:
            process.close_stdin()


class SshConnection(Connection):
    def __init__(self, host: Host, conn: fabric.Connection) -> None:
        super().__init__(host)
        self.fabric = conn

    def start(self, command: str, lines: bool = True) -> Process:
        transport = self.fabric.client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable("connection lost")
        try:
            channel = transport.open_session(timeout=30)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise Unreachable(f"cannot open a session: {exc}") from None
        return _SshProcess(channel, command, lines)

    def run(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> Completed:
        return super().run(command if timeout is None else bounded(command, timeout), stdin, timeout)

    def close(self) -> None:
        self.fabric.close()
        for hop in gateway_hops(self.fabric):  # Fabric leaves the ProxyJump hops open
            hop.close()


def fabric_connection(host: Host, timeouts: Timeouts, config: fabric.Config | None = None, trusted: TrustedKeys | None = None) -> fabric.Connection:
    """A Fabric connection object (not yet open) with ~/.ssh/config honoured and Fabric's auto-add host-key policy
    replaced by a rejecting one, on the host and on every ProxyJump hop before it (Fabric builds those hops
    itself, with auto-add). With `trusted`, each of them is given the keys trusted for the name it dials."""
    connect_kwargs: dict = {
        "banner_timeout": timeouts.connect,
        "auth_timeout": timeouts.connect,
        "channel_timeout": timeouts.connect,
    }
    if host.identity:
        connect_kwargs["key_filename"] = [os.path.expanduser(host.identity)]
    conn = fabric.Connection(
        host.address,
        user=host.user,
        port=host.port,
        # A copy per connection: fabric.Connection writes into its config (inline_ssh_env), which makes invoke
        # rebuild that config's data; on a config shared by threads, another host's connect sees it half-built.
        config=config.clone() if config is not None else None,
        connect_timeout=max(1, int(round(timeouts.connect))),
        connect_kwargs=connect_kwargs,
    )
    for hop in [conn, *gateway_hops(conn)]:
        hop.client.set_missing_host_key_policy(RejectUnknownHostKey())
        if hop is not conn:  # the hops were built from ~/.ssh/config alone: give them the same time limits
            hop.connect_timeout = conn.connect_timeout
            for key in ("banner_timeout", "auth_timeout", "channel_timeout"):
                hop.connect_kwargs[key] = timeouts.connect
        if trusted is not None:
            trusted.give(hop.client, known_name(*ssh_target(hop)[:2]))
    return conn


def gateway_hops(conn: fabric.Connection) -> list[fabric.Connection]:
    """The ProxyJump hops in front of a connection, nearest first. (A ProxyCommand gateway is a local command
    that only carries bytes: the host's own key is still verified end to end.)"""
    hops = []
    gateway = conn.gateway
    while isinstance(gateway, fabric.Connection):
        hops.append(gateway)
        gateway = gateway.gateway
    return hops


def login_of(host: Host) -> str:
    """The login mnft's SSH uses on the host: the inventory's `user`, else ~/.ssh/config's User for it, else the
    controller's login as getpass reads it ($LOGNAME, $USER, …) — Fabric's choice, which OpenSSH (rsync's -e) is
    given with -l so that both log in as the same user (OpenSSH's own default is the local uid's name instead)."""
    if host.user:
        return host.user
    return fabric.Connection(host.address, port=host.port).user


def ssh_target(conn: fabric.Connection) -> tuple[str, int, str]:
    """(hostname, port, user) after ~/.ssh/config: what is actually dialled."""
    return conn.host, conn.port, conn.user


class _Dropped(Exception):
    """The host's sshd closed the connection before the SSH banner (MaxStartups): worth another try."""


def open_connection(host: Host, trusted: TrustedKeys, timeouts: Timeouts, config: fabric.Config | None = None,
                    *, attempts: int = fanin.ATTEMPTS, sleep=time.sleep) -> Connection:
    """Open a verified connection, or raise Unreachable / HostKeyRejected with a one-line reason. A connection
    sshd drops before the banner (MaxStartups, when others connect to it at the same time) is tried again with
    backoff; after `attempts` the error names the setting to raise."""
    if host.is_local:
        return LocalConnection(host)
    for attempt in range(1, attempts + 1):
        try:
            return _open_once(host, trusted, timeouts, config)
        except _Dropped as exc:
            if attempt == attempts:
                raise Unreachable(fanin.refusal(str(exc), attempts)) from None
            sleep(fanin.backoff(attempt))
    raise AssertionError("unreachable")


def _answers_like_sshd(hostname: str, port: int, timeout: float) -> bool:
    """After a connection closed before the banner: is this an sshd shedding load (it says "Exceeded MaxStartups"
    and closes, closes at once, or sends its banner this time), rather than a port where something else answers
    (which a retry will not change)?"""
    try:
        with socket.create_connection((hostname, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            first = sock.recv(len(fanin.SSHD_DROP_LINE))
    except ConnectionResetError:
        return True
    except OSError:
        return False
    return first == b"" or first.startswith(b"SSH-") or first == fanin.SSHD_DROP_LINE


def _no_banner(exc: BaseException) -> bool:
    """Whether paramiko gave up waiting for the SSH banner (the port accepted the connection and said nothing): it
    reads "Error reading SSH protocol banner" after a timeout, or, when the connect timeout ran out first, the
    negotiation never began ("No existing session"). A connection closed before the banner (EOF, reset) is not
    this: that is what a MaxStartups drop looks like."""
    if not isinstance(exc, paramiko.SSHException):
        return False
    if str(exc) == "No existing session":
        return True
    return str(exc).startswith("Error reading SSH protocol banner") and isinstance(exc.__context__, TimeoutError)


def _open_once(host: Host, trusted: TrustedKeys, timeouts: Timeouts, config: fabric.Config | None) -> Connection:
    conn = fabric_connection(host, timeouts, config, trusted)
    hostname, port, _ = ssh_target(conn)
    name = known_name(hostname, port)
    try:
        conn.open()
    except UnknownHostKey as exc:
        conn.close()
        # exc.hostname is the known_hosts name of the host that presented the key: the host or a ProxyJump hop.
        if trusted.revoked(exc.key):
            raise HostKeyRejected(f"host key {exc.key.get_name()} {fingerprint(exc.key)} of {exc.hostname}"
                                  f"{'' if exc.hostname == name else f' (ProxyJump hop to {name})'} is marked @revoked in known_hosts: "
                                  f"refused (give the host a new key, then {command('trust-hosts')})") from None
        raise HostKeyRejected(
            f"unknown host key {exc.key.get_name()} {fingerprint(exc.key)} for {exc.hostname}"
            f"{'' if exc.hostname == name else f' (ProxyJump hop to {name})'}; "
            f"if that is the host's real key, trust it on purpose: {command('trust-hosts --hosts <inventory>')}"
        ) from None
    except paramiko.BadHostKeyException as exc:
        conn.close()
        changed = name if exc.hostname in (hostname, name) else exc.hostname  # else a ProxyJump hop
        via = "" if changed == name else f" (ProxyJump hop to {name})"
        raise HostKeyRejected(
            f"HOST KEY CHANGED for {changed}{via}: it now presents {fingerprint(exc.key)}, trusted is "
            f"{fingerprint(exc.expected_key)}; someone may be intercepting the connection (man-in-the-middle). "
            f"If the host was reinstalled, remove the old key (ssh-keygen -R '{changed}') and run {command('trust-hosts')}"
        ) from None
    except paramiko.AuthenticationException as exc:
        conn.close()
        raise Unreachable(f"authentication failed for {conn.user}@{name}: {exc}") from None
    except paramiko.ssh_exception.NoValidConnectionsError as exc:
        conn.close()
        # paramiko folds "refused" and "no route to host" into one exception: tell them apart for the fix.
        if all(getattr(err, "errno", None) == errno.ECONNREFUSED for err in exc.errors.values()):
            raise Unreachable(f"connection refused by {name}: is sshd running there and the port open?") from None
        raise Unreachable(f"no route to {name} (host down, cable/link, firewall, or wrong address)") from None
    except (socket.timeout, TimeoutError):
        conn.close()
        raise Unreachable(f"no answer from {name} within {timeouts.connect:g}s (host down, firewall, or wrong address)") from None
    except socket.gaierror as exc:
        conn.close()
        raise Unreachable(f"cannot resolve {hostname!r}: {exc.strerror}") from None
    except (OSError, EOFError, paramiko.SSHException) as exc:
        conn.close()
        if _no_banner(exc):  # not a drop: asking again would wait as long again
            raise Unreachable(f"no SSH answer from {name} within {timeouts.connect:g}s: its port accepts connections but nothing "
                              f"speaks SSH on it (sshd hung or overloaded, or another service on that port)") from None
        if fanin.is_drop(exc) or isinstance(exc, (ConnectionResetError, EOFError)):
            if _answers_like_sshd(hostname, port, timeouts.connect):
                raise _Dropped(name) from None
        raise Unreachable(f"cannot connect to {name}: {exc or exc.__class__.__name__}") from None
    return SshConnection(host, conn)


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 3)
