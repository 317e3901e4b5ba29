"""Interrupts leave nothing behind (issue 19, class 9): SIGINT and SIGTERM alike end every child mnft started here
(rsync runs in its own session: its whole group goes) and unwind, exit 130 or 143; a train run records
`interrupted`. Here with a `connection: local` host and a stand-in rsync that never finishes on its own (the
simulated cluster's tests slow a real one down: tests/test_cluster_hardening.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnft.core import interrupts

REPO = Path(__file__).resolve().parent.parent

SLOW_RSYNC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "rsync  version 3.2.7  protocol version 31"; exit 0; fi
echo $$ >> "$MARK"
sleep 300 &
echo $! >> "$MARK"
wait
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def slow_sync(tmp_path):
    """`mnft sync` to a local host through an rsync that hangs (it and its child sleep write their pids to MARK)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rsync").write_text(SLOW_RSYNC)
    (bin_dir / "rsync").chmod(0o755)
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  me: {{connection: local, python: {json.dumps(sys.executable)}, workdir: {tmp_path / 'work'}}}\n")
    mark = tmp_path / "pids"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(tmp_path / "home"), MARK=str(mark), PYTHONUNBUFFERED="1")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(REPO), "sync", "--hosts", str(inv), "--src", str(src), "--json"],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rsync_pids(proc: subprocess.Popen) -> list[int]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = [int(p) for p in mark.read_text().split()] if mark.exists() else []
            if len(pids) >= 2:
                return pids
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        raise AssertionError("the sync never started rsync")

    return start, rsync_pids


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_signal_during_a_sync_ends_rsync_and_its_children_and_exits_at_once(slow_sync, sig, code, said):
    start, rsync_pids = slow_sync
    proc = start()
    pids = rsync_pids(proc)  # the stand-in rsync and the sleep it started
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)  # not the 300 s the transfer would take
    assert proc.returncode == code, err
    assert f"mnft: interrupted ({said})" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


def test_handling_turns_sigterm_into_an_interrupt_that_ends_a_tracked_group_and_refuses_new_children():
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or the test session's own handler (tests/conftest.py)
    with pytest.raises(interrupts.Interrupted) as caught, interrupts.handling():
        child = subprocess.Popen(["/bin/sh", "-c", "sleep 300 & wait"], start_new_session=True)
        with interrupts.track(child):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert caught.value.exit_code == 143 and str(caught.value) == "interrupted (SIGTERM)"
    assert child.wait(timeout=10) == -signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # restored
    with pytest.raises(interrupts.Interrupted) as caught, interrupts.handling():  # a fresh block: SIGINT this time
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    assert caught.value.exit_code == 130 and str(caught.value) == "interrupted (Ctrl-C)"
    with pytest.raises(interrupts.Interrupted), interrupts.handling():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except interrupts.Interrupted:
            late = subprocess.Popen(["/bin/sh", "-c", "sleep 300"], start_new_session=True)
            with interrupts.track(late):  # registered after the interrupt: killed at once, refused
                pytest.fail("a child registered after the interrupt ran")
    assert late.returncode == -signal.SIGKILL


def test_what_fails_because_of_an_interrupt_ends_as_the_interrupt_and_a_bug_keeps_its_traceback():
    from mnft.core.errors import MnftError

    with pytest.raises(interrupts.Interrupted) as caught, interrupts.handling():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except interrupts.Interrupted:
            raise MnftError("sync failed: rsync exit -15") from None  # a killed child's failure, reported on
    assert caught.value.exit_code == 143
    with pytest.raises(interrupts.Interrupted) as caught, interrupts.handling():
        raise KeyboardInterrupt  # Python's own (no handler of ours ran): Ctrl-C
    assert caught.value.exit_code == 130
    with pytest.raises(ZeroDivisionError), interrupts.handling():
        1 / 0
    with pytest.raises(MnftError), interrupts.handling():
        raise MnftError("an expected error with no interrupt stays itself")


def test_an_interrupted_train_is_recorded_as_interrupted_in_whatever_phase(tmp_path, monkeypatch):
    from mnft.run import records
    from mnft.run.guard import Guard

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    for phase in ("checking", "syncing", "running"):
        record = records.RunRecord.create(f"R-{phase}", state=phase, hosts={})
        with pytest.raises(interrupts.Interrupted), interrupts.handling(), Guard() as guard:
            guard.hold(None, None, record.run_id)  # a dry run would pass None: no lease; here the record alone
            guard.record = record
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        data = json.loads((record.path / "run.json").read_text())
        assert data["state"] == "interrupted" and data["reason"] == f"interrupted (SIGTERM) while {phase}"
        assert data["interrupted"]["during"] == phase
