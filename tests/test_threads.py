"""mnft.core.threads.DaemonPool: an executor whose threads never hold up the exit (issue 36: Ctrl-C with a host that
hangs waited out its connect timeout, as the interpreter joins a ThreadPoolExecutor's threads at exit)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mnft.core.threads import DaemonPool

ROOT = Path(__file__).resolve().parent.parent


def test_results_and_exceptions_come_back_as_from_an_executor():
    pool = DaemonPool(max_workers=2)
    futures = [pool.submit(pow, 2, n) for n in range(10)]
    failed = pool.submit(int, "not a number")
    assert [f.result(timeout=10) for f in futures] == [2 ** n for n in range(10)]
    with pytest.raises(ValueError):
        failed.result(timeout=10)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(pow, 2, 2)


def test_no_more_threads_than_asked_and_work_not_started_is_cancelled_at_shutdown():
    release = threading.Event()
    pool = DaemonPool(max_workers=2, thread_name_prefix="mnft-test-pool")
    held = [pool.submit(release.wait) for _ in range(2)]
    waiting = pool.submit(pow, 2, 3)
    assert len([t for t in threading.enumerate() if t.name.startswith("mnft-test-pool_")]) == 2
    pool.shutdown(cancel_futures=True)
    assert waiting.cancelled()
    release.set()
    assert all(f.result(timeout=10) for f in held)


def test_work_nobody_waits_for_does_not_hold_up_the_exit():
    script = ("import time; from concurrent.futures import ThreadPoolExecutor; from mnft.core.threads import DaemonPool; "
              "pool = DaemonPool(max_workers=1); pool.submit(time.sleep, 3600); pool.shutdown(); print('done')")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)  # a ThreadPoolExecutor's thread would sleep the hour out
    assert out.returncode == 0 and out.stdout == "done\n", out
