"""`train --slurm` with an image, its pure and host-side parts: the allocation's check of a job in an image (every
node's facts and the image's in one step, then the probe inside the image on every node by its own command line),
the facts merged as `check --image` merges them, the image's rules refusing an attempt, each node's runtime built
for the launch plan; mnft.onhost.slurmnode's command mode and a script's input; the dry run's honest command. No Slurm:
the steps' answers are data (the cluster test is tests/test_cluster_slurm_image.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mnft.onhost import probe
from mnft.hosts import pyrun
from mnft.hosts.pyrun import BOOTSTRAP
from mnft.hosts.settings import Host
from mnft.run.job import Job
from mnft.slurm import allocation, plan

from mnft.onhost import slurmnode
IMAGE = "localhost/lab-train:3"
ID = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


def run_node(line: dict, node_id: int, timeout: float = 60) -> list[str]:
    """mnft.onhost.slurmnode as srun starts it on the node with SLURM_NODEID node_id, its stdin this one line: the whole
    lines it printed (its pieces joined back as the batch joins them)."""
    env = dict(os.environ, SLURM_NODEID=str(node_id))
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP], input=pyrun.payload("slurmnode") + json.dumps(line).encode() + b"\n", capture_output=True, env=env,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr.decode()
    joined = plan.Pieces()
    out = [joined.feed(f"{node_id}: {raw}") for raw in done.stdout.decode().splitlines()]
    return [whole[1] for whole in out if whole is not None]


# ------------------------------------------------------------------------------------------------ the node side


def test_each_node_runs_its_own_command_with_the_input_and_says_how_it_ended_in_one_line():
    upper = [sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.stderr.write('said\\n'); sys.exit(3)"]
    line = plan.command_line([None, upper], "hello", 30)
    assert line["mode"] == "command" and line["commands"] == [None, upper] and line["timeout"] == 30.0
    ran = allocation.inside_ran(run_node(line, 1), "")
    assert (ran["exit_code"], ran["stdout"].strip(), ran["stderr"].strip(), ran["error"]) == (3, "HELLO", "said", None)
    assert isinstance(ran["seconds"], float)
    # a node without a command says so; a command that cannot start is said, and the task still ends 0 (srun's
    # --kill-on-bad-exit must not end the other nodes' probes for it)
    assert json.loads(run_node(line, 0)[-1])["ran"] is None
    ran = allocation.inside_ran(run_node(plan.command_line([["/nonexistent/podman", "run"]], "", 5), 0), "")
    assert ran["exit_code"] is None and ran["error"].startswith("/nonexistent/podman: ")


def test_a_command_that_does_not_end_in_time_is_said_not_waited_for():
    ran = allocation.inside_ran(run_node(plan.command_line([[sys.executable, "-c", "import time; time.sleep(30)"]], "", 0.5), 0), "")
    assert ran["exit_code"] is None and ran["error"] == "no answer within 0.5s"


def test_a_script_reads_the_lines_input_after_its_payload():
    import base64
    import marshal

    from mnft.hosts import payload

    echo = "import sys\ndef main(argv):\n    print('got ' + sys.stdin.read().strip())\n"
    shipped = base64.b64encode(payload.pack("x", {"x": (echo.encode(), marshal.dumps(compile(echo, "x", "exec")))})).decode()
    assert run_node(dict(plan.script_line("probe", [], input='{"image": "x"}\n'), payload=shipped), 0) == ['got {"image": "x"}']
    assert "input" not in plan.script_line("probe", [])  # the other steps' lines are as before


def test_the_probe_in_image_facts_mode_answers_the_nodes_facts_and_the_images_through_the_node_script(tmp_path):
    """The check step's script as the allocation sends it: the probe (imagehost in its payload), its request on stdin
    (a runtime setting, the image); a runtime that is not there is said in the image's facts, the host's facts come."""
    request = json.dumps({"runtime": str(tmp_path / "no-podman"), "image": IMAGE}) + "\n"
    lines = run_node(plan.script_line("probe", plan.image_check_args(str(tmp_path)), input=request), 0)
    host_facts, container, error = allocation.image_facts_reply(lines, "")
    assert isinstance(host_facts, dict) and host_facts["disk"]["workdir"] == str(tmp_path)
    assert container["runtime"] is None and "no-podman" in container["error"] and container["image"]["present"] is False
    assert error is None


def test_a_node_that_printed_no_facts_is_named_with_its_last_line():
    assert allocation.image_facts_reply(["Traceback (most recent call last):", "OSError: boom"], "") == (None, None, "OSError: boom")
    assert allocation.image_facts_reply([], "srun: error: h2: task 1: Exited with exit code 1") == \
        (None, None, "srun: error: h2: task 1: Exited with exit code 1")
    facts, container, error = allocation.image_facts_reply([json.dumps({"facts": {"disk": {}}})], "")
    assert (facts, container, error) == ({"disk": {}}, None, "the probe sent no facts of the image")
    assert allocation.inside_ran([], "srun: error: task 0 killed")["error"].endswith("srun: error: task 0 killed")


# ------------------------------------------------------------------------------------------------ the allocation's check


@pytest.fixture(scope="module")
def local_facts(tmp_path_factory):
    """This machine's facts as a node's probe gives them in image-facts mode (its own, without its Python's packages),
    and its Python's as the probe inside an image gives them."""
    workdir = tmp_path_factory.mktemp("workdir")
    return str(workdir), probe.facts(str(workdir), packages=False), probe.python_facts(["json"])


def container(image_id: str | None, present: bool = True) -> dict:
    return {"runtime": "podman", "path": "/usr/bin/podman", "version": "4.3.1", "uid": 1000, "gid": 1000, "home": "/home/u",
            "rootless": True, "cdi": False, "gpus": False, "image": {"ref": IMAGE, "present": present, "id": image_id}, "error": None}


class FakeRecord:
    def __init__(self, path: Path) -> None:
        self.path, self.data, self.run_id = path, {"job_id": "R"}, "R"
        self.updates: list[dict] = []

    def update(self, **fields) -> None:
        self.updates.append(fields)

    def save(self) -> None:
        pass


class Steps:
    """The two srun steps as data: step 1 answers each node's facts and image facts; step 2 the probe inside."""

    def __init__(self, host_facts: dict, containers: list[dict], inside: dict) -> None:
        self.host_facts, self.containers, self.inside = host_facts, containers, inside
        self.calls: list[dict] = []

    def __call__(self, inventory, name, script, args, input=None, line=None):
        self.calls.append({"name": name, "script": script, "args": args, "input": input, "line": line})
        if line is None:
            return {i: [json.dumps({"container": c, "container_error": None}), json.dumps({"facts": self.host_facts})]
                    for i, c in enumerate(self.containers)}, ""
        ran = {"exit_code": 0, "stdout": "noise\n" + json.dumps(self.inside) + "\n", "stderr": "", "error": None, "seconds": 1.2}
        return {i: [json.dumps({"ran": ran if command else None, "event": "ran"})] for i, command in enumerate(line["commands"])}, ""


def the_allocation(tmp_path: Path, workdir: str, steps: Steps, runtime: str | None = None) -> tuple[allocation.Allocation, object]:
    alloc = allocation.Allocation.__new__(allocation.Allocation)
    alloc.record = FakeRecord(tmp_path)
    alloc.console = Console(record=True, width=300)
    alloc.slurm = {"needs": [{"module": "json", "where": "train.py:1"}]}
    alloc.job = Job(entry=("train.py",), image=IMAGE)
    alloc.report = None
    alloc.script_step = steps
    template = Host(name="t", rank=0, address="t", python="/usr/bin/python3", workdir=workdir, container_runtime=runtime)
    return alloc, plan.allocation_inventory(["node0", "node1"], template, 29500)


def test_a_job_in_an_image_is_checked_inside_the_image_on_every_node_and_each_node_gets_its_runtime(tmp_path, local_facts):
    workdir, host_facts, inside = local_facts
    steps = Steps(host_facts, [container(ID), container(ID)], inside)
    alloc, inventory = the_allocation(tmp_path, workdir, steps, runtime="podman")
    facts = alloc.check(inventory, {"number": 1})
    first, second = steps.calls
    # step 1: the probe in image-facts mode, imagehost's source with the template's runtime setting and the image
    assert (first["name"], first["args"]) == ("mnft-check", ["image-facts", "--workdir", workdir])
    request = json.loads(first["input"])
    assert (request["runtime"], request["image"]) == ("podman", IMAGE) and first["script"] == "probe" and "imagehost" not in request
    # step 2: each node's own command line, the probe on stdin, run by the id the check just read (as train runs it)
    assert second["name"] == "mnft-check-image"
    command = second["line"]["commands"][1]
    assert command[:3] == ["/usr/bin/podman", "run", "--rm"] and "-i" in command and "--userns" in command
    at = command.index("ab" * 32)
    assert command[at + 1:] == ["python3", "-c", BOOTSTRAP, "python", "--modules", "json"]
    assert second["line"]["payload"] == plan.payload64("probe") and second["line"]["input"] == ""
    # merged as check --image merges them: the image's Python, the host's own kept apart
    assert facts["node1"]["image_probe"]["ok"] is True and facts["node1"]["image_probe"]["seconds"] == 1.2
    assert facts["node1"]["python"] == inside["python"] and facts["node1"]["host_python"] == host_facts["python"]
    assert facts["node1"]["container"]["image"]["id"] == ID
    assert [p for p in alloc.report.problems if p.severity == "error"] == []
    assert "check: 2 nodes ok" in alloc.console.export_text()
    assert json.loads((tmp_path / "check-1.json").read_text())["hosts"]["node0"]["facts"]["image_probe"]["ok"] is True
    runtimes = allocation.runtimes_of(alloc.report, alloc.job)
    assert set(runtimes) == {"node0", "node1"} and runtimes["node1"].image_id == ID and runtimes["node1"].rootless


def test_the_launch_plan_wraps_every_nodes_torchrun_in_its_container_named_after_the_run_and_node(tmp_path, local_facts):
    from mnft.run import launch

    workdir, host_facts, inside = local_facts
    alloc, inventory = the_allocation(tmp_path, workdir, Steps(host_facts, [container(ID), container(ID)], inside))
    alloc.check(inventory, {"number": 1})
    plans = launch.plan(inventory, master_addr="10.0.0.1", port=29500, run_id="R", job_id="R", options=launch.LaunchOptions(job=alloc.job),
                        ifaces={}, env={}, secret_names=(), runtimes=allocation.runtimes_of(alloc.report, alloc.job))
    assert plans[1].argv[:3] == ("/usr/bin/podman", "run", "--rm") and "mnft-R-node1" in plans[1].argv
    assert plans[1].argv[plans[1].argv.index("ab" * 32) + 1:][:3] == ("python3", "-m", "torch.distributed.run")
    assert plans[1].container["teardown"] == ["/usr/bin/podman", "rm", "--force", "--time", "5", "mnft-R-node1"]


@pytest.mark.parametrize("second, said, fix", [
    (container(None, present=False), f"node1 lacks {IMAGE}", f"mnft sync --image {IMAGE}"),
    (container(OTHER), "node1 has sha256:cdcdcdcdcdcd…, the master node0 has sha256:abababababab…", f"mnft sync --image {IMAGE} --force"),
    ({**container(None, present=False), "runtime": None, "path": None, "error": "none of podman, docker, apptainer, singularity found"},
     "no container runtime", "container_runtime"),
])
def test_a_node_without_the_image_or_with_another_is_named_and_the_attempt_refused(tmp_path, local_facts, second, said, fix):
    workdir, host_facts, inside = local_facts
    steps = Steps(host_facts, [container(ID), second], inside)
    alloc, inventory = the_allocation(tmp_path, workdir, steps)
    with pytest.raises(allocation.AttemptRefused) as refused:
        alloc.check(inventory, {"number": 1})
    assert "check failed on node1" in str(refused.value) and said in str(refused.value) and fix in str(refused.value)
    if not second["image"]["present"]:  # no command where the image is not: the rules say what it lacks
        assert steps.calls[1]["line"]["commands"][1] is None
    assert alloc.record.updates[-1]["state"] == "refused"


def test_a_probe_that_fails_inside_the_image_refuses_the_attempt_with_the_runtimes_last_word(tmp_path, local_facts):
    workdir, host_facts, inside = local_facts
    steps = Steps(host_facts, [container(ID), container(ID)], inside)

    def failing(inventory, name, script, args, input=None, line=None):
        if line is None:
            return Steps.__call__(steps, inventory, name, script, args, input, line)
        ran = {"exit_code": 127, "stdout": "", "stderr": "Error: executable file `python3` not found in $PATH", "error": None, "seconds": 0.3}
        return {0: [json.dumps({"ran": ran})], 1: [json.dumps({"ran": ran})]}, ""

    alloc, inventory = the_allocation(tmp_path, workdir, steps)
    alloc.script_step = failing
    with pytest.raises(allocation.AttemptRefused) as refused:
        alloc.check(inventory, {"number": 1})
    assert f"the probe inside {IMAGE} failed: Error: executable file `python3` not found in $PATH" in str(refused.value)


def test_no_node_with_the_image_runs_no_second_step(tmp_path, local_facts):
    workdir, host_facts, inside = local_facts
    steps = Steps(host_facts, [container(None, present=False)] * 2, inside)
    alloc, inventory = the_allocation(tmp_path, workdir, steps)
    with pytest.raises(allocation.AttemptRefused):
        alloc.check(inventory, {"number": 1})
    assert [c["name"] for c in steps.calls] == ["mnft-check"]


# ------------------------------------------------------------------------------------------------ the submit side


def test_the_nodes_carry_the_inventorys_runtime_setting():
    template = Host(name="t", rank=0, address="t", workdir="/w", container_runtime="apptainer")
    assert {h.container_runtime for h in plan.allocation_inventory(["a", "b"], template, 29500).hosts} == {"apptainer"}


def test_the_dry_run_of_a_job_in_an_image_shows_the_command_inside_and_says_the_container_command_is_the_nodes(tmp_path):
    from mnft.slurm import submit

    job = Job(entry=("train.py",), extra_args=("--lr", "1e-4"), image=IMAGE)
    request = submit.SlurmTrain(job=job, slurm=plan.SlurmOptions(nodes=2))
    template = submit.template_host(None, request.slurm)
    steps = submit.steps_text(template.python, 2, template.workdir, IMAGE)
    script = plan.batch_script(request.slurm, run_id="R", label=job.label, python="/py", runs_root=str(tmp_path), workdir=str(tmp_path),
                               output=str(tmp_path / "o"), steps=steps)
    console = Console(record=True, width=400)
    assert submit.dry_run(request, script, template, 29500, "R", "R", {}, console) == 0
    out = console.export_text()
    assert "image-facts --workdir" in out and "--job-name=mnft-check-image" in out and f"torchrun inside {IMAGE}" in out
    assert "node1 (node_rank 1" in out
    assert "  python3 -m torch.distributed.run --nnodes 2" in out and "train.py --lr 1e-4" in out
    assert f"# in the image {IMAGE}: each node runs this command inside a container of its runtime" in out
    assert "mnft-R-NODE" in out and "it is not known here" in out
    # without an image, as before
    plain = Console(record=True, width=400)
    submit.dry_run(submit.SlurmTrain(job=Job(entry=("train.py",)), slurm=plan.SlurmOptions(nodes=2)), script, template, 29500, "R", "R", {}, plain)
    shown = plain.export_text()
    assert "# in the image" not in shown and f"  {template.python} -m torch.distributed.run" in shown


def test_on_slurms_sigterm_a_node_removes_its_container_by_name_with_a_short_grace_outside_the_step(tmp_path):
    podman = {"runtime": "podman", "teardown": ["/usr/bin/podman", "rm", "--force", "--time", "5", "mnft-R-h1"]}
    assert slurmnode.removal_on_term(podman) == ["/usr/bin/podman", "rm", "--force", "--time", str(slurmnode.TERM_GRACE), "mnft-R-h1"]
    assert podman["teardown"][4] == "5"  # the spec's own is left as the agent's teardown reads it
    assert slurmnode.removal_on_term({"runtime": "docker", "teardown": ["docker", "rm", "--force", "n"]}) == ["docker", "rm", "--force", "n"]
    assert slurmnode.removal_on_term({"runtime": "apptainer", "teardown": None}) is None and slurmnode.removal_on_term(None) is None
    mark = tmp_path / "removed"
    slurmnode.detached([sys.executable, "-c", f"import time; time.sleep(0.3); open({str(mark)!r}, 'w').write('x')"])
    assert not mark.exists()  # not waited for: it runs on after the shell that started it
    import time

    deadline = time.monotonic() + 10
    while not mark.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_kept_end_of_a_commands_output_fits_the_line_the_batch_joins_back_even_escaped():
    assert len(json.dumps({"ran": {"stdout": '"' * slurmnode.OUTPUT_KEPT, "stderr": '"' * slurmnode.ERRORS_KEPT}})) < plan.LINE_KEPT
