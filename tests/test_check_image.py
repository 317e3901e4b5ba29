"""check with a container image: the rules (facts in, problems out), the probe's command prefix inside the image,
the facts merged, and the host step's exchanges run end to end on this machine with a stand-in runtime."""

from __future__ import annotations

import copy
import getpass
import json
import subprocess
import sys
from pathlib import Path

from mnft.onhost.boot import FILE_BOOTSTRAP
from mnft.check.findings import CheckOptions, CheckReport, Need
from mnft.check.inimage import gather_image_facts, inside_command, inside_reply, merge
from mnft.check.rules import evaluate, image_problems, python_reference
from mnft.hosts import inventory, pyrun
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory
from mnft.image.runtime import CDI_FIX, Runtime, probe_argv

REF = "localhost/x:1"
ID1 = "sha256:" + "1234" * 16
ID2 = "sha256:" + "abcd" * 16
INV = inventory.parse("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n  h3: {address: 10.0.0.3}\n")

HOST = {  # a host's own facts, without its Python's packages (probe.py image-facts)
    "hostname": "n", "python": {"executable": "/usr/bin/python3", "version": "3.11.2"},
    "nvidia": {"driver": None, "gpus": []}, "disk": {"path": "/home/u", "free_bytes": 500 << 30, "total_bytes": 1000 << 30},
    "interfaces": [{"name": "eth0", "up": True, "ipv4": ["10.0.0.1/24"]}], "clock": 0.0, "rsync": "/usr/bin/rsync",
    "timings": {"total_s": 0.2, "torch_s": None}, "errors": {"fqdn": "DNS lookup timed out"},
}
INSIDE = {  # the probe's `python` mode inside the image
    "probe_version": 1, "python": {"executable": "/usr/local/bin/python3", "version": "3.12.4"},
    "torch": {"version": "2.13.0+cpu", "cuda": None}, "nccl": None, "cudnn": None, "dists": {"torch": "2.13.0+cpu"},
    "modules": {"peft": True}, "errors": {"dists": "x"}, "timings": {"total_s": 0.01, "torch_s": 0.001},
}


def container(image_id=ID1, present=True, runtime="podman", **changes):
    c = {"runtime": runtime, "path": f"/usr/bin/{runtime}" if runtime else None, "version": "4.3.1", "uid": 1000, "gid": 1000,
         "home": "/home/u", "rootless": runtime == "podman", "cdi": False, "gpus": False,
         "image": {"ref": REF, "present": present, "id": image_id if present else None}, "error": None}
    c.update(changes)
    return c


def ran_ok(inside=INSIDE):
    return {"exit_code": 0, "stdout": "noise\n" + json.dumps(inside) + "\n", "stderr": "", "error": None, "seconds": 0.8}


def host_facts(c=None, ran="ok", **inside_changes):
    c = container() if c is None else c
    inside = dict(copy.deepcopy(INSIDE), **inside_changes)
    return merge(copy.deepcopy(HOST), c, REF, ran_ok(inside) if ran == "ok" else ran)


def problems(all_facts, options=None):
    options = options or CheckOptions(network=False, image=REF)
    report = CheckReport(INV, {h.name: HostResult(h.name, Status.OK) for h in INV.hosts}, all_facts)
    return evaluate(INV, all_facts, report, options)


def by_host(found):
    return sorted((p.host, p.field) for p in found if p.severity == "error")


# ------------------------------------------------------------------------------------------------ pyrun's prefix


def test_a_command_prefix_stands_where_the_hosts_python_stands():
    host = Host("h1", 0, "10.0.0.1", python="/opt/py/bin/python3")
    prefix = ["podman", "run", "--rm", "-i", REF, "python3"]
    assert pyrun.command(host, "python", "--modules", "a,b", python=prefix).argv == (*prefix, "-c", pyrun.BOOTSTRAP, "python", "--modules", "a,b")
    assert pyrun.command(host, "facts", python=prefix, site=False).argv == (*prefix, "-S", "-c", pyrun.BOOTSTRAP, "facts")
    assert pyrun.command(host, "facts", python="/other/python").argv[0] == "/other/python"
    assert pyrun.command(host, "facts").argv[0] == "/opt/py/bin/python3"


def test_the_probes_command_inside_is_the_runtimes_probe_argv_then_the_bootstrap():
    host = Host("h1", 0, "10.0.0.1")
    c = container()
    argv = inside_command(host, c, REF, ("peft", "yaml"))
    prefix = probe_argv(Runtime.from_facts(c), ID1[7:], ["python3"])  # by the id just read: as train runs it
    assert argv == [*prefix, "-c", pyrun.BOOTSTRAP, "python", "--modules", "peft,yaml"]
    assert argv[:2] == ["/usr/bin/podman", "run"] and "--userns" in argv and "--pull" in argv


def test_no_command_inside_without_a_runtime_without_the_image_or_without_cdi_on_a_gpu_host():
    host = Host("h1", 0, "10.0.0.1")
    assert inside_command(host, container(runtime=None), REF) is None
    assert inside_command(host, container(present=False), REF) is None
    assert inside_command(host, None, REF) is None
    assert inside_command(host, container(gpus=True, cdi=False), REF) is None
    assert inside_command(host, container(gpus=True, cdi=True), REF) is not None


# ------------------------------------------------------------------------------------------------ the facts merged


def test_the_python_side_of_the_facts_is_the_images_and_the_hosts_python_is_kept_apart():
    f = host_facts()
    assert f["python"] == INSIDE["python"] and f["torch"] == INSIDE["torch"] and f["modules"] == {"peft": True}
    assert f["host_python"] == HOST["python"]
    assert f["container"] == container()  # imagehost's facts, as they came: train builds its container from them
    assert f["image_probe"] == {"image": REF, "python": "python3", "ran": True, "ok": True, "error": None, "seconds": 0.8}
    assert f["errors"] == {"fqdn": "DNS lookup timed out", "image.dists": "x"}
    assert f["disk"] == HOST["disk"] and f["clock"] == 0.0


def test_a_probe_that_could_not_run_inside_leaves_the_python_side_unknown_and_says_why():
    f = merge(copy.deepcopy(HOST), container(present=False), REF, None)
    assert f["python"] is None and f["torch"] is None and f["image_probe"]["ran"] is False and f["image_probe"]["error"] is None
    f = merge(copy.deepcopy(HOST), None, REF, None, container_error="NameError: facts")
    assert f["container"] is None and f["image_probe"]["error"] == "NameError: facts"


def test_image_facts_not_of_imagehosts_shape_are_none_and_say_so():
    for bad in ("podman", {"runtime": "podman"}, {"runtime": 3, "image": {"present": True}}, {"image": {"present": "yes"}},
                container(image_id=12)):
        f = merge(copy.deepcopy(HOST), bad, REF, None)
        assert f["container"] is None, bad
        assert f["image_probe"]["error"] == "not the answer imagehost gives (its contract: mnft/onhost/imagehost.py)"
    found = image_problems(INV, {"h1": merge(copy.deepcopy(HOST), "podman", REF, None)}, REF)
    assert [(p.host, p.field, p.message) for p in found] == [
        ("h1", "image", "the image's facts could not be read: not the answer imagehost gives (its contract: mnft/onhost/imagehost.py)")]


def test_the_reply_from_inside_is_its_last_json_line_or_the_runtimes_last_word():
    assert inside_reply(ran_ok()) == (INSIDE, None)
    missing = {"exit_code": 127, "stdout": "", "seconds": 0.3, "error": None,
               "stderr": "Trying...\nError: runc: exec: \"python3\": executable file not found in $PATH\n"}
    assert inside_reply(missing) == (None, 'Error: runc: exec: "python3": executable file not found in $PATH')
    assert inside_reply({"exit_code": None, "error": "no answer within 55s"}) == (None, "no answer within 55s")
    assert inside_reply({"exit_code": 0, "stdout": "hello\n", "stderr": ""}) == (None, "printed no JSON: hello")
    assert inside_reply({"exit_code": 3, "stdout": "", "stderr": ""}) == (None, "exit code 3")
    assert inside_reply(None) == (None, None)


# ------------------------------------------------------------------------------------------------ the rules


def test_the_same_image_everywhere_is_no_problem():
    assert problems({n: host_facts() for n in ("h1", "h2", "h3")}) == []


def test_a_host_without_a_runtime_is_named_with_the_fix():
    c = container(runtime=None, error="no container runtime found on PATH (podman, docker, apptainer, singularity)")
    found = image_problems(INV, {"h1": host_facts(), "h2": host_facts(c, ran=None)}, REF)
    assert [(p.host, p.field) for p in found] == [("h2", "runtime")]
    assert "no container runtime found on PATH" in found[0].message
    assert "install podman, docker or apptainer" in found[0].fix and "container_runtime:" in found[0].fix


def test_a_host_lacking_the_image_is_named_with_the_sync_fix():
    found = image_problems(INV, {"h1": host_facts(), "h2": host_facts(container(present=False), ran=None)}, REF)
    assert [(p.host, p.field, p.message, p.fix) for p in found] == [
        ("h2", "image", f"h2 lacks {REF}", f"mnft sync --image {REF} (relays it from a host that has it)")]


def test_a_different_image_names_both_ids_and_the_forced_sync():
    found = image_problems(INV, {"h1": host_facts(), "h2": host_facts(), "h3": host_facts(container(ID2))}, REF)
    assert [(p.host, p.field) for p in found] == [("h3", "image")]
    assert found[0].message == "h3 has sha256:abcdabcdabcd…, the master h1 has sha256:123412341234…"
    assert found[0].fix == f"mnft sync --image {REF} --force"


def test_without_the_image_on_the_master_the_first_host_that_has_it_is_the_reference():
    all_facts = {"h1": host_facts(container(present=False), ran=None), "h2": host_facts(container(ID2)), "h3": host_facts()}
    found = image_problems(INV, all_facts, REF)
    assert [(p.host, p.field) for p in found] == [("h1", "image"), ("h3", "image")]
    assert found[1].message == "h3 has sha256:123412341234…, h2 (the first host that has it; the master h1 does not) has sha256:abcdabcdabcd…"


def test_podman_on_a_gpu_host_without_cdi_is_named_with_the_cdi_fix():
    found = image_problems(INV, {"h1": host_facts(container(gpus=True, cdi=False), ran=None), "h2": host_facts(container(gpus=True, cdi=True))}, REF)
    assert [(p.host, p.field, p.fix) for p in found] == [("h1", "cdi", CDI_FIX)]
    docker = container(runtime="docker", gpus=True, cdi=False)  # the NVIDIA Container Toolkit's --gpus
    assert image_problems(INV, {"h1": host_facts(docker)}, REF) == []


def test_a_probe_that_failed_inside_the_image_is_named_with_its_last_line():
    missing = {"exit_code": 127, "stdout": "", "stderr": 'Error: exec: "python3": executable file not found in $PATH\n', "error": None}
    found = image_problems(INV, {"h1": host_facts(), "h2": host_facts(ran=missing)}, REF)
    assert [(p.host, p.field) for p in found] == [("h2", "image")]
    assert found[0].message == f'the probe inside {REF} failed: Error: exec: "python3": executable file not found in $PATH'
    assert found[0].fix.startswith("the image needs python3 (3.8 or newer) on its PATH")
    other = image_problems(INV, {"h1": host_facts(ran={"exit_code": 125, "stdout": "", "stderr": "Error: OCI runtime error\n"})}, REF)
    assert other[0].fix == f"run it by hand on h1 to see why: /usr/bin/podman run --rm -i {REF} python3 -V"


def test_the_versions_compared_are_the_images_and_the_hosts_own_python_needs_no_torch():
    # the hosts' own Pythons differ and have no torch: nothing to say, the job runs in the image
    all_facts = {"h1": host_facts(), "h2": host_facts(), "h3": host_facts(container(ID2), torch={"version": "2.12.0+cpu", "cuda": None})}
    all_facts["h2"]["host_python"] = {"executable": "/usr/bin/python3", "version": "3.9.2"}
    found = problems(all_facts)
    assert by_host(found) == [("h3", "image"), ("h3", "torch")]
    torch = next(p for p in found if p.field == "torch")
    assert torch.message == "torch 2.12.0+cpu in the image differs from the master's 2.13.0+cpu"
    assert torch.fix == f"one image everywhere: mnft sync --image {REF} --force"


def test_a_host_whose_image_did_not_answer_is_compared_on_nothing_python_side():
    all_facts = {"h1": host_facts(container(present=False), ran=None), "h2": host_facts(), "h3": host_facts()}
    assert python_reference(INV, all_facts, REF) == "h2"
    assert by_host(problems(all_facts)) == [("h1", "image")]  # no "torch not installed", no drift against the master's None


def test_an_image_without_torch_is_named():
    found = problems({"h1": host_facts(torch={"version": None, "cuda": None})})
    assert [(p.host, p.field) for p in found] == [("h1", "torch")]
    assert found[0].message == f"torch is not installed in the image {REF} (/usr/local/bin/python3)"


def test_a_module_the_image_lacks_is_named_with_the_image():
    need = Need("peft", "train.py:3", dist="peft")
    options = CheckOptions(network=False, image=REF, modules=(need,))
    found = problems({"h1": host_facts(), "h2": host_facts(modules={"peft": False})}, options)
    assert [(p.host, p.field) for p in found] == [("h2", "module")]
    assert found[0].message == f"peft is not importable by /usr/local/bin/python3 in the image {REF} (imported at train.py:3)"
    assert found[0].fix == f"install peft in the image (its build), then mnft sync --image {REF} --force"


def test_without_an_image_the_rules_are_todays():
    plain = {n: dict(copy.deepcopy(HOST), **{k: copy.deepcopy(INSIDE[k]) for k in ("python", "torch", "nccl", "cudnn", "dists")}) for n in ("h1", "h2")}
    plain["h2"]["torch"]["version"] = "2.12.0+cpu"
    found = problems(plain, CheckOptions(network=False))
    assert by_host(found) == [("h2", "torch")] and "pip install torch==2.13.0+cpu" in found[0].fix


def test_the_table_shows_each_hosts_image_id(monkeypatch):
    from mnft.check import report as report_module
    from mnft.core import output

    all_facts = {"h1": host_facts(), "h2": host_facts(container(present=False), ran=None), "h3": host_facts(container(ID2))}
    report = CheckReport(INV, {h.name: HostResult(h.name, Status.OK) for h in INV.hosts}, all_facts)
    console = output.console()
    with console.capture() as captured:
        monkeypatch.setattr(report_module, "console", lambda: console)
        report_module.print_check(report, as_json=False)
    text = captured.get()
    assert f"image {REF}" in text and "sha256:123412341234…" in text and "sha256:abcdabcdabcd…" in text and "absent" in text
    assert "2.13.0+cpu" in text  # the image's torch, not the host's (none)


# ------------------------------------------------------------------------------------------------ the host step


def test_the_host_step_answers_the_images_facts_the_hosts_and_the_command_it_is_sent(tmp_path):
    first = {"runtime": str(tmp_path / "no-podman"), "image": REF}  # imagehost's facts, from the probe's own payload
    shipped = tmp_path / "probe.payload"
    shipped.write_bytes(pyrun.payload("probe"))
    inner = {"argv": [sys.executable, "-c", FILE_BOOTSTRAP, str(shipped), "python", "--modules", "json,mnft_surely_absent"],
             "input": "", "timeout": 30}
    stdin = pyrun.payload("probe") + (json.dumps(first) + "\n" + json.dumps(inner) + "\n").encode()
    done = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, "image-facts", "--workdir", str(tmp_path)], input=stdin,
                          capture_output=True, timeout=60)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert done.returncode == 0 and len(lines) == 3, done.stderr.decode()
    container = lines[0]["container"]
    assert lines[0]["container_error"] is None and container["runtime"] is None and "no-podman" in container["error"]
    assert container["image"]["ref"] == REF and container["image"]["present"] is False
    host = next(line["facts"] for line in lines if "facts" in line)  # the host's facts and the command's: as each is ready
    assert "torch" not in host and "dists" not in host and host["disk"]["workdir"] == str(tmp_path)
    assert host["clock"] and host["timings"]["total_s"] > 0
    inside, error = inside_reply(next(line["ran"] for line in lines if "ran" in line))
    assert error is None and inside["modules"] == {"json": True, "mnft_surely_absent": False}


def test_the_host_step_says_when_the_images_facts_fail_and_still_answers_the_hosts(tmp_path):
    stdin = pyrun.payload("probe") + (json.dumps({"image": REF}) + "\n").encode()  # a request imagehost cannot read
    done = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, "image-facts", "--workdir", str(tmp_path)], input=stdin,
                          capture_output=True, timeout=60)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert {"container": None, "container_error": "KeyError: 'runtime'"} in lines and any("facts" in line for line in lines)


FAKE_RUNTIME = """#!/bin/sh
# a stand-in for podman: its version, the images it holds (IMAGES: "ref id" lines), and `run … ID CMD…` runs CMD here
IMAGES='{images}'
case "$1" in
  --version) echo "podman version 4.3.1" ;;
  image) id=$(printf '%s\\n' "$IMAGES" | while read -r ref id; do [ "$ref" = "$5" ] && echo "$id"; done)
         [ -n "$id" ] || {{ echo "Error: $5: image not known" >&2; exit 125; }}
         echo "$id" ;;
  run) shift; while [ $# -gt 0 ] && ! printf '%s\n' "$IMAGES" | grep -q " $1$"; do shift; done; shift; exec "$@" ;;
  *) exit 2 ;;
esac
"""


def fake_runtime(folder: Path, name: str, images: dict[str, str]) -> str:
    folder.mkdir(parents=True)
    path = folder / "podman"
    path.write_text(FAKE_RUNTIME.format(images="\n".join(f"{r} {i[7:]}" for r, i in images.items())))
    path.chmod(0o755)
    return str(path)


def test_gather_runs_one_command_per_host_and_the_probe_inside_where_the_image_is(tmp_path):
    hosts = (
        Host("h1", 0, "localhost", user=getpass.getuser(), python=sys.executable, connection="local", workdir=str(tmp_path),
             container_runtime=fake_runtime(tmp_path / "h1", "h1", {REF: ID1})),
        Host("h2", 1, "localhost", user=getpass.getuser(), python=sys.executable, connection="local", workdir=str(tmp_path),
             container_runtime=fake_runtime(tmp_path / "h2", "h2", {})),
    )
    with Fleet(Inventory(None, "mnft", hosts, "h1"), Timeouts(connect=10, command=60)) as fleet:
        results, facts, skew = gather_image_facts(fleet, REF, ("json", "mnft_surely_absent"))
    assert [r.status for r in results] == [Status.OK, Status.OK], [r.error for r in results]
    h1, h2 = facts["h1"], facts["h2"]
    assert h1["container"]["image"] == {"ref": REF, "present": True, "id": ID1}
    assert h1["image_probe"]["ok"] and h1["modules"] == {"json": True, "mnft_surely_absent": False}
    assert h1["torch"] is not None and h1["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert h2["container"]["image"]["present"] is False and h2["image_probe"]["ran"] is False and h2["torch"] is None
    assert set(skew) == {"h1", "h2"} and all(abs(s) < 2 for s in skew.values())
    found = image_problems(fleet.inventory, facts, REF)
    assert [(p.host, p.message) for p in found] == [("h2", f"h2 lacks {REF}")]


# ------------------------------------------------------------------------------------------------ a later check of a run


def test_a_later_check_requires_the_id_the_runs_first_check_verified_on_every_host():
    """A re-check before a restart (or a requeued attempt, a resumed run) compares each host's image with the id the
    run began in, not with the master's now: an image re-tagged on every host is a different image for the run."""
    all_facts = {n: host_facts(container(ID2)) for n in ("h1", "h2", "h3")}
    assert image_problems(INV, all_facts, REF) == []  # the same image everywhere: a new run may start in it
    found = image_problems(INV, all_facts, REF, expected_id=ID1)
    assert [(p.host, p.field) for p in found] == [("h1", "image"), ("h2", "image"), ("h3", "image")]
    assert found[0].message == f"h1 has sha256:abcdabcdabcd…, the run began in sha256:123412341234…: {REF} changed since the run's first check"
    assert "--force" in found[0].fix and "start a new run" in found[0].fix
    assert image_problems(INV, {n: host_facts() for n in ("h1", "h2", "h3")}, REF, expected_id=ID1) == []


def test_hosts_without_torch_pass_a_later_check_in_the_image_the_first_check_judged():
    """The lab's hosts have a Python without torch (/usr/bin/python3): a check without the image refuses them, the
    run's later check (recover.later_check of the first check's options) judges the image, by its id."""
    from mnft.check.rules import verified_image_id
    from mnft.run.recover import later_check

    all_facts = {n: host_facts() for n in ("h1", "h2", "h3")}
    first = CheckOptions(network=False, code=False, image=REF, modules=(Need("peft", "train.py:3"),), required_files=("data.json",))
    later = later_check(first, verified_image_id(INV, all_facts), 29500)
    assert (later.image, later.image_id, later.modules, later.required_files, later.port, later.find_free_port) == (
        REF, ID1, first.modules, ("data.json",), 29500, True)
    assert problems(all_facts, later) == []
    own = {n: dict(copy.deepcopy(HOST), torch=None) for n in ("h1", "h2", "h3")}  # what a check without the image reads
    assert [p.field for p in problems(own, CheckOptions(network=False, code=False)) if p.severity == "error"] == ["torch"] * 3
    assert later_check(CheckOptions(), ID1, None).image_id is None  # a job without an image requires none


def test_a_resumed_run_requires_the_image_id_its_previous_run_verified_for_the_same_image():
    from mnft.run.recover import resumed_image_id

    previous = {"run_id": "r1", "image": {"ref": REF, "id": ID1}}
    assert resumed_image_id(previous, REF) == ID1
    assert resumed_image_id(previous, "localhost/other:2") is None  # another image given by hand: judged as new
    assert resumed_image_id(previous, None) is None
    assert resumed_image_id({"run_id": "r0"}, REF) is None  # a record from before images were recorded
