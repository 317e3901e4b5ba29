"""The lab's second member (issue 45): what a new student meets in the first week, beyond the admin's path.

Pure pieces here, with data in and words out; the cluster tests (test_cluster_lab) run them on the test bed.
"""

from __future__ import annotations

import io

from rich.console import Console

from mnft.cli.tasks import undrain_lines
from mnft.run.train import WaitLine


def test_an_undrain_says_what_came_back_in_service_then_what_stays_drained():
    assert undrain_lines("node2", [1], []) == ["node2 GPU 1: back in service", "node2: nothing else drained"]
    assert undrain_lines("node2", None, []) == ["node2: back in service", "node2: nothing else drained"]
    still = ["node2 GPU 3: drained by root since 10:02: fan"]
    assert undrain_lines("node2", [0, 1], still) == ["node2 GPU 0, 1: back in service", "still drained: node2 GPU 3: drained by root since 10:02: fan"]


def test_a_waiting_run_says_its_place_once_per_change_not_once_per_reply():
    out = io.StringIO()
    line = WaitLine(Console(file=out, width=300, color_system=None))
    holder = {"command": "train", "run_id": "R1", "user": "alice", "controller": "ctl", "pid": 5, "started": 0}
    reply = {"position": 1, "devices": [{"index": 0, "state": "held", "holder": holder}]}
    for _ in range(3):
        line.update("h1", reply)
    line.update("h2", reply)
    line.update("h1", dict(reply, position=2))
    said = out.getvalue().splitlines()
    assert [s.split(" — ")[0] for s in said] == ["h1: waiting in line, position 1", "h2: waiting in line, position 1",
                                                 "h1: waiting in line, position 2"]
