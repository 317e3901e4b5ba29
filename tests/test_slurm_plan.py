"""mnft.slurm's pure parts: options checked, the sbatch script and srun command lines rendered, Slurm's answers
parsed, the node side's choice of its launch. Data in, text out; no Slurm needed."""

from __future__ import annotations

import pytest

from mnft.core.errors import InputError
from mnft.hosts.pyrun import BOOTSTRAP
from mnft.hosts.settings import Host
from mnft.slurm import cluster, plan
from mnft.onhost import slurmnode
from mnft.slurm.plan import SlurmOptions


def script(options: SlurmOptions | None = None) -> str:
    options = options or SlurmOptions(nodes=2)
    return plan.batch_script(options, run_id="R1", label="recipe lora", python="/opt/py/bin/python", runs_root="/home/u/runs",
                             workdir="/home/u/runs/R1", output="/home/u/runs/R1/slurm-%j.out", steps=["1. check", "2. agents"])


def test_the_script_asks_one_task_per_node_appends_its_output_and_continues_the_run_in_the_allocation():
    text = script(SlurmOptions(nodes=2, partition="gpu", time="1-02:00:00", account="lab", gpus_per_node=4, requeue=True, signal="USR2@120",
                               sbatch_args=("--exclusive", "--mem=0")))
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=mnft-R1", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu", "#SBATCH --account=lab",
        "#SBATCH --time=1-02:00:00", "#SBATCH --gpus-per-node=4", "#SBATCH --output=/home/u/runs/R1/slurm-%j.out", "#SBATCH --open-mode=append",
        "#SBATCH --chdir=/home/u/runs/R1", "#SBATCH --requeue", "#SBATCH --signal=B:USR2@120", "#SBATCH --exclusive", "#SBATCH --mem=0",
    ]
    assert text.startswith("#!/bin/bash\n")
    assert text.splitlines()[-2:] == ["export MNFT_RUNS_DIR=/home/u/runs", "exec /opt/py/bin/python -m mnft.slurm.allocation R1"]
    assert "#   1. check" in text and "#   2. agents" in text


def test_without_requeue_the_job_is_not_requeued_and_no_warning_signal_is_asked():
    text = script()
    assert "#SBATCH --no-requeue" in text and "--signal" not in text


def test_the_command_words_are_quoted_for_the_shell():
    text = plan.batch_script(SlurmOptions(), run_id="R1", label="x", python="/opt/my py/python", runs_root="/home/u/my runs",
                             workdir="/home/u/runs/R1", output="/home/u/runs/R1/o")
    assert "export MNFT_RUNS_DIR='/home/u/my runs'" in text and "exec '/opt/my py/python' -m" in text


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, "--nodes 0: a whole number ≥ 1"),
    ({"partition": "gpu;rm -rf /"}, "--partition 'gpu;rm -rf /': not a Slurm name"),
    ({"account": "a b"}, "--account 'a b': not a Slurm name"),
    ({"time": "soon"}, "--time 'soon': use Slurm's format"),
    ({"time": "10", "signal": "USR2@600"}, "--signal USR2@600: 600 s before a time limit of 10"),
    ({"signal": "KILL@60"}, "--signal 'KILL@60': use SIGNAL@SECONDS"),
    ({"signal": "USR2"}, "--signal 'USR2': use SIGNAL@SECONDS"),
    ({"gpus_per_node": 0}, "--gpus-per-node 0"),
    ({"sbatch_args": ("--nodes=4",)}, "--sbatch-arg --nodes=4: mnft sets --nodes itself"),
    ({"sbatch_args": ("--comment=a b",)}, "--sbatch-arg '--comment=a b': one sbatch option"),
    ({"sbatch_args": ("--x\n#SBATCH --nodes=9",)}, "one sbatch option"),
    ({"max_requeues": -1}, "--max-restarts -1"),
])
def test_bad_options_are_bad_input(kwargs, message):
    with pytest.raises(InputError) as caught:
        SlurmOptions(**kwargs)
    assert message in str(caught.value)


@pytest.mark.parametrize("text, expected", [
    ("30", 30), ("05:30", 5.5), ("1:00:00", 60), ("2-0", 2880), ("1-01:30", 1530), ("0-00:01:30", 1.5), ("1h", None), ("", None),
])
def test_slurm_time_formats(text, expected):
    assert plan.minutes(text) == expected


def test_a_path_with_spaces_never_reaches_an_sbatch_line():
    with pytest.raises(InputError, match="without spaces"):
        plan.sbatch_options(SlurmOptions(), job_name="j", output="/home/u/my runs/o", chdir="/x")


def test_every_step_is_one_task_per_node_ended_when_one_fails_with_the_same_stdin_for_all():
    assert plan.node_step("/py", 3, "mnft-train") == [
        "srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--wait=60", "--input=all", "--label",
        "--job-name=mnft-train", "/py", "-c", BOOTSTRAP]
    assert plan.check_args("/w", ["torch", "peft", "torch"]) == ["facts", "--workdir", "/w", "--modules", "peft,torch"]
    assert plan.script_line("probe", ["facts"]) == {"mode": "script", "payload": plan.payload64("probe"), "args": ["facts"]}


def test_the_allocation_nodes_become_an_inventory_in_hostnames_order():
    template = Host(name="slurm", rank=0, address="slurm", python="/py", slots=2, iface="ib0", workdir="/home/u/mnft")
    inv = plan.allocation_inventory(["n7", "n10", "n2"], template, 29500)
    assert [(h.name, h.rank, h.slots, h.iface, h.workdir) for h in inv.hosts] == [
        ("n7", 0, 2, "ib0", "/home/u/mnft"), ("n10", 1, 2, "ib0", "/home/u/mnft"), ("n2", 2, 2, "ib0", "/home/u/mnft")]
    assert inv.master_name == "n7" and inv.world_size == 6
    with pytest.raises(InputError):
        plan.allocation_inventory([], template, 29500)


def test_pieces_of_labelled_lines_are_joined_back_per_task():
    joined = plan.Pieces()
    fed = [joined.feed(line) for line in ["0: +ab", "1: |x", "0: +cd", "srun: error: h2: task 1: Exited", "0: |ef", " 12: plain"]]
    assert fed == [None, (1, "x"), None, (None, "srun: error: h2: task 1: Exited"), (0, "abcdef"), (12, "plain")]


def test_the_node_side_cuts_long_lines_into_pieces_the_batch_joins():
    line = "x" * (slurmnode.PIECE * 2 + 7)
    joined = plan.Pieces()
    out = [joined.feed(f"3: {piece}") for piece in slurmnode.pieces(line + "\n")]
    assert out[-1] == (3, line) and all(o is None for o in out[:-1])
    assert slurmnode.pieces("") == ["|"]


def test_a_node_takes_the_launch_at_its_slurm_nodeid_only_when_the_plan_made_it_for_that_node():
    launches = [{"node": "h1", "spec": {}}, {"node": "h2", "spec": {}}]
    assert slurmnode.choose(launches, 1, "h2") == (launches[1], None)
    launch, why = slurmnode.choose(launches, 1, "h9")
    assert launch is None and "SLURM_NODEID 1 is h9" in why
    assert slurmnode.choose(launches, 2, "h3")[0] is None


def test_sinfo_partitions_and_the_request_checked_against_them():
    text = "debug*|up|h1|idle\ndebug*|up|h2|down*\ngpu|up|g1|mixed\ngpu|up|g2|allocated\n"
    parts = cluster.parse_sinfo(text)
    assert parts["debug"].default and parts["debug"].nodes == ("h1", "h2") and parts["debug"].usable == ("h1",)
    assert parts["gpu"].usable == ("g1", "g2")
    assert cluster.check_request(parts, None, 2).name == "debug"
    with pytest.raises(InputError, match="--partition cpu: no such partition .this Slurm has: debug, gpu."):
        cluster.check_request(parts, "cpu", 1)
    with pytest.raises(InputError, match="--nodes 3: partition gpu has 2 node"):
        cluster.check_request(parts, "gpu", 3)


def test_scontrol_show_job_and_sbatch_answers_parsed():
    line = ("JobId=12 JobName=mnft-R1 JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 ExitCode=0:0 "
            "RunTime=00:00:00 TimeLimit=00:10:00 NodeList=h[1-2] Command=/x y")
    state = cluster.job_state(cluster.parse_scontrol_job(line), "12", expand=lambda nl: ["h1", "h2"])
    assert (state.state, state.reason, state.restarts, state.nodes, state.time_limit) == ("PENDING", "BeginTime", 1, ("h1", "h2"), "00:10:00")
    assert not state.ended
    assert cluster.job_state({}, "12").ended
    assert cluster.parse_submitted("42\n") == "42" and cluster.parse_submitted("42;cluster") == "42"
    with pytest.raises(cluster.SlurmError):
        cluster.parse_submitted("sbatch: error: Batch job submission failed")


def test_missing_slurm_clients_are_bad_input():
    assert cluster.missing_clients(lambda name: None if name == "sbatch" else f"/usr/bin/{name}") == ["sbatch"]
    with pytest.raises(InputError, match="sbatch, srun, squeue, scontrol, scancel, sinfo missing"):
        cluster.require_clients(lambda name: None)


def test_the_recipes_save_request_is_set_by_the_named_signal_only():
    import os
    import signal

    from mnft.recipes.common import SaveRequest

    before = signal.getsignal(signal.SIGUSR2)
    try:
        assert SaveRequest({}).name is None and signal.getsignal(signal.SIGUSR2) == before  # nothing installed
        request = SaveRequest({"MNFT_SAVE_SIGNAL": "USR2"})
        os.kill(os.getpid(), signal.SIGUSR2)
        assert request.requested and request.name == "USR2"
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_the_check_step_names_a_node_that_does_not_see_the_synced_workdir_with_what_to_do_under_slurm():
    from mnft.slurm.allocation import unseen_workdir

    inventory = plan.allocation_inventory(["node0", "node1"], Host(name="t", rank=0, address="t", workdir="/home/u/mnft"), 29500)
    facts = {"node0": {"disk": {"path": "/home/u/mnft", "workdir": "/home/u/mnft"}},
             "node1": {"disk": {"path": "/home/u", "workdir": "/home/u/mnft"}}}  # the probe measured a parent: no such directory
    (problem,) = unseen_workdir(inventory, facts)
    assert (problem.host, problem.field, problem.severity) == ("node1", "workdir", "error")
    assert problem.message.startswith("/home/u/mnft does not exist on this node: the nodes do not see the login node's workdir")
    assert "to a directory on the shared filesystem" in problem.fix and "docs/slurm.md" in problem.fix and "invoke sync" not in problem.fix
    assert unseen_workdir(inventory, {"node0": facts["node0"]}) == []
