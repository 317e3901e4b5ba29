"""A run's terminal output carries no teardown noise: when two hosts end at once, the master's torchrun may close
its store before the other host's torchrun has passed its exit barrier, and that torchrun logs the
`DistNetworkError: Failed to recv, got 0 bytes` it met, with its traceback, and exits 0. Those lines stay in the
host's log and its tail; the terminal gets one line that says so. Lines in, lines shown out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse
from mnft.run.gang import Gang, HostRun, TeardownNoise
from mnft.run.launch import HostLaunch, LaunchOptions

# what torch 2.13's torchrun printed on h2 of the test bed (tests/test_cluster_jobs.py reproduces it): c10d's warning
# with its C++ stack (a few frames of 35 kept here), a blank line, then torchrun's logger (its prefix on every line)
C10D = [
    "[W1128 01:04:58.731546814 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=4, addr=[2c01::6400:0:fd7f:0]:14990, "
    "remote=[fdff:ffff::]:35077): Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
    "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) "
    "+ 0x9d (0x7fb14ed5ab8d in /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/lib/libc10.so)",
    "frame #2: c10::DistNetworkError::DistNetworkError(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, "
    "std::allocator<char> >) + 0x72 (0x7fb14ed5c022 in /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/lib/libc10.so)",
    "frame #9: <unknown function> + 0x3d2825 (0x7fb14d7d2825 in /root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/lib/libtorch_python.so)",
    "<omitting python frames>",
    "frame #34: _start + 0x21 (0x55b4713b7081 in /root/.pyenv/versions/3.11.7/bin/python3.11)",
    "",
]
AT = "E1128 01:04:58.500000 14880 site-packages/torch/distributed/elastic/agent/server/api.py:1008] "
EXIT_BARRIER = [
    AT + "Error waiting on exit barrier. Elapsed: 3.2011959552764893 seconds",
    AT + "Traceback (most recent call last):",
    AT + '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 994, in _exit_barrier',
    AT + "    store_util.barrier(",
    AT + '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/elastic/utils/store.py", line 201, in barrier',
    AT + "    store.wait([last_member_key])",
    AT + "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
]
TEARDOWN = C10D + EXIT_BARRIER
# the same record from a logger without torch's prefix: the traceback after its first line
PLAIN = [
    "[ERROR] Error waiting on exit barrier. Elapsed: 0.0212 seconds",
    "Traceback (most recent call last):",
    '  File "api.py", line 994, in _exit_barrier',
    "    store_util.barrier(",
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.",
]
WORK = ["step 20/20 loss 1.234", "done"]


def launch(host: str, rank: int, tmp_path: Path) -> HostLaunch:
    return HostLaunch(host=host, node_rank=rank, rank_offset=rank, slots=1, argv=("true",), env={}, secret_names=(),
                      cwd=str(tmp_path), run_dir=f"/root/.mnft/runs/R/{host}", output_dir=str(tmp_path / "out"), metrics=None)


def shown(lines: list[tuple[int | None, str]]) -> tuple[list[str], TeardownNoise]:
    noise = TeardownNoise()
    return [text for rank, text in lines if not noise.hides(rank, text)], noise


def test_c10ds_warning_with_its_cpp_stack_and_torchruns_exit_barrier_record_are_hidden_whole():
    out, noise = shown([(1, line) for line in WORK] + [(None, line) for line in TEARDOWN] + [(None, "a line of torchrun's after")])
    assert out == WORK + ["a line of torchrun's after"]
    assert noise.hidden == len(TEARDOWN)


def test_the_record_without_torchs_prefix_is_hidden_to_its_exception_and_the_next_line_is_shown():
    out, noise = shown([(None, line) for line in PLAIN] + [(None, "W1127 06:07:25.000000 1529 run.py:1] later")])
    assert out == ["W1127 06:07:25.000000 1529 run.py:1] later"]
    assert noise.hidden == len(PLAIN)


def test_a_ranks_lines_between_the_records_lines_are_shown_and_other_torchrun_lines_are_too():
    warning = "W1127 06:07:20.000000 1529 site-packages/torch/distributed/run.py:792] Setting OMP_NUM_THREADS to 1"
    other = "E1127 06:07:24.063000 1529 site-packages/torch/distributed/elastic/agent/server/api.py:700] something else"
    lines = [(None, warning), (None, EXIT_BARRIER[0]), (0, "a rank's line"), *[(None, t) for t in EXIT_BARRIER[1:]], (None, other)]
    # (a rank's line between the record's lines: shown, and the record goes on)
    out, noise = shown(lines)
    assert out == [warning, "a rank's line", other]
    assert noise.hidden == len(EXIT_BARRIER)


def test_a_ranks_own_traceback_is_never_taken_for_torchruns_teardown():
    crash = ["Traceback (most recent call last):", '  File "train.py", line 3', "RuntimeError: Failed to recv, got 0 bytes"]
    out, noise = shown([(1, line) for line in crash])
    assert out == crash and noise.hidden == 0
    assert noise.note("log", 1) is None


def test_the_note_says_not_a_failure_only_for_a_torchrun_that_exited_0():
    noise = shown([(None, line) for line in C10D])[1]
    assert noise.note("h2.log", 1) == f"torchrun found the master's store closed ({len(C10D)} line(s) kept in h2.log)"
    assert noise.note("h2.log", 1) is None  # one line, once


TWO_HOSTS = parse("hosts:\n  h1: {connection: local}\n  h2: {connection: local}\n")


@pytest.mark.timeout(30)
def test_a_run_that_succeeded_shows_no_traceback_and_one_line_for_the_other_hosts_teardown(tmp_path):
    said: list[tuple[str, int | None, str]] = []
    with Fleet(TWO_HOSTS) as fleet:
        gang = Gang(fleet, [launch("h1", 0, tmp_path), launch("h2", 1, tmp_path)], "R", LaunchOptions(grace=0.5), {},
                    on_line=lambda host, rank, text: said.append((host, rank, text)))
        for run in gang.runs.values():
            run.state = "running"
        for text in WORK:
            gang.events.put(("h1", {"event": "line", "text": f"[rank0]:{text}"}))
        gang.events.put(("h1", {"event": "exit", "code": 0, "done": [0]}))
        for text in WORK:
            gang.events.put(("h2", {"event": "line", "text": f"[rank1]:{text}"}))
        for text in TEARDOWN:
            gang.events.put(("h2", {"event": "line", "text": text}))
        gang.events.put(("h2", {"event": "exit", "code": 0, "done": [1]}))
        result = gang.wait()
    assert result.ok, result.reason
    terminal = "\n".join(text for _, _, text in said)
    assert "Traceback" not in terminal and "DistNetworkError" not in terminal and "Failed to recv" not in terminal, terminal
    notes = [(host, text) for host, rank, text in said if "teardown" in text]
    assert notes == [("h2", (f"torchrun's teardown after every rank here finished met the master's closed store: not a failure "
                             f"({len(TEARDOWN)} line(s) kept in /root/.mnft/runs/R/h2/output.log on h2)"))]
    assert [text for _, text in gang.runs["h2"].tail][-len(TEARDOWN):] == TEARDOWN  # kept: the host's log, its tail


def test_a_host_mnft_stopped_says_nothing_of_its_teardown(tmp_path):
    run = HostRun(launch("h2", 1, tmp_path), stopping=True)
    with Fleet(TWO_HOSTS) as fleet:
        said: list[str] = []
        gang = Gang(fleet, [launch("h1", 0, tmp_path)], "R", LaunchOptions(grace=0.5), {}, on_line=lambda h, r, t: said.append(t))
        gang.runs["h2"] = run
        for text in TEARDOWN:
            gang._handle("h2", {"event": "line", "text": text})
        gang._handle("h2", {"event": "exit", "code": 0})
    assert said == []


def test_c10ds_hostname_warning_on_every_run_is_kept_in_the_log_and_off_the_terminal():
    """Issue 36: `[c10d] The hostname of the client socket cannot be retrieved` came on every run (no PTR record for a
    peer's address), from torchrun and from the ranks."""
    noise = TeardownNoise()
    warning = "[W1128 12:00:00.123456789 socket.cpp:755] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    assert noise.hides(None, warning) and noise.hides(0, warning) and noise.hides(3, warning)
    assert not noise.hides(0, "step 21 loss 0.2474") and not noise.hides(None, "[W1128 12:00:00.1 socket.cpp:9] [c10d] another warning")
    assert noise.note("output.log", 0) is None  # nothing to say for it



# what torch 2.13's torchrun prints when it is sent SIGTERM (`mnft stop` from another shell): its agent's warnings,
# then the SignalException's traceback (about 60 lines with the workers' own on a real run; a few frames kept here)
SIGTERM_AT = "W1128 12:00:00.000000 4242 site-packages/torch/distributed/elastic/agent/server/api.py:719] "
SHUTDOWN = [
    SIGTERM_AT + "Received 15 death signal, shutting down workers",
    "W1128 12:00:00.000000 4242 site-packages/torch/distributed/elastic/multiprocessing/api.py:908] Sending process 4243 closing signal SIGTERM",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/runpy.py", line 198, in _run_module_as_main',
    "    return _run_code(code, main_globals, None,",
    '  File "/usr/lib/python3/dist-packages/torch/distributed/elastic/multiprocessing/api.py", line 84, in _terminate_process_handler',
    '    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)',
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15",
]
# the other host's rank, whose peer was stopped first: its collective fails on the closed connection
PEER_GONE = ["[rank1]:Traceback (most recent call last):", '[rank1]:  File "train.py", line 30, in <module>',
             "[rank1]:RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:29500"]


def test_a_run_mnft_stop_ends_from_another_shell_keeps_every_hosts_shutdown_off_the_terminal(tmp_path):
    """Issue 45: `mnft stop` put torchrun's SignalException tracebacks (~60 lines) into the attached run's terminal.
    The host's agent marks the run before the first signal and says so (`stopping`) before any line the signal made:
    from then on every host's output stays in its log (a peer's ranks fail on the stopped host's: kept too)."""
    said: list[tuple[str, int | None, str]] = []
    with Fleet(TWO_HOSTS) as fleet:
        gang = Gang(fleet, [launch("h1", 0, tmp_path), launch("h2", 1, tmp_path)], "R", LaunchOptions(grace=0.5), {},
                    on_line=lambda host, rank, text: said.append((host, rank, text)))
        for run in gang.runs.values():
            run.state = "running"
        gang._handle("h1", {"event": "line", "text": "[rank0]:step 20 loss 1.234"})
        gang._handle("h1", {"event": "stopping", "by": "mnft stop"})
        for text in SHUTDOWN:
            gang._handle("h1", {"event": "line", "text": text})
        for text in PEER_GONE:
            gang._handle("h2", {"event": "line", "text": text})
        gang._handle("h1", {"event": "exit", "code": 1})
    terminal = "\n".join(text for _, _, text in said)
    assert "Traceback" not in terminal and "SignalException" not in terminal and "Connection closed" not in terminal, terminal
    assert [text for _, _, text in said] == ["step 20 loss 1.234", "stopped by `mnft stop`: each host's shutdown is kept in its log "
                                             "(/root/.mnft/runs/R/h1/output.log on h1), not shown"]
    assert [text for _, text in gang.runs["h1"].tail][-len(SHUTDOWN):] == SHUTDOWN  # kept: the host's log, its tail


def test_the_hosts_agent_says_the_run_is_being_stopped_before_the_lines_its_signal_made(tmp_path, capsys):
    import json

    from mnft.onhost import follow, launcher, runfiles

    (tmp_path / "output.log").write_text("[rank0]:step 20 loss 1.234\n")
    out, said = follow._Tail(str(tmp_path / "output.log")), []
    launcher.forward_lines(str(tmp_path), out, None, said)
    assert runfiles.mark_stop(str(tmp_path))  # `mnft stop`: the mark, then the signal, then torchrun's shutdown
    with open(tmp_path / "output.log", "a") as log:
        log.write("".join(line + "\n" for line in SHUTDOWN))
    launcher.forward_lines(str(tmp_path), out, None, said)
    launcher.forward_lines(str(tmp_path), out, None, said)
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["line", "stopping"] + ["line"] * len(SHUTDOWN)
    assert events[1] == {"event": "stopping", "by": "mnft stop"}


def test_the_collected_log_of_a_succeeded_run_says_what_torchruns_teardown_lines_are(tmp_path, monkeypatch):
    """Issue 45: a succeeded 2-host run's collected log ended with h2's `Error waiting on exit barrier … DistNetworkError:
    Failed to recv, got 0 bytes` traceback (the master's torchrun had passed the barrier and closed its store). `logs`
    shows them as the run's terminal did, one line that says what they are, and summary.json says it for the host;
    the lines stay in the collected output.log."""
    from rich.console import Console

    from mnft.run import logs, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R8", state="succeeded", job={"entry": ["train.py"]}, hosts={"h1": {"node_rank": 0}, "h2": {"node_rank": 1}},
                                      inventory={"hosts": [{"slots": 1}, {"slots": 1}]})
    for name, rank, end in (("h1", 0, []), ("h2", 1, TEARDOWN)):
        (record.path / name / "run").mkdir(parents=True)
        (record.path / name / "run" / "output.log").write_text("".join(f"{line}\n" for line in [f"[rank{rank}]:{t}" for t in WORK] + end))
        (record.path / name / "run" / "exit_code").write_text("0\n")
    console = Console(width=400, record=True)
    logs.merged_tail(record, 40, console)
    text = console.export_text()
    assert "Traceback" not in text and "DistNetworkError" not in text and "frame #" not in text, text
    log = record.path / "h2" / "run" / "output.log"
    note = f"torchrun's teardown after every rank here finished met the master's closed store: not a failure ({len(TEARDOWN)} line(s) kept in {log})"
    assert f"h2| {note}" in text and "h2 r1| done" in text
    summary = json.loads((record.path / "summary.json").read_text())
    assert summary["hosts"]["h2"]["note"] == note and "note" not in summary["hosts"]["h1"]
    assert log.read_text().endswith(TEARDOWN[-1] + "\n")  # kept whole in the collected log
