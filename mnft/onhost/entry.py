"""mnft's launch wrapper: what torchrun starts on every rank in place of the job's entry point. Standard library
only, Python >= 3.8; the host agent writes it into the run directory (mnft.onhost.agent).

    python entry.py SCRIPT.py ARGS…        runs SCRIPT.py as `python SCRIPT.py ARGS…` would
    python entry.py -m MODULE ARGS…        runs MODULE as `python -m MODULE ARGS…` would
    python entry.py --secrets FILE CMD…    (in a container) the run's secrets from FILE (JSON, 0600) into the
                                           environment, FILE deleted, then CMD (torchrun) in its place: the values
                                           never stand on a command line nor in the container's configuration

The entry point runs unchanged (runpy: the same sys.argv, `__main__`, `__file__` and sys.path[0] as without the
wrapper). When it returns, or exits with status 0, the wrapper records `done/rank-<RANK>` in its own directory,
before the interpreter's exit: so a rank that then dies while the interpreter exits (gloo's "terminate called
without an active exception" when a script never calls destroy_process_group) is known to have finished its
work, and mnft reports the run finished with a warning instead of failed, and never restarts it.

A rank's stderr goes into its stdout when torchrun gives each a file of its own (one_stream): its lines then reach
the run's output in the order the job printed them, a traceback after the step lines that preceded it.
"""

import os
import runpy
import sys

DONE_DIR = "done"


def mark_done(run_dir, rank):
    """Record that this rank's entry point returned: an empty file, written atomically enough (create only)."""
    folder = os.path.join(run_dir, DONE_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "rank-%d" % int(rank)), "w"):
            pass
    except (OSError, ValueError):
        pass  # the marker is a hint for the report; never a reason to fail the job


def done_ranks(run_dir):
    """The ranks whose entry point returned, as recorded in run_dir (sorted)."""
    try:
        names = os.listdir(os.path.join(run_dir, DONE_DIR))
    except OSError:
        return []
    ranks = []
    for name in names:
        if name.startswith("rank-") and name[5:].isdigit():
            ranks.append(int(name[5:]))
    return sorted(ranks)


SECRETS_BYTES = 1 << 20  # a secrets file read at most (the controller's --env-file is at most 64 KiB)


def exec_with_secrets(path, argv):
    """Load the secrets file's NAME -> value pairs into the environment, delete the file, exec argv."""
    import json

    try:
        with open(path, "rb") as fh:
            values = json.loads(fh.read(SECRETS_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:
        sys.stderr.write("mnft: the run's secrets file %s: %s\n" % (path, exc))
        return 2
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if not isinstance(values, dict):
        sys.stderr.write("mnft: the run's secrets file %s holds no NAME -> value mapping\n" % path)
        return 2
    os.environ.update({str(k): str(v) for k, v in values.items()})
    os.execvp(argv[0], argv)


def one_stream():
    """The rank's stderr into its stdout, when each is a file of its own: torchrun (--tee, --redirects) points a
    worker's stdout and stderr at two log files and copies each to its own output by a thread of its own, polling
    every 0.1 s, so a traceback (stderr) could be shown before the step lines (stdout) printed just before it.
    One file keeps the order the job printed them in. Not done otherwise (a terminal, a pipe: already in order)."""
    import stat

    try:
        out, err = os.fstat(1), os.fstat(2)
    except OSError:
        return
    if stat.S_ISREG(out.st_mode) and stat.S_ISREG(err.st_mode) and (out.st_dev, out.st_ino) != (err.st_dev, err.st_ino):
        sys.stderr.flush()
        os.dup2(1, 2)


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    if argv and argv[0] == "--secrets":
        if len(argv) < 3:
            sys.stderr.write("usage: entry.py --secrets FILE CMD...\n")
            return 2
        return exec_with_secrets(argv[1], argv[2:])
    one_stream()
    if not argv or (argv[0] in ("-m", "--module") and len(argv) < 2):
        sys.stderr.write("usage: entry.py SCRIPT.py ARGS... | entry.py -m MODULE ARGS...\n")
        return 2
    if argv[0] in ("-m", "--module"):
        module = argv[1]
        sys.argv = [module] + argv[2:]  # runpy puts the module's file in argv[0], as `python -m` does
        sys.path[0] = os.getcwd()  # `python -m` puts the current directory first

        def run():
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(script))  # `python SCRIPT` puts the script's directory first

        def run():
            runpy.run_path(script, run_name="__main__")
    try:
        run()
    except SystemExit as exc:
        if exc.code in (None, 0):
            mark_done(here, os.environ.get("RANK", "0"))
        raise
    except Exception as exc:  # the job's own error: its traceback as Python prints it, without the wrapper's frames
        own = _own_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(own), own)  # Python prints the exception's own __traceback__
        return 1
    mark_done(here, os.environ.get("RANK", "0"))
    return 0


def _own_frames(tb):
    """The traceback from the job's first frame on: the wrapper's and runpy's frames left out."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name == __file__ or name == "<frozen runpy>" or name.endswith(os.sep + "runpy.py")):
            break
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
