"""An interactive terminal on a host, over the same verified connection as every other command
(mnft.hosts.connection): a pty on the host (an SSH channel's pty, or a local one for a `connection: local` host),
this terminal put in raw mode so every key (Ctrl-C, Ctrl-Z, arrows) goes to the remote program, the window's
size followed (SIGWINCH), and the remote program's exit status returned. `forward` carries a local TCP port to
a port on the host (direct-tcpip, as `ssh -L`).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import threading
from typing import Callable

from mnft.hosts.connection import Connection, LocalConnection, SshConnection, Unreachable


class Terminal:
    """One program on a host with a terminal: bytes in and out, its window's size, its exit status."""

    def fileno(self) -> int:
        raise NotImplementedError

    def read(self) -> bytes:
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def resize(self, columns: int, lines: int) -> None:
        raise NotImplementedError

    def exit_status(self, timeout: float | None = None) -> int | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _SshTerminal(Terminal):
    def __init__(self, conn: SshConnection, command: str, term: str, columns: int, lines: int) -> None:
        transport = conn.fabric.client.get_transport()
        if transport is None or not transport.is_active():
            raise Unreachable("connection lost")
        self.channel = transport.open_session(timeout=30)
        self.channel.get_pty(term=term, width=columns, height=lines)
        self.channel.exec_command(command)

    def fileno(self) -> int:
        return self.channel.fileno()

    def read(self) -> bytes:
        if self.channel.recv_stderr_ready():
            return self.channel.recv_stderr(65536)
        return self.channel.recv(65536)  # b"": the program ended and the channel closed

    def write(self, data: bytes) -> None:
        self.channel.sendall(data)

    def resize(self, columns: int, lines: int) -> None:
        self.channel.resize_pty(width=columns, height=lines)

    def exit_status(self, timeout: float | None = None) -> int | None:
        if not self.channel.status_event.wait(timeout):
            return None
        return self.channel.recv_exit_status()

    def close(self) -> None:
        self.channel.close()


class _LocalTerminal(Terminal):
    def __init__(self, command: str, term: str, columns: int, lines: int) -> None:
        import fcntl
        import pty
        import termios

        master, slave = pty.openpty()
        _set_size(slave, columns, lines)

        def controlling() -> None:  # after setsid (start_new_session): the pty becomes this session's terminal
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = dict(os.environ, TERM=term)
        self.popen = subprocess.Popen(["/bin/sh", "-c", command], stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                      preexec_fn=controlling, env=env, close_fds=True)
        os.close(slave)
        self.master = master

    def fileno(self) -> int:
        return self.master

    def read(self) -> bytes:
        try:
            return os.read(self.master, 65536)
        except OSError:  # EIO: every process on the pty is gone
            return b""

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def resize(self, columns: int, lines: int) -> None:
        _set_size(self.master, columns, lines)

    def exit_status(self, timeout: float | None = None) -> int | None:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return code if code >= 0 else 128 - code

    def close(self) -> None:
        try:
            os.close(self.master)
        except OSError:
            pass


def _set_size(fd: int, columns: int, lines: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))


def open_terminal(conn: Connection, command: str, term: str | None = None, size: tuple[int, int] | None = None) -> Terminal:
    """The command started on the connection's host with a terminal of its own (TERM and size as this one's)."""
    columns, lines = size or shutil.get_terminal_size((80, 24))
    term = term or os.environ.get("TERM") or "xterm-256color"
    if isinstance(conn, SshConnection):
        return _SshTerminal(conn, command, term, columns, lines)
    if isinstance(conn, LocalConnection):
        return _LocalTerminal(command, term, columns, lines)
    raise TypeError(f"no terminal over {type(conn).__name__}")


def interact(terminal: Terminal, stdin: int = 0, stdout: int = 1, on_tick: Callable[[], None] | None = None) -> int:
    """Join this terminal to the remote one until the remote program ends: raw mode here (restored however it
    ends), keys there, output here, the window's size followed. Returns the remote exit status."""
    import termios
    import tty

    saved = None
    if os.isatty(stdin):
        saved = termios.tcgetattr(stdin)
        tty.setraw(stdin)
    previous = None
    if os.isatty(stdout) and threading.current_thread() is threading.main_thread():
        def resized(*_) -> None:
            columns, lines = shutil.get_terminal_size((80, 24))
            try:
                terminal.resize(columns, lines)
            except Exception:  # noqa: BLE001 - a closing channel: the next read ends the loop
                pass
        previous = signal.signal(signal.SIGWINCH, resized)
    reading = True
    try:
        while True:
            watched = [terminal] + ([stdin] if reading else [])
            try:
                ready, _, _ = select.select(watched, [], [], 1.0)
            except InterruptedError:
                continue
            if terminal in ready:
                data = terminal.read()
                if not data:
                    break
                os.write(stdout, data)
            if reading and stdin in ready:
                data = os.read(stdin, 4096)
                if data:
                    terminal.write(data)
                else:
                    reading = False  # this side's input ended; the program goes on until it ends
            if on_tick is not None:
                on_tick()
        code = terminal.exit_status(10.0)
        return 255 if code is None or code < 0 else code
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
        terminal.close()


def forward(conn: Connection, remote_port: int, local_port: int = 0) -> tuple[socket.socket, int]:
    """Listen on 127.0.0.1 here and carry each connection to the host's 127.0.0.1:remote_port (SSH's direct-tcpip
    on the verified connection; straight through for a local host). Returns (the listening socket, its port):
    closing the socket ends the forwarding."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", local_port))
    listener.listen(8)

    def opened(client: socket.socket):
        if isinstance(conn, SshConnection):
            transport = conn.fabric.client.get_transport()
            if transport is None or not transport.is_active():
                raise Unreachable("connection lost")
            return transport.open_channel("direct-tcpip", ("127.0.0.1", remote_port), client.getpeername(), timeout=10)
        return socket.create_connection(("127.0.0.1", remote_port), timeout=10)

    def pump(a, b) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except (OSError, EOFError):
            pass
        finally:
            for end in (a, b):
                try:
                    end.close()
                except Exception:  # noqa: BLE001
                    pass

    def serve() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed: the session is over
            try:
                remote = opened(client)
            except Exception:  # noqa: BLE001 - nothing listens there yet: this connection only
                client.close()
                continue
            threading.Thread(target=pump, args=(client, remote), daemon=True).start()
            threading.Thread(target=pump, args=(remote, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True, name="mnft-forward").start()
    return listener, listener.getsockname()[1]
