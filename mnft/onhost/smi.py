"""The host's GPUs asked within a bound: nvidia-smi started and killed past SMI_TIMEOUT (run_bounded; _spawn_smi and
_smi_output for the reads a take makes side by side), a read that hung named (StalledRead), a GPU fallen off the bus
told from a failed read (LOST_EXIT, LOST_MARK), a number of nvidia-smi's read. Standard library only, Python 3.8
syntax.
"""

import os
import signal
import time

SMI_TIMEOUT = 5.0  # nvidia-smi can hang on a wedged driver
MAX_SMI_BYTES = 1 << 20
LOST_EXIT = 15  # nvidia-smi: "GPU has fallen off the bus or has otherwise become inaccessible"
LOST_MARK = "Unable to determine the device handle for"


class StalledRead(OSError):
    """A GPU read that did not answer within its bound: the message names what hung and its likely causes."""


def stalled_line(what, seconds):
    return "%s did not answer in %g s: is persistence mode off? a wedged driver?" % (what, seconds)


def _number(text):
    text = text.strip().split(" ")[0]
    try:
        return int(float(text))
    except ValueError:
        return None


def run_bounded(argv, seconds=None, what="nvidia-smi"):
    """(exit status, stdout and stderr) of a command, StalledRead when it did not answer within `seconds` (it is
    killed with its process group)."""
    import subprocess

    seconds = SMI_TIMEOUT if seconds is None else seconds
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise StalledRead(stalled_line(what, seconds))
    return proc.returncode, out[:MAX_SMI_BYTES].decode("utf-8", "replace")


def _spawn_smi(argv):
    import subprocess

    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _smi_output(proc, deadline):
    import subprocess

    try:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise StalledRead(stalled_line("nvidia-smi", SMI_TIMEOUT))
    text = out[:MAX_SMI_BYTES].decode("utf-8", "replace")
    if proc.returncode != 0 and not (proc.returncode == LOST_EXIT and LOST_MARK in text):  # a lost GPU: the others answered
        raise OSError("nvidia-smi exited %d" % proc.returncode)
    return text
