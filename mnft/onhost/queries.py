"""What the controller asks of a run on this host (mnft.onhost.agent): its status, its output (tail), its logs and
run directory (pack), a checkpoints directory's entries. Standard library only.
"""

import glob
import json
import os
import select
import sys
import time

from .containers import container_state
from .follow import _Tail
from .runfiles import PAYLOAD_NAME, _is_glob, _path, _read, done_ranks, emit, stopped_by
from .runprocs import run_pids
from .samples import WINDOW, Sampler, _timing_record, rank_window


def status(run_dir):
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    if not spec:
        return {"state": "unknown", "error": "no run at %s" % run_dir}
    code = _read(os.path.join(run_dir, "exit_code"))
    alive = run_pids(spec.get("tag") or spec["run_id"])
    state = "exited" if code is not None else ("running" if alive else "killed")
    by = stopped_by(run_dir)
    if by is not None and state != "running":  # `mnft stop` ended it: its exit code is the signal's, not a failure
        state = "stopped"
    result = {
        "state": state,
        "exit_code": int(code) if code is not None else None,
        "processes": len(alive),
        "started": float(_read(os.path.join(run_dir, "started"), "0") or 0) or None,
        "ended": float(_read(os.path.join(run_dir, "ended"), "0") or 0) or None,
        # the last lines of the metrics file and of the output: the controller finds the last step in them
        "metric_lines": _last_lines(_Tail(_path(spec["metrics"])).path, STATUS_LINES) if spec.get("metrics") else [],
        "output_lines": _last_lines(os.path.join(run_dir, "output.log"), STATUS_LINES),
        "done": done_ranks(run_dir),
        "reason": _read(os.path.join(run_dir, "reason")),  # why a session (or an idle-stopped run) was ended
        "stopped_by": by,
    }
    if spec.get("container"):
        result["container"] = container_state(spec)
    if state == "running":
        result["sample"] = status_sample(spec)
    return result


def status_sample(spec, interval=0.5):
    """A sample for `status`: CPU use over a short interval, and each rank's last steps from its timing file."""
    sampler = Sampler(spec.get("tag"))
    sampler.sample()
    time.sleep(interval)
    sample = sampler.sample()
    by_rank = {}
    for path in glob.glob(_path(spec["timings"])) if spec.get("timings") else []:
        for line in _last_lines(path, WINDOW):
            record = _timing_record(line)
            if record is not None:
                by_rank.setdefault(record["rank"], []).append(record)
    sample["ranks"] = rank_window(by_rank)
    return sample


STATUS_LINES = 200


def _last_lines(path, n, chunk=1 << 16):
    """The last n lines of a file, reading only its end."""
    if not path:
        return []
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - chunk * 4))
            data = fh.read(chunk * 4)  # the end as it was: a log written meanwhile is not chased
    except OSError:
        return []
    return [line.decode("utf-8", "replace") for line in data.split(b"\n")[-n - 1:] if line][-n:]


def tail(run_dir, n, follow):
    t = _Tail(os.path.join(run_dir, "output.log"))
    lines = t.lines()
    for line in lines[-n:] if n else lines:
        emit("line", text=line)
    if not follow:
        return 0
    code_file = os.path.join(run_dir, "exit_code")
    tag = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}").get("tag")
    gone = 0  # polls in a row with no process of the run alive
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return 0
        for line in t.lines():
            emit("line", text=line)
        alive = run_pids(tag) if tag else []
        gone = 0 if alive else gone + 1
        ended = os.path.exists(code_file)
        # the keeper records exit_code; a keeper killed with SIGKILL never does: then stop once nothing of the
        # run has been alive for a few polls (not at once: the exit code may be being written)
        if (ended and not alive) or gone >= 4:
            for line in t.lines():
                emit("line", text=line)
            code = _read(code_file)
            emit("exit", code=int(code) if code else None, reason=None if code else "no process of the run remains and it recorded no exit code (its keeper was killed)")
            return 0


LIST_FILES = 100000  # files listed per checkpoint directory at most


def list_checkpoints(root):
    """The top-level entries of a checkpoints directory: for each, whether it is a directory, a link's target,
    and its files with their sizes (relative to the entry; a file entry lists itself as "")."""
    root = _path(root)
    out = {"root": root, "exists": os.path.isdir(root), "entries": {}}
    if not out["exists"]:
        return out
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        entry = {"dir": os.path.isdir(full) and not os.path.islink(full), "link": os.readlink(full) if os.path.islink(full) else None, "files": {}}
        if entry["dir"]:
            for base, dirs, files in os.walk(full):
                for f in files:
                    if len(entry["files"]) >= LIST_FILES:
                        break
                    path = os.path.join(base, f)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    entry["files"][os.path.relpath(path, full)] = st.st_size
                    entry["newest"] = max(entry.get("newest") or 0.0, st.st_mtime)  # which save came last (torchtune 0.6.1)
                    if f == "meta.json":  # mnft's recipes: which rank wrote it, in a world of how many
                        meta = _small_json(path)
                        if meta is not None:
                            entry.setdefault("meta", {})[os.path.relpath(path, full)] = meta
        elif os.path.isfile(full) and entry["link"] is None:
            entry["files"][""] = os.path.getsize(full)
        out["entries"][name] = entry
    return out


def _small_json(path, limit=65536):
    try:
        if os.path.getsize(path) > limit:
            return None
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return {k: data[k] for k in ("rank", "world_size", "step") if k in data} if isinstance(data, dict) else None


CHECKPOINT_NAMES = 10000  # entries of a job's checkpoints directory named by pack at most (a count past it is "at least")


def checkpoint_names(root, limit=CHECKPOINT_NAMES):
    """The top-level entries of a job's checkpoints directory with their own modification times (a save's
    directory is changed by the files it writes into it), at most `limit` of them, and this host's clock when it
    listed them: the controller counts the checkpoints a run saved (mnft.run.logs), matching the names by the
    job's layout. Nothing below the entries is read."""
    root = _path(root)
    out = {"root": root, "exists": os.path.isdir(root), "entries": {}, "more": False}
    if out["exists"]:
        try:
            with os.scandir(root) as found:
                for entry in found:
                    if len(out["entries"]) >= limit:
                        out["more"] = True
                        break
                    try:
                        out["entries"][entry.name] = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
        except OSError as exc:
            out["error"] = str(exc)
    out["now"] = time.time()
    return out


PACK_EXTRA_BYTES = 64 << 20  # collected files besides the run directory, at most (they travel base64 in one line)


def _base(pattern):
    """The directory part of a glob before its first glob character: a/b/c-*/x -> a/b."""
    head = pattern
    for c in "*?[":
        head = head.split(c, 1)[0]
    return head.rstrip("/") if head.endswith("/") else os.path.dirname(head)


def _extra_files(pattern):
    """(path, name inside the archive) of a file, every file under a directory, or the files a glob matches."""
    path = _path(pattern)
    if _is_glob(path):
        base = _base(path)
        for found in sorted(glob.glob(path, recursive=True)):
            if os.path.isfile(found):
                yield found, os.path.relpath(found, base)
    elif os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in sorted(files):
                yield os.path.join(root, name), os.path.relpath(os.path.join(root, name), path)
    elif os.path.isfile(path):
        yield path, os.path.basename(path)


CHECKPOINTS_OPTION = "--checkpoints="  # pack's: the job's checkpoints directory, to name its entries


def pack(run_dir, extras, checkpoints=None):
    """The run directory and extra paths (files, directories, globs: the job's metrics) as one base64 tar.gz in a
    JSON line; extra i goes under extra/<i>/. checkpoints: the job's checkpoints directory, whose entries are
    named beside it (checkpoint_names)."""
    import base64
    import io
    import tarfile

    buf = io.BytesIO()
    left_out = []
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def keep(info):
            name = os.path.basename(info.name)
            return None if name in (PAYLOAD_NAME, "secrets.json") else info

        if os.path.isdir(run_dir):
            tar.add(run_dir, arcname="run", filter=keep)
        budget = PACK_EXTRA_BYTES
        for index, extra in enumerate(extras):
            for path, name in _extra_files(extra):
                try:  # a dangling link, or a file the job removed since it was listed, is skipped, not fatal
                    size = os.path.getsize(path)
                    if size > budget:
                        left_out.append(path)
                        continue
                    tar.add(path, arcname="extra/%d/%s" % (index, name))
                except OSError:
                    continue
                budget -= size
    reply = {"tar": base64.b64encode(buf.getvalue()).decode(), "found": os.path.isdir(run_dir), "left_out": left_out}
    if checkpoints:
        reply["checkpoints"] = checkpoint_names(checkpoints)
    print(json.dumps(reply))
    return 0
