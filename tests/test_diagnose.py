"""Every bad ending named by one cause line and one fix line (mnft.run.diagnose), from what torch 2.13 and torchrun
really print: the lines below were captured from real runs of CPU scripts (gloo) on this machine."""

from __future__ import annotations

from mnft.run.diagnose import Evidence, after_work, diagnose
from mnft.run.recover import Cause, Seen, classify

RANKS = {"h1": (0,), "h2": (1,)}


def evidence(host: str, lines: list[str], *, rank: int | None = None, kind: str | None = None, tails=None, **extra) -> Evidence:
    cause = classify(Seen(failed_host=host, host_state="exited", exit_code=1, tail=tuple(lines), traceback=tuple(lines[-3:]), first_step=True))
    if kind is not None:
        cause = Cause(kind, host, cause.detail)
    return Evidence(cause=cause, rank=rank, trace=tuple(lines[-3:]), tail=tuple(lines), tails=tails or {}, ranks=RANKS, master="h1",
                    python={"h1": "/opt/env/bin/python", "h2": "/opt/env/bin/python"}, **extra)


def test_a_missing_module_names_host_rank_module_python_and_the_fix():
    found = diagnose(evidence("h2", ["Traceback (most recent call last):", '  File "/root/mnft/train.py", line 9, in <module>',
                                     "ModuleNotFoundError: No module named 'definitely_not_installed_pkg'"], rank=1))
    assert found.kind == "module-not-found"
    assert found.cause == "h2 rank 1: no module named 'definitely_not_installed_pkg' in /opt/env/bin/python"
    assert found.fix.startswith("add definitely_not_installed_pkg to the lock and run `mnft provision`")


def test_cuda_out_of_memory_gives_torchs_figures_and_the_levers():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of "
            "which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.")
    found = diagnose(evidence("h1", ["Traceback (most recent call last):", line], rank=0))
    assert found.kind == "cuda-oom"
    assert found.cause == "h1 rank 0: CUDA out of memory: tried to allocate 2.00 GiB on GPU 0 (79.15 GiB in all, 1.02 GiB free)"
    assert all(lever in found.fix for lever in ("batch size", "LoRA", "activation (gradient) checkpointing"))


def test_a_full_disk_is_named_whether_python_or_torch_save_failed():
    plain = diagnose(evidence("h2", ["OSError: [Errno 28] No space left on device: '/data/out/ckpt.pt'"], rank=1))
    assert (plain.kind, plain.cause) == ("disk-full", "h2 rank 1: no space left on the device writing /data/out/ckpt.pt")
    assert "free disk space on h2" in plain.fix
    save = diagnose(evidence("h1", ["RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"], rank=0))
    assert save.kind == "disk-full"


def test_a_taken_rendezvous_port_names_the_port_and_who_holds_it():
    line = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29618, "
            "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    found = diagnose(evidence("h1", [line], holder="python3 pid 4242"))
    assert found.kind == "address-in-use"
    assert found.cause == "h1: the rendezvous port 29618 is already in use (held by python3 pid 4242)"
    assert "another port" in found.fix


def test_a_host_that_never_joined_the_rendezvous_is_named_and_a_firewall_seen_by_the_check_is_the_fix():
    lines = ["torch.distributed.DistStoreError: Timed out after 21 seconds waiting for clients. 1/2 clients joined."]
    tails = {"h1": ((None, lines[0]),), "h2": ()}
    found = diagnose(evidence("h1", lines, tails=tails))
    assert found.kind == "rendezvous-timeout"
    assert found.cause == "the rendezvous timed out after 21s: 1 of 2 hosts joined; never joined: h2"
    assert "did not start or connect" in found.fix
    blocked = diagnose(evidence("h1", lines, tails=tails, reached={"h2": False}))
    assert blocked.fix.startswith("h2 could not reach the master's port in the check: open it in the firewall")


def test_a_host_that_cannot_connect_to_the_rendezvous_is_named():
    line = ("[E1125 06:33:43.805452563 socket.cpp:1028] [c10d] The client socket has timed out after 15000ms while trying to "
            "connect to (10.9.0.1, 29606).")
    found = diagnose(evidence("h2", [line]))
    assert (found.kind, found.cause) == ("rendezvous-timeout", "h2 could not reach the rendezvous at 10.9.0.1:29606 within 15s")


def test_a_rank_that_never_joined_the_process_group_is_named_from_the_key_it_was_waited_for():
    line = "[mnft-rank 0]: torch.distributed.DistStoreError: wait timeout after 15000ms, keys: /default_pg/0//cpu//0/1"
    found = diagnose(evidence("h1", [line], rank=0))
    assert found.cause == "h1 rank 0 waited 15s for the other ranks to join the process group; rank 1 on h2 never came"


def test_host_memory_that_torch_could_not_allocate_is_named_with_its_size():
    line = ("[mnft-rank 0]: RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 70368744177664 bytes. Error code 12 (Cannot allocate memory)")
    found = diagnose(evidence("h1", [line], rank=0))
    assert (found.kind, found.cause) == ("host-oom", "h1 rank 0: out of host memory: could not allocate 65536.0 GiB")


def test_a_collective_timeout_names_the_ranks_that_waited_and_the_one_that_never_came():
    line = ("[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
            "waiting 10000ms for recv operation to complete")
    tails = {"h1": ((0, line),), "h2": ((1, "step 3 done"),)}
    found = diagnose(evidence("h1", [line], rank=0, tails=tails, straggler="straggler h2: compute 3.1× the median host"))
    assert found.kind == "collective-timeout"
    assert found.cause == "a collective timed out: rank(s) 0 waited, rank(s) 1 on h2 never arrived (straggler h2: compute 3.1× the median host)"
    assert found.fix.startswith("see what h2 was doing")


def test_the_kernels_oom_killer_and_a_plain_kill_are_told_apart():
    summary = ["Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 9007)  (SIGKILL)"]
    oom = Cause("signal", "h2", "h2 rank 1 was killed by SIGKILL (the kernel's OOM killer: out of memory)")
    found = diagnose(Evidence(cause=oom, rank=1, tail=tuple(summary), ranks=RANKS))
    assert (found.kind, found.cause) == ("host-oom", "h2 rank 1 was killed by the kernel's OOM killer: h2 ran out of memory")
    killed = diagnose(evidence("h2", summary, rank=1))
    assert (killed.kind, killed.cause) == ("killed", "h2 rank 1 was killed by SIGKILL")


def test_an_exception_followed_by_an_abort_at_exit_is_named_by_the_exception():
    lines = ["[rank1]: Traceback (most recent call last):", "[rank1]:   File \"t.py\", line 11, in <module>",
             "FileNotFoundError: [Errno 2] No such file or directory: '/data/x'", "terminate called without an active exception",
             "Root Cause (first observed failure):", "  rank      : 1 (local_rank: 0)", "  exitcode  : -6 (pid: 17122)  (SIGABRT)"]
    cause = classify(Seen("h2", "exited", 1, tuple(lines), tuple(lines[:3]), first_step=True))
    found = diagnose(Evidence(cause=cause, rank=1, trace=tuple(lines[:3]), tail=tuple(lines)))
    assert found.cause == "h2 rank 1 failed: FileNotFoundError: [Errno 2] No such file or directory: '/data/x' (and then aborted while exiting)"


def test_a_non_finite_loss_and_a_lost_host_keep_recoverys_words_with_a_fix():
    found = diagnose(Evidence(cause=Cause("non-finite", "h1", "h1 rank 0: the loss or gradients were not finite at step 12", 12)))
    assert found.kind == "non-finite" and "at step 12" in found.cause and "learning rate" in found.fix
    lost = diagnose(Evidence(cause=Cause("host-lost", "h2", "h2 stopped answering (link cut or machine down)")))
    assert lost.kind == "host-lost" and "spare: true" in lost.fix


def test_anything_else_is_the_exit_code_and_the_tracebacks_last_line():
    lines = ["Traceback (most recent call last):", "RuntimeError: planned failure at step 6", "Root Cause (first observed failure):",
             "  rank      : 1 (local_rank: 0)", "  exitcode  : 1 (pid: 8398)"]
    found = diagnose(Evidence(cause=classify(Seen("h2", "exited", 1, tuple(lines), tuple(lines[:2]), first_step=True)), rank=1, trace=tuple(lines[:2])))
    assert (found.kind, found.cause) == ("failed", "h2 rank 1 exited with code 1: RuntimeError: planned failure at step 6")


def test_an_abort_while_the_interpreter_exits_after_the_work_is_a_warning_with_its_fix():
    summary = ["[mnft-rank 0]: rank 0 done", "Root Cause (first observed failure):", "[0]:", "  rank      : 0 (local_rank: 0)",
               "  exitcode  : -6 (pid: 9209)  (SIGABRT)"]
    found = after_work("h1", summary)
    assert found.cause == "h1: rank 0 was killed by SIGABRT while the interpreter exited, after its work was done"
    assert found.fix.startswith("call torch.distributed.destroy_process_group() at the end of the script")


def test_a_container_killed_from_outside_is_said_as_a_kill_not_an_exit_code_and_no_traceback_is_asked_for():
    """Issue 36: `podman kill` of one host's container: `podman run` exits 137 and torchrun printed no summary (it was
    killed with it). The cause says the container was killed, the fix says where to look; no traceback is promised."""
    tail = ("rank=1 attempt=1", "[W1128 12:34:26.656 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved")
    seen = Seen(failed_host="node2", host_state="exited", exit_code=137, tail=tail, first_step=True, container=True)
    cause = classify(seen)
    assert (cause.kind, cause.code, cause.detail) == ("signal", 137, "node2's container was killed by SIGKILL (exit code 137) from outside the run")
    found = diagnose(Evidence(cause=cause, tail=tail))
    assert found.kind == "killed" and "traceback" not in found.fix and "journalctl -k" in found.fix
    bare = classify(Seen(failed_host="node2", host_state="exited", exit_code=-15, tail=tail, first_step=True))
    assert bare.detail == "node2's torchrun was killed by SIGTERM from outside the run"


def test_a_failure_without_a_traceback_points_at_the_hosts_last_lines_not_at_a_traceback():
    cause = classify(Seen(failed_host="node2", host_state="exited", exit_code=3, tail=("saving…",), first_step=True))
    found = diagnose(Evidence(cause=cause, tail=("saving…",)))
    assert (found.kind, cause.detail) == ("failed", "node2 exited with code 3")
    assert "traceback above" not in found.fix and "node2's last lines" in found.fix


def test_every_fix_holds_wherever_it_is_shown():
    """Issue 36: the board shows a failure's fix above the hosts' lines, `status` without them, `train` after them:
    "read the failing rank's traceback above" was wrong on the board. A fix names the host whose output holds the
    traceback, never a place on the screen; the siblings: a failure before the first step, an exception followed
    by an abort at exit, a failure that printed no traceback."""
    trace = ["Traceback (most recent call last):", '  File "steps.py", line 9, in <module>', "RuntimeError: planned failure at step 6"]
    bad = ["Traceback (most recent call last):", "FileNotFoundError: [Errno 2] No such file or directory: 'data.json'"]
    startup = classify(Seen("h2", "exited", 1, tuple(bad), tuple(bad), first_step=False))
    aborted = Cause("signal", "h2", "h2 rank 1 was killed by SIGABRT")
    found = [diagnose(evidence("h2", trace, rank=1)), diagnose(Evidence(cause=startup, rank=1, trace=tuple(bad), tail=tuple(bad))),
             diagnose(Evidence(cause=aborted, rank=1, trace=tuple(trace), tail=tuple(trace))),
             diagnose(Evidence(cause=classify(Seen(failed_host="h2", host_state="exited", exit_code=3, tail=("saving…",), first_step=True)),
                               tail=("saving…",)))]
    assert [f.kind for f in found] == ["failed", "startup", "failed", "failed"]
    for f in found:
        assert not any(word in f.fix for word in ("above", "below")), f.fix
        assert "h2's" in f.fix and "`mnft logs`" in f.fix
    assert found[0].fix == "read h2 rank 1's traceback in h2's output (all of it: `mnft logs`)"


def test_a_gpus_new_xid_names_the_run_ahead_of_the_error_the_job_printed_and_says_drain_and_reset():
    from mnft.run.recover import GpuXid

    lines = ["Traceback (most recent call last):", "RuntimeError: CUDA error: an illegal memory access was encountered"]
    fell = GpuXid("h2", 1, 79, 1000.0, "pid=7, name=python3, GPU has fallen off the bus.")
    cause = classify(Seen("h2", "exited", 1, tail=tuple(lines), traceback=tuple(lines), first_step=True, xids=(fell,)))
    found = diagnose(Evidence(cause=cause, rank=1, trace=tuple(lines), tail=tuple(lines), ranks=RANKS, master="h1"))
    assert found.kind == "gpu-xid" and "Xid 79 (fallen off the bus) on h2 GPU 1" in found.cause
    assert found.fix.startswith("Xid 79 needs the GPU reset: drain it (`mnft drain HOST:GPU --reason …` for h2:1)")
    app = classify(Seen("h2", "exited", 1, tail=tuple(lines), traceback=tuple(lines), first_step=True, xids=(GpuXid("h2", 1, 31, 1000.0, "MMU Fault"),)))
    assert diagnose(Evidence(cause=app, tail=tuple(lines))).fix.startswith("an Xid of this kind is usually the job's own fault")


# torchrun 2.13's summary after a rank exited without a traceback (argparse's error: exit code 2)
CHILD_FAILED = ["Traceback (most recent call last):", '  File "/opt/env/bin/torchrun", line 8, in <module>', "    sys.exit(main())",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                "============================================================", "train.py FAILED",
                "------------------------------------------------------------", "Failures:", "  <NO_OTHER_FAILURES>",
                "------------------------------------------------------------", "Root Cause (first observed failure):", "[0]:",
                "  time      : 2026-11-23_06:07:37", "  host      : h1", "  rank      : 0 (local_rank: 0)", "  exitcode  : 2 (pid: 4242)",
                "  error_file: <N/A>", "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
                "============================================================"]


def test_a_rank_that_fails_before_its_first_step_without_a_traceback_is_quoted_in_its_own_words():
    """Issue 45: `-- train.py --lr abc` ended `h1 rank 0 failed before the first step: exit code 2`; the script had said
    why (argparse: `train.py: error: argument --lr: invalid float value: 'abc'`), and the cause must quote it."""
    from mnft.run.gang import failure_excerpt

    said = "train.py: error: argument --lr: invalid float value: 'abc'"
    tail = [(0, "usage: train.py [-h] [--lr LR] [--steps STEPS]"), (0, said), (1, "usage: train.py [-h] [--lr LR] [--steps STEPS]"),
            (1, said), *[(None, line) for line in CHILD_FAILED]]
    rank, trace = failure_excerpt(tail)
    assert (rank, trace) == (0, ["usage: train.py [-h] [--lr LR] [--steps STEPS]", said])
    cause = classify(Seen("h1", "exited", 1, tuple(t for _, t in tail), tuple(trace), first_step=False))
    assert (cause.kind, cause.detail) == ("startup", f"h1 rank 0 failed before the first step: {said}")
    found = diagnose(Evidence(cause=cause, rank=0, trace=tuple(trace), tail=tuple(t for _, t in tail)))
    assert found.cause == f"h1 rank 0 failed before the first step: {said}"
    # a script's own `sys.exit("…")` after steps: a failure, in its words; a rank killed says nothing: no quote
    tail = [(0, "step 3 loss 1.2"), (0, "error: the dataset shard data-3.bin is truncated"), *[(None, line) for line in CHILD_FAILED]]
    cause = classify(Seen("h1", "exited", 1, tuple(t for _, t in tail), tuple(failure_excerpt(tail)[1]), first_step=True))
    assert cause.detail == "h1 rank 0 exited with code 2: error: the dataset shard data-3.bin is truncated"
    assert failure_excerpt([(0, "step 3 loss 1.2"), *[(None, line) for line in CHILD_FAILED]]) == (0, [])
