"""mnft setup's host side: read facts and apply planned file/nft edits, in one SSH round-trip per call.

Shipped through `mnft.hosts.pyrun`: the script, then one JSON request on stdin:

    {"ops": [{"op": "read", "path": "~/.ssh/authorized_keys"}, ...]}

and it prints exactly one JSON line: {"results": [...]} with one result per op, in order. An op that fails
yields {"error": "one line"} and the later ops are skipped ({"skipped": true}): a plan is applied in order or
not further. Exit status 0 even then (the controller reads the results); 2 for a malformed request.

Constraints (runs on hosts mnft does not control): Python >= 3.8, standard library only, never prompts.

Ops
  env                                   uid, user, home
  read PATH                             exists, text, mode, uid, sha256 (of the bytes), is_dir
  stat PATHS                            per path: exists, mode, uid, is_dir, is_link
  write PATH TEXT [MODE] [DIR_MODE] [EXPECT_SHA256]
                                        atomic replace (temp file in the same directory, fsync, rename); when the
                                        target is a mount point (a bind-mounted /etc/hosts) rename fails with
                                        EBUSY, and the file is rewritten in place instead. EXPECT_SHA256 (null =
                                        "must not exist") guards against edits made since the facts were read.
  chmod PATH MODE
  fit_drain [WAS]                       the drain file, root's or an admin's (of WAS, the group before, or of now): root's,
                                        writable by the admins of now (0664), or by root alone (0644)
  sysctl PATH VALUE                     write a /proc/sys value
  remove PATH [EXPECT_SHA256]           remove a file if it exists
  keygen PATH COMMENT                   ed25519 key pair, only if PATH does not exist; returns the public key line
  run ARGV [INPUT] [CHECK]              rc, stdout, stderr (no shell); CHECK: a non-zero exit is an error
  run_all ARGVS [TIMEOUT]               several commands at once: {"results": [{rc, stdout, stderr}, ...]}
  addresses                             {iface: [ipv4, ...]}
  nft_guarded RULES REVERT DELAY [NFT]  schedule REVERT in DELAY s (detached, own session), then apply RULES;
                                        returns the sleeper's pid and its token (NFT: the nft binary, for tests)
  cancel_revert PID TOKEN               cancel that revert unless it already ran: under the lock the sleeper
                                        takes before reverting, so cancelled and reverted exclude each other
  wait_gone PID TOKEN TIMEOUT           wait until the sleeper (ours, by token) has finished
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

STATE_DIR = "/run/mnft"
MAX_READ_BYTES = 4 * 1024 * 1024  # a file read to be edited: mnft.core.limits.HOST_FILE_BYTES (this file is stdlib only)


def _path(p: str) -> str:
    return os.path.expanduser(p)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def op_env(_: dict) -> dict:
    import pwd

    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    return {"uid": uid, "user": user, "home": os.path.expanduser("~")}


def op_read(req: dict) -> dict:
    path = _path(req["path"])
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"exists": False}
    if stat.S_ISDIR(st.st_mode):
        return {"exists": True, "is_dir": True, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}
    chunks, size = [], 0
    with open(path, "rb") as f:  # in chunks (a /proc/sys file refuses one large read: ENOMEM), never past the limit
        while size <= MAX_READ_BYTES:
            chunk = f.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    data = b"".join(chunks)
    if len(data) > MAX_READ_BYTES:
        raise RuntimeError("%s is larger than %d MiB: mnft edits files up to that size (trim it, or edit it by hand)" % (req["path"], MAX_READ_BYTES >> 20))
    return {"exists": True, "is_dir": False, "text": data.decode("utf-8", "surrogateescape"), "mode": stat.S_IMODE(st.st_mode),
            "uid": st.st_uid, "sha256": _sha(data)}


def op_stat(req: dict) -> dict:
    out = {}
    for p in req["paths"]:
        path = _path(p)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            out[p] = {"exists": False}
            continue
        out[p] = {"exists": True, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "is_dir": stat.S_ISDIR(st.st_mode),
                  "is_link": stat.S_ISLNK(st.st_mode), "path": path}
    return out


def _current_sha(path: str):
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):  # memory flat, whatever the file's size
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def op_write(req: dict) -> dict:
    path = _path(req["path"])
    data = req["text"].encode("utf-8", "surrogateescape")
    directory = os.path.dirname(path) or "."
    if "expect_sha256" in req and _current_sha(path) != req["expect_sha256"]:
        raise RuntimeError("%s changed since its facts were read: run setup again" % req["path"])
    if req.get("dir_mode") is not None:
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=req["dir_mode"])
        os.chmod(directory, req["dir_mode"])
    try:
        old = os.stat(path)
    except FileNotFoundError:
        old = None
    mode = req.get("mode")
    if mode is None:
        mode = stat.S_IMODE(old.st_mode) if old else 0o644
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".mnft-", dir=directory)
    how = "replaced"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if old is not None and os.getuid() == 0:
                os.fchown(f.fileno(), old.st_uid, old.st_gid)
            os.fsync(f.fileno())
        try:
            os.rename(tmp, path)
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            # The target is a mount point (Docker's /etc/hosts, the testbed's): rewrite it in place.
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
            os.chmod(path, mode)
            how = "rewritten in place (the file is a mount point)"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return {"written": True, "how": how}


def op_fit_drain(req: dict) -> dict:
    """As root, after the admins' group changed: the drain file fitted to the admins of now (drain.fit_drain)."""
    from .drain import fit_drain

    return {"changed": fit_drain(req.get("was"))}


def op_chmod(req: dict) -> dict:
    os.chmod(_path(req["path"]), req["mode"])
    return {"chmod": True}


def op_sysctl(req: dict) -> dict:
    """Write a /proc/sys value (no temp file: /proc has none); an empty value is written as a newline."""
    path = req["path"]
    if not path.startswith("/proc/sys/"):
        raise RuntimeError("sysctl: %s is not under /proc/sys" % path)
    with open(path, "w") as f:
        f.write((req["value"] or "") + "\n")
    return {"set": True}


def op_remove(req: dict) -> dict:
    path = _path(req["path"])
    if "expect_sha256" in req and _current_sha(path) != req["expect_sha256"]:
        raise RuntimeError("%s changed since its facts were read: run setup again" % req["path"])
    try:
        os.unlink(path)
    except FileNotFoundError:
        return {"removed": False}
    return {"removed": True}


KEY_RECORD_SUFFIX = ".mnft-generated"
PUBLIC_KEY_CHARS = 65536  # a public key is one line (mnft.core.limits.PUBLIC_KEY_BYTES)


def _record_kind(path: str):
    try:
        with open(path + KEY_RECORD_SUFFIX) as f:
            for line in f.read(65536).splitlines():  # three lines mnft wrote
                if line.startswith("generated:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def op_keygen(req: dict) -> dict:
    """Generate what is missing of an ed25519 key pair and record what mnft made (PATH.mnft-generated), so an
    undo deletes only that: "key" (the pair) or "pub" (a .pub derived from a private key someone else made)."""
    path = _path(req["path"])
    generated = wrote_pub = False
    if not os.path.exists(path):
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700)
        proc = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", req["comment"], "-f", path],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        if proc.returncode != 0:
            raise RuntimeError("ssh-keygen failed: " + (proc.stderr.strip() or "exit %d" % proc.returncode))
        generated = True
    if not os.path.exists(path + ".pub"):
        proc = subprocess.run(["ssh-keygen", "-y", "-f", path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True)
        if proc.returncode != 0:
            raise RuntimeError("ssh-keygen -y failed: " + (proc.stderr.strip() or "exit %d" % proc.returncode))
        with open(path + ".pub", "w") as f:
            f.write(proc.stdout.strip() + " " + req["comment"] + "\n")
        wrote_pub = True
    with open(path + ".pub") as f:
        public = f.read(PUBLIC_KEY_CHARS + 1).strip()
    if len(public) > PUBLIC_KEY_CHARS:
        raise RuntimeError("%s.pub is larger than %d characters: not a public key" % (path, PUBLIC_KEY_CHARS))
    if generated or wrote_pub:
        kind = "key" if generated or _record_kind(path) == "key" else "pub"
        with open(path + KEY_RECORD_SUFFIX, "w") as f:
            f.write("# mnft setup made this (invoke setup --undo deletes it, and only it)\ngenerated: %s\n%s\n"
                    % (kind, " ".join(public.split()[:2])))
    return {"generated": generated, "wrote_pub": wrote_pub, "public": public}


def op_run(req: dict) -> dict:
    try:
        proc = subprocess.run(req["argv"], input=req.get("input"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=req.get("timeout", 60),
                              stdin=None if req.get("input") is not None else subprocess.DEVNULL)
    except FileNotFoundError:
        if req.get("check"):
            raise RuntimeError("%s: command not found" % req["argv"][0])
        return {"rc": 127, "stdout": "", "stderr": "%s: command not found" % req["argv"][0]}
    if req.get("check") and proc.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (req["argv"][0], proc.returncode, " ".join(proc.stderr.split())[:300]))
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def op_run_all(req: dict) -> dict:
    """Several commands at once (threads), each like op_run: {"results": [{"rc", "stdout", "stderr"}, ...]}."""
    import threading

    argvs = req["argvs"]
    out = [None] * len(argvs)

    def one(i):
        out[i] = op_run({"argv": argvs[i], "timeout": req.get("timeout", 60)})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(argvs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"results": out}


def op_addresses(_: dict) -> dict:
    try:
        proc = subprocess.run(["ip", "-j", "-4", "addr", "show"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=10)
        data = json.loads(proc.stdout or "[]")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for link in data:
        out[link.get("ifname", "?")] = [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet" and a.get("local")]
    return out


def _sleeper_is_ours(pid: int, token: str) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return token.encode() in f.read()
    except OSError:
        return False


# The armed revert: sleeps, then takes the lock and, if the revert file is still there (not cancelled), applies
# it and removes it. Cancelling takes the same lock, so "cancelled" and "reverted" exclude each other: a cancel
# that comes while `nft -f <revert>` runs waits for it, then finds the revert file gone and says so.
SLEEPER = r"""
import fcntl, os, subprocess, sys, time
token, delay, revert, lock, nft = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
time.sleep(delay)
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
if os.path.exists(revert):
    subprocess.run([nft, "-f", revert], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.unlink(revert)
    try:
        os.unlink(lock)
    except OSError:
        pass
"""
LOCK_WAIT = 60.0  # seconds a cancel waits for a revert that is running (nft -f takes well under a second)


def _state_paths(token: str):
    base = os.path.join(STATE_DIR, token)
    return base + ".nft", base + ".lock"


def _disarm(pid: int, token: str) -> bool:
    """Cancel the armed revert unless it already ran (or is running: then wait for it). True when cancelled."""
    revert_path, lock_path = _state_paths(token)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the revert of %s holds its lock for more than %ds" % (token, LOCK_WAIT))
                time.sleep(0.05)
        if not os.path.exists(revert_path):
            cancelled = False
        else:
            os.unlink(revert_path)  # from here on the sleeper finds nothing to do, even if the kill misses it
            cancelled = True
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)
    if cancelled and _sleeper_is_ours(pid, token):
        _kill_group(pid)
    return cancelled


def op_nft_guarded(req: dict) -> dict:
    nft = req.get("nft", "nft")
    os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
    token = "mnft-firewall-revert-%d-%d" % (os.getpid(), int(time.time() * 1000))
    revert_path, lock_path = _state_paths(token)
    rules_path = os.path.join(STATE_DIR, token + ".apply.nft")
    for path, text in ((revert_path, req["revert"]), (rules_path, req["rules"])):
        with open(path, "w") as f:
            f.write(text)
    check = subprocess.run([nft, "-c", "-f", rules_path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           universal_newlines=True)
    if check.returncode != 0:
        os.unlink(rules_path)
        os.unlink(revert_path)
        raise RuntimeError("nft refused the ruleset: " + " ".join(check.stderr.split())[:300])
    # The revert is armed before the rules change: if this session dies right after, the host still recovers.
    sleeper = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, token, str(req["delay"]), revert_path, lock_path, nft],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
    )
    applied = subprocess.run([nft, "-f", rules_path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True)
    os.unlink(rules_path)
    if applied.returncode != 0:
        _disarm(sleeper.pid, token)
        raise RuntimeError("nft -f failed: " + " ".join(applied.stderr.split())[:300])
    return {"pid": sleeper.pid, "token": token}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def op_cancel_revert(req: dict) -> dict:
    """Cancel the armed revert; {"cancelled": false} when it already ran or was running (then after it ended)."""
    return {"cancelled": _disarm(int(req["pid"]), req["token"])}


def op_wait_gone(req: dict) -> dict:
    pid, token = int(req["pid"]), req["token"]
    deadline = time.monotonic() + float(req["timeout"])
    while _sleeper_is_ours(pid, token):
        if time.monotonic() > deadline:
            return {"gone": False}
        time.sleep(0.1)
    return {"gone": True}


OPS = {
    "env": op_env,
    "read": op_read,
    "stat": op_stat,
    "write": op_write,
    "chmod": op_chmod,
    "remove": op_remove,
    "sysctl": op_sysctl,
    "keygen": op_keygen,
    "run": op_run,
    "fit_drain": op_fit_drain,
    "run_all": op_run_all,
    "addresses": op_addresses,
    "nft_guarded": op_nft_guarded,
    "cancel_revert": op_cancel_revert,
    "wait_gone": op_wait_gone,
}


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = " (%s)" % exc.filename if exc.filename else ""
        return exc.strerror + where
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def _root_path() -> None:
    """As root, make sure the sbin directories are on PATH: a non-root login's PATH lacks them, and sudo keeps it
    when sudoers sets no secure_path, so `nft` would not be found."""
    if os.getuid() != 0:
        return
    parts = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([p for p in parts if p] + [d for d in SBIN if d not in parts])


def main(argv=None) -> int:
    _root_path()
    try:
        request = json.loads(sys.stdin.readline())
        ops = request["ops"]
    except (ValueError, KeyError, TypeError) as exc:
        sys.stderr.write("mnft remote: malformed request: %s\n" % exc)
        return 2
    results = []
    failed = False
    for op in ops:
        if failed:
            results.append({"skipped": True})
            continue
        fn = OPS.get(op.get("op"))
        if fn is None:
            results.append({"error": "unknown op %r" % op.get("op")})
            failed = True
            continue
        try:
            results.append(fn(op))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, never a traceback
            results.append({"error": _message(exc)})
            failed = True
    sys.stdout.write(json.dumps({"results": results}) + "\n")
    sys.stdout.flush()
    return 0
