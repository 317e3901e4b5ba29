"""Host keys: which keys are trusted, and the explicit, recorded act of trusting a new host.

Trusted keys come from the system (/etc/ssh/ssh_known_hosts), the user (~/.ssh/known_hosts), a known_hosts file
the inventory names, and mnft's own file ($MNFT_HOME/known_hosts, default ~/.mnft/known_hosts), which is the only
one mnft ever writes, and only from `invoke trust-hosts`. An unknown key is refused; a changed key is always
refused. Never paramiko's auto-add policy.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import paramiko

from mnft.core import limits
from mnft.core.errors import InputError

SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")


def mnft_home() -> Path:
    return Path(os.environ.get("MNFT_HOME") or Path.home() / ".mnft")


def mnft_known_hosts() -> Path:
    return mnft_home() / "known_hosts"


def known_hosts_files(extra: Path | None = None) -> list[Path]:
    """Every known_hosts file that is trusted, in the order they are read."""
    files = [SYSTEM_KNOWN_HOSTS, Path.home() / ".ssh" / "known_hosts"]
    if extra is not None:
        files.append(extra)
    files.append(mnft_known_hosts())
    return files


class TrustedKeys:
    """Every trusted host key, read once per command: bounded (limits.KNOWN_HOSTS_BYTES a file), in time linear in
    the files (paramiko's HostKeys.load checks each line against every line before it, and a Fabric client loads
    every file again for every host: a lab's known_hosts of thousands of hashed lines took minutes), keys decoded
    only when a host is looked up. Lines marked @cert-authority are ignored (paramiko verifies no certificates);
    a key marked @revoked is never trusted for any host."""

    def __init__(self) -> None:
        self._plain: dict[str, list[tuple[str, str]]] = {}  # host name -> [(key type, base64)]
        self._hashed: list[tuple[str, str, str]] = []  # (|1|salt|hash, key type, base64)
        self._revoked: set[tuple[str, str]] = set()
        self._found: dict[str, dict[str, paramiko.PKey] | None] = {}  # lookups so far (hashed lines cost an HMAC each)

    def read(self, path: Path) -> None:
        """Add one known_hosts file (a missing file adds nothing); too large, unreadable or corrupt: InputError."""
        if not path.exists():
            return
        text = limits.text_of(limits.read_bytes(path, limits.KNOWN_HOSTS_BYTES, "known_hosts file", "known_hosts"), str(path), "known_hosts file")
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            marker = fields.pop(0) if fields[0].startswith("@") else None
            if len(fields) < 3:
                continue  # as OpenSSH and paramiko: a line without names, type and key is skipped
            names, key_type, blob = fields[:3]
            try:
                base64.b64decode(blob, validate=True)
            except ValueError:
                raise InputError(f"{path}:{number}: cannot read known_hosts: the key is not base64 (fix or delete the line)") from None
            if marker == "@revoked":
                self._revoked.add((key_type, blob))
                self._found.clear()
            elif marker is None:
                self.add_text(names.split(","), key_type, blob)

    def add_text(self, names: list[str], key_type: str, blob: str) -> None:
        self._found.clear()
        for name in names:
            if name.startswith("|1|"):
                self._hashed.append((name, key_type, blob))
            elif name and not name.startswith("!"):  # a negated pattern trusts nothing
                self._plain.setdefault(name, []).append((key_type, blob))

    def add(self, name: str, key_type: str, key: paramiko.PKey) -> None:
        """Trust one more key for a host (as paramiko.HostKeys.add)."""
        self.add_text([name], key_type, key.get_base64())

    def lookup(self, name: str) -> dict[str, paramiko.PKey] | None:
        """The keys trusted for a known_hosts name ("host" or "[host]:port"), by type; None when none is. Key types
        paramiko cannot handle are left out (as paramiko does)."""
        if name not in self._found:
            self._found[name] = self._lookup(name)
        keys = self._found[name]
        return dict(keys) if keys is not None else None

    def _lookup(self, name: str) -> dict[str, paramiko.PKey] | None:
        found = list(self._plain.get(name, ()))
        for hashed, key_type, blob in self._hashed:
            if hmac.compare_digest(paramiko.HostKeys.hash_host(name, hashed), hashed):
                found.append((key_type, blob))
        keys: dict[str, paramiko.PKey] = {}
        for key_type, blob in found:
            if (key_type, blob) in self._revoked or key_type in keys:
                continue  # the first key of a type is the one checked (as paramiko's lookup)
            try:
                keys[key_type] = paramiko.PKey.from_type_string(key_type, base64.b64decode(blob))
            except (paramiko.SSHException, paramiko.pkey.UnknownKeyType, ValueError):  # a type or a blob paramiko cannot use
                continue
        return keys or None

    def revoked(self, key: paramiko.PKey) -> bool:
        """Whether known_hosts marks this key @revoked (never trusted, never to be recorded)."""
        return (key.get_name(), key.get_base64()) in self._revoked

    def give(self, client: paramiko.SSHClient, name: str) -> None:
        """Hand a paramiko client the keys trusted for the one name it will connect to."""
        for key_type, key in (self.lookup(name) or {}).items():
            client.get_host_keys().add(name, key_type, key)


def load_trusted(files: list[Path]) -> TrustedKeys:
    """Every trusted key of these known_hosts files; one unreadable, too large or corrupt is bad input."""
    keys = TrustedKeys()
    for path in files:
        try:
            keys.read(path)
        except OSError as exc:
            raise InputError(f"{path}: cannot read known_hosts: {exc.strerror or exc}") from None
    return keys


def known_name(hostname: str, port: int) -> str:
    """The name a host's key is recorded under in known_hosts (OpenSSH's convention)."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"unknown host key for {hostname}")
        self.hostname, self.key = hostname, key


class RejectUnknownHostKey(paramiko.MissingHostKeyPolicy):
    """Refuse every host whose key is not already trusted; the message says how to trust it on purpose."""

    def missing_host_key(self, client, hostname, key):  # noqa: D401 - paramiko's signature
        raise UnknownHostKey(hostname, key)


@dataclass(frozen=True)
class TrustResult:
    name: str  # inventory host name
    known_as: str  # known_hosts entry name
    key_type: str
    fingerprint: str
    state: str  # "recorded" | "already-trusted" | "changed" | "other-type" | "unreachable"
    detail: str = ""


def preferred_key_types(recorded: list[str], available: tuple[str, ...]) -> list[str]:
    """The host key algorithms to offer, the recorded types first (as paramiko's SSHClient does), so that a host
    known by one key type is asked for that key and not judged on another type it also has."""
    first: list[str] = []
    for name in recorded:
        candidates = ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if name == "ssh-rsa" else [name]
        first += [c for c in candidates if c in available and c not in first]
    return first + [t for t in available if t not in first]


def fetch_host_key(hostname: str, port: int, timeout: float, sock=None, recorded: list[str] = ()) -> paramiko.PKey:
    """The key the server presents, read without authenticating (nothing is trusted by reading it). `sock` is a
    channel through a ProxyJump hop or a ProxyCommand; `recorded` the key types already trusted for the host."""
    if sock is None:
        sock = socket.create_connection((hostname, port), timeout=timeout)
    transport = paramiko.Transport(sock)
    try:
        transport.banner_timeout = timeout
        options = transport.get_security_options()
        options.key_types = preferred_key_types(list(recorded), tuple(options.key_types))
        transport.start_client(timeout=timeout)
        return transport.get_remote_server_key()
    finally:
        transport.close()


def judge(known_as: str, key: paramiko.PKey, trusted: TrustedKeys) -> str:
    """'already-trusted', 'new' (nothing is recorded for the host), 'changed' (a different key of the same type
    is recorded), 'other-type' (the host is trusted with other key types only) or 'revoked' (known_hosts marks
    the key @revoked). fetch_host_key asks for the recorded types first, so a host that still presents another
    type does not hold its recorded key: that is refused like a changed key (an attacker cannot show the real
    key, but can offer a type not yet recorded)."""
    if trusted.revoked(key):
        return "revoked"
    recorded = trusted.lookup(known_as)
    if recorded is None or not recorded.keys():
        return "new"
    same_type = recorded.get(key.get_name())
    if same_type is None:
        return "other-type"
    return "already-trusted" if same_type == key else "changed"


def recorded_types(known_as: str, trusted: TrustedKeys) -> list[str]:
    recorded = trusted.lookup(known_as)
    return list(recorded.keys()) if recorded is not None else []


def record(path: Path, known_as: str, key: paramiko.PKey) -> None:
    """Append one key to mnft's known_hosts file (0600, directory 0700)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(f"{known_as} {key.get_name()} {key.get_base64()}\n")
