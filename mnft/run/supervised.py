"""A detached run's supervisor process, on the lab: `mnft train`'s own launch and supervision (mnft.run.train), run
where the plan put it, for exactly as long as the run or its place in line lasts.

mnft.onhost.superhost starts it in a session of its own (`python -I -S`, its bundle's site first on sys.path) in
~/.mnft/supervised/<run id>/, its output into console.log there. Its spec arrives on stdin (pickled by the
controller that is handing the run over: mnft.run.supervisor, the same user's own process): the inventory as
this host reaches the others, the train options, and the values of the environment the run passes on (its
secrets among them: kept in this process's memory, never written). It says it runs (supervisor.json: pid and
start time, which is how `state` and `stop` prove it), trains as an attached `mnft train` does into its console,
and writes exit.json when it ends. SIGINT and SIGTERM are Ctrl-C (mnft.core.interrupts, as around every task): the
children it started are ended, the gang is torn down and the run recorded.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import sys
import time
from pathlib import Path

from mnft.onhost.runprocs import start_time
from mnft.onhost.superhost import EXIT, ME


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def main(folder: str) -> int:
    here = Path(folder)
    from rich.console import Console  # imported while the controller still copies the run's code here

    from mnft.core import interrupts
    from mnft.core.errors import ExitCode, MnftError
    from mnft.run.train import train

    spec = pickle.loads(sys.stdin.buffer.read())  # the controller's own pickle, from this user's SSH session
    sys.stdin.close()
    os.environ.update(spec["environ"])
    os.environ["MNFT_HOME"] = str(here / "home")
    os.environ["MNFT_RUNS_DIR"] = str(here / "runs")
    os.environ.setdefault("COLUMNS", "160")

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no terminal: a hang-up is nobody's Ctrl-C
    _write(here / ME, {"pid": os.getpid(), "start": start_time(os.getpid()), "host": socket.gethostname(),
                       "since": time.time(), "run_id": spec["run_id"]})
    console = Console(file=sys.stdout, width=160, force_terminal=False, soft_wrap=True, highlight=False)
    code: int = ExitCode.FAILED
    error = None
    try:
        with interrupts.handling():  # SIGINT (`mnft stop`) and SIGTERM as for an attached train: children ended, the gang torn down
            if spec.get("sweep") is not None:  # a sweep: its queue kept here, each point a train of its own (mnft.run.sweeper)
                from mnft.run import sweeper

                code = sweeper.run(spec, here, console)
            else:
                code = train(spec["inventory"], spec["options"], console)
    except KeyboardInterrupt as exc:
        code, error = getattr(exc, "exit_code", ExitCode.INTERRUPTED), str(exc) or "interrupted"
        console.print(f"the supervisor was {error}: the run's gang was stopped")
    except MnftError as exc:
        code, error = exc.exit_code, str(exc)
        console.print(f"error: {exc}")
    finally:
        sys.stdout.flush()
        _write(here / EXIT, {"code": int(code), "error": error, "at": time.time()})
    return int(code)


def point(folder: str, point_id: str) -> int:
    """One point of a sweep: its `train`, in a child process of the sweep's supervisor (mnft.run.sweeper), its spec
    on stdin, its output into points/<id>.log; SIGINT from the sweep's supervisor is `mnft stop` for it."""
    from rich.console import Console

    from mnft.core import interrupts
    from mnft.core.errors import ExitCode, MnftError
    from mnft.run.train import train

    spec = pickle.loads(sys.stdin.buffer.read())  # the sweep's supervisor's own pickle
    sys.stdin.close()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    console = Console(file=sys.stdout, width=160, force_terminal=False, soft_wrap=True, highlight=False)
    try:
        with interrupts.handling():
            return int(train(spec["inventory"], spec["options"], console))
    except KeyboardInterrupt as exc:
        console.print(f"point {point_id}: {exc or 'interrupted'}")
        return int(getattr(exc, "exit_code", 130))
    except MnftError as exc:
        console.print(f"error: {exc}")
        return int(exc.exit_code)
    finally:
        sys.stdout.flush()
